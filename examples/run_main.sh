#!/usr/bin/env bash
# The main job (`make run`): examples/arith/run.sh, GRPO on the arith task with every service
# started locally (its header says which mode and why).
# `make run` asks for a run each time (RERUN=1): an earlier one in runs/arith, finished or not,
# is moved aside to runs/arith.prev-<time> (run.sh), never deleted; RERUN=0 make run keeps a
# finished one as it is instead (run.sh then says so and exits 0).
set -euo pipefail
cd "$(dirname "$0")/.."
RERUN="${RERUN:-1}" exec bash examples/arith/run.sh
