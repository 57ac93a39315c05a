"""bench/bench_engine.py --peer sglang's plumbing without a server: its sizes, the check that
both engines did the same work before their speeds are compared, and the table of paired
ratios. The bench itself (a real SGLang server from its own venv, minutes) is no test: its
smoke run is `bench/bench_engine.py --peer sglang --smoke`."""

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "bench"))
import bench_engine
import engine_peer
from engine_load import Load


def test_sizes_per_mode():
    assert bench_engine.parse_args([]).burst_new_tokens == 6  # the baseline mode's burst
    args = bench_engine.parse_args(["--peer", "sglang", "--smoke"])
    assert (args.rounds, args.concurrency, args.burst_new_tokens) == (1, [1, 4], 4)
    assert engine_peer.row_names(args) == ["c1", "c4", "grpo n=8", "grpo 32 x 1"]
    assert engine_peer.expected_tokens(args, "c4") == 8 * 8
    assert engine_peer.expected_tokens(args, "grpo 32 x 1") == 32 * 4
    assert bench_engine.parse_args(["--peer", "sglang"]).burst_new_tokens == 32
    with pytest.raises(SystemExit):
        bench_engine.parse_args(["--peer", "sglang", "--baseline", "HEAD"])


def _round(args, seconds: float, tokens_off: int = 0) -> dict[str, Load]:
    return {
        name: Load(engine_peer.expected_tokens(args, name) - tokens_off, seconds, [seconds] * 8)
        for name in engine_peer.row_names(args)
    }


def test_table_gives_medians_of_paired_ratios():
    args = bench_engine.parse_args(["--peer", "sglang", "--smoke"])
    # Round 2 is slow for both: a ratio within each round stays 2x (tokens/s) and 0.5x (latency).
    rounds = {
        "millstream": [_round(args, 1.0), _round(args, 4.0), _round(args, 1.0)],
        "SGLang": [_round(args, 2.0), _round(args, 8.0), _round(args, 2.0)],
    }
    engine_peer.check_same_work(args, rounds)
    row = next(line for line in engine_peer.table(args, rounds).splitlines() if "| c4 |" in line)
    cells = [cell.strip() for cell in row.strip("|").split("|")]
    assert cells[4] == "2.00x" and cells[6] == "0.50x" and cells[8] == "0.50x", cells


def test_different_work_is_refused():
    args = bench_engine.parse_args(["--peer", "sglang", "--smoke"])
    rounds = {"millstream": [_round(args, 1.0)], "SGLang": [_round(args, 1.0, tokens_off=1)]}
    with pytest.raises(SystemExit, match="SGLang round 1 c1: 63 tokens"):
        engine_peer.check_same_work(args, rounds)
