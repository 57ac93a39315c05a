#!/usr/bin/env bash
# The main job. Until the trainer lands (issue 5) there is nothing to train yet.
set -euo pipefail
cd "$(dirname "$0")/.."
if [ -x examples/arith/run.sh ]; then
  exec bash examples/arith/run.sh
fi
echo "millstream: no main job yet (the trainer and examples/arith land with the trainer issue)."
echo "millstream: the environment is ready: .venv/bin/millstream --help"
