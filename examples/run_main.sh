#!/usr/bin/env bash
# The main job (`make run`): examples/arith/run.sh, GRPO on the arith task with every service
# started locally (its header says which mode and why).
set -euo pipefail
cd "$(dirname "$0")/.."
exec bash examples/arith/run.sh
