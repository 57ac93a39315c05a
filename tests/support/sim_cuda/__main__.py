"""`python -m tests.support.sim_cuda engine ...`: a millstream service (`millstream.cli`'s
arguments) run on the simulated device, for the integration tests that start a real engine
process with `--device cuda` where there is no GPU."""

from __future__ import annotations

import sys

from tests.support.sim_cuda import simulated_cuda

if __name__ == "__main__":
    from millstream.cli import main

    with simulated_cuda():
        code = main(sys.argv[1:])
    sys.exit(code)
