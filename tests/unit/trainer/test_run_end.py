"""How a run ends and resumes, without services: the stop that ends the trainer's loop between
iterations (Watch), summary.json on every way out, metrics.jsonl's resume rows and their
readers (history, plot, the chaos harness, bench_vs_peers). The real runs:
tests/e2e/test_run_end.py."""

from __future__ import annotations

import asyncio
import json
import os
import signal
from pathlib import Path
from types import SimpleNamespace

import pytest

from millstream.common.config import parse_run_config
from millstream.common.errors import MillstreamError
from millstream.common.keys import RunKeys
from millstream.trainer.admission import TerminalCounts
from millstream.trainer.observe import history, plot
from millstream.trainer.observe.metrics import MetricsLogger
from millstream.trainer.observe.summary import RunEnd, ended_by
from millstream.trainer.observe.watch import Stalled, Stopped, Watch

# -- the stop: between iterations ---------------------------------------------------------------


def _watch() -> Watch:
    # No Redis is asked: with a 300 s stall timeout the first look is 30 s away.
    return Watch(None, RunKeys("stop"), None, stall_timeout_s=300.0)


def test_a_stop_abandons_the_batch_wait_and_cancels_what_it_waited_for():
    async def go() -> tuple[bool, bool]:
        watch, cancelled = _watch(), asyncio.Event()

        async def take() -> list[str]:
            try:
                await asyncio.sleep(60)
            except asyncio.CancelledError:
                cancelled.set()
                raise
            return ["never"]

        asyncio.get_running_loop().call_later(0.05, watch.request_stop)
        with pytest.raises(Stopped, match="while waiting for a batch"):
            await watch.wait("a batch", take(), abandon=True)
        return watch.looping, cancelled.is_set()

    assert asyncio.run(go()) == (True, True)


def test_a_batch_that_came_is_trained_even_when_the_stop_came_too():
    """The buffer marks a batch trained as it hands it out: once it came, the step goes on."""

    async def go() -> list[str]:
        watch = _watch()

        async def take() -> list[str]:
            watch.request_stop()  # both are done at the next look
            return ["g1", "g2"]

        return await watch.wait("a batch", take(), abandon=True)

    assert asyncio.run(go()) == ["g1", "g2"]


def test_after_a_stop_the_next_batch_wait_never_starts_and_other_waits_go_on():
    async def go() -> tuple[str, bool]:
        watch, started = _watch(), []

        async def take() -> list[str]:
            started.append(True)
            return []

        watch.request_stop()
        synced = await watch.wait("a sync", asyncio.sleep(0.01, result="synced"), stall=False)
        with pytest.raises(Stopped, match="before a batch"):
            await watch.wait("a batch", take(), abandon=True)
        return synced, bool(started)

    assert asyncio.run(go()) == ("synced", False)


def test_looping_says_whether_the_trainer_reached_its_loop():
    async def go() -> list[bool]:
        watch = _watch()
        seen = [watch.looping]
        await watch.wait("the first eval", asyncio.sleep(0))
        seen.append(watch.looping)
        await watch.wait("a batch", asyncio.sleep(0), abandon=True)
        return [*seen, watch.looping]

    assert asyncio.run(go()) == [False, False, True]


@pytest.mark.parametrize("looping", [True, False])
def test_the_first_signal_asks_the_loop_to_stop_a_second_stops_at_once(looping):
    """main._until_signal: SIGINT while the loop runs asks it to stop between iterations
    (stop.graceful); SIGTERM next, or any signal before the loop runs, cancels the run."""
    from millstream.trainer import main

    stop, asked, reached = main._Stop(), [], []
    stop.graceful = lambda: asked.append(True) or looping

    async def run() -> int:
        os.kill(os.getpid(), signal.SIGINT)
        await asyncio.sleep(0.3)
        reached.append("after the first")
        os.kill(os.getpid(), signal.SIGTERM)
        await asyncio.sleep(30)
        return 0

    saved = signal.getsignal(signal.SIGTERM)
    try:
        assert asyncio.run(main._until_signal(run(), stop)) is None
    finally:
        signal.signal(signal.SIGTERM, saved)
    assert (stop.signal, asked, reached) == (
        "SIGINT",
        [True],
        ["after the first"] if looping else [],
    )


# -- summary.json ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("err", "signal_name", "expected"),
    [
        (None, None, ("finished", 0)),
        (None, "SIGTERM", ("signal SIGTERM", 130)),
        (KeyboardInterrupt(), None, ("signal SIGINT", 130)),
        (KeyboardInterrupt(), "SIGTERM", ("signal SIGTERM", 130)),
        (
            Stalled("no reward worker is alive"),
            None,
            ("stall timeout: no reward worker is alive", 1),
        ),
        (ValueError("bad row"), None, ("error: ValueError: bad row", 1)),
        # An error while stopping is the error, with its exit code.
        (OSError("disk full"), "SIGTERM", ("error: OSError: disk full", 1)),
    ],
)
def test_ended_by_names_the_way_out_and_its_exit_code(err, signal_name, expected):
    assert ended_by(err, signal_name) == expected


def _trainer(in_flight: dict[str, tuple[int, int]], **counts: int) -> SimpleNamespace:
    admission = SimpleNamespace(counts=TerminalCounts(**counts), in_flight=in_flight)
    buffer = SimpleNamespace(duplicates=1, earlier_run=0, dead_letters=0)
    return SimpleNamespace(
        p=SimpleNamespace(admission=admission, buffer=buffer), iteration=7, num_rollout=100,
        eval_history=[(0, 1.26, {"arith": 0.25})], completions_per_s=321.0,
    )  # fmt: skip


def test_the_summary_counts_every_admitted_group_and_names_those_in_flight(tmp_path, capsys):
    save = tmp_path / "ckpt"
    save.mkdir()
    (save / "iter_0000006").mkdir()
    (save / "latest_checkpointed_iteration.txt").write_text("6")
    end = RunEnd(tmp_path / "run", str(save))
    trainer = _trainer({"e0-i9": (0, 9), "e0-i3": (0, 3)}, admitted=20, trained=14, failed=2, filtered=1, dropped_stale=1)  # fmt: skip
    end.watch(trainer)
    end.take()
    trainer.p.admission.counts.trained += 5  # after take: not in the summary
    summary = end.write("signal SIGTERM", 130)
    assert json.loads((tmp_path / "run" / "summary.json").read_text()) == summary
    c = summary["counts"]
    assert (summary["ended"], summary["exit_code"], summary["checkpoint"]) == (
        "signal SIGTERM",
        130,
        6,
    )
    assert summary["in_flight_ids"] == ["e0-i3", "e0-i9"] and c["in_flight"] == 2
    assert c["admitted"] == 20 == sum(
        c[k] for k in ("trained", "filtered", "failed", "dropped_stale", "dropped_at_end", "in_flight")
    )  # fmt: skip
    assert (summary["iteration"], summary["eval_curve"]) == (7, [[0, 1.3, {"arith": 0.25}]])
    out = capsys.readouterr().out
    assert "in_flight=2" in out and "[trainer] ended: signal SIGTERM (exit code 130)" in out


def test_a_run_that_failed_before_its_trainer_existed_has_a_summary_too(tmp_path):
    summary = RunEnd(tmp_path, None).write("error: MillstreamError: engine-0 died", 1)
    assert summary["counts"]["admitted"] == 0 and summary["in_flight_ids"] == []
    assert summary["checkpoint"] is None and summary["resumes"] == []
    assert json.loads((tmp_path / "summary.json").read_text())["ended"].startswith("error: ")


# -- metrics.jsonl across a resume -----------------------------------------------------------


def _row(step: int, reward: float, gids: int = 2) -> dict:
    return {"step": step, "time": 1e9 + step, "raw_reward": reward, "loss": 0.1,
            "group_ids": [f"e0-i{step}-{k}" for k in range(gids)]}  # fmt: skip


def _logger(run_dir: Path) -> MetricsLogger:
    cfg = parse_run_config(["--run-id", "hist", "--rollout-batch-size", "1"])
    return MetricsLogger(cfg, run_dir)


def test_a_resume_row_names_the_discarded_iterations_and_what_they_trained(tmp_path, capsys):
    """A trainer killed after iteration 5 (its last row half-written), resumed from the
    checkpoint of iteration 3: the row before its own names 4 and 5, which it trains again;
    nothing is deleted but the half line, and the readers see the run as it stands."""
    path = tmp_path / "metrics.jsonl"
    killed = [_row(s, 0.1 * s) for s in range(1, 6)]
    path.write_text("".join(json.dumps(r) + "\n" for r in killed) + '{"step": 6, "ti')
    logger = _logger(tmp_path)
    row = logger.mark_resume(3)
    for step in (4, 5, 6):
        logger.log(step, {k: v for k, v in _row(step, 1.0, gids=3).items() if k != "step"})
    logger.close()
    assert (row["resumed_from"], row["discarded_iterations"], row["discarded_trained"]) == (
        3,
        [4, 5],
        4,
    )
    assert (
        "iterations 4-5 after the checkpoint of iteration 3 discarded (4 groups"
        in capsys.readouterr().out
    )
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    assert [r.get("step", "resume") for r in lines] == [1, 2, 3, 4, 5, "resume", 4, 5, 6]
    h = history.read(path)
    assert [(r["step"], r["raw_reward"]) for r in h.rows] == [(1, 0.1), (2, 0.2), (3, 0.30000000000000004), (4, 1.0), (5, 1.0), (6, 1.0)]  # fmt: skip
    assert [r["resumed_from"] for r in h.resumes] == [3]
    run = plot.load_run(tmp_path)
    assert run.series("raw_reward") == ([1, 2, 3, 4, 5, 6], [0.1, 0.2, 0.30000000000000004, 1.0, 1.0, 1.0])  # fmt: skip
    # A second kill and resume counts only what the second process wrote after its checkpoint.
    assert history.read(path).resume_row(5)["discarded_iterations"] == [6]
    assert RunEnd(tmp_path, None).write("finished", 0)["resumes"] == [
        {"resumed_from": 3, "discarded_iterations": [4, 5], "discarded_trained": 4}
    ]


def test_a_fresh_run_in_a_reused_run_dir_starts_a_new_history(tmp_path):
    path = tmp_path / "metrics.jsonl"
    rows = [_row(s, 0.0) for s in range(1, 5)] + [_row(s, 1.0) for s in range(1, 3)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert [(r["step"], r["raw_reward"]) for r in history.read(path).rows] == [(1, 1.0), (2, 1.0)]
    assert history.read(path).resume_row(2)["discarded_iterations"] == []


def test_a_bad_line_is_named_or_skipped_when_a_trainer_resumes(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text(json.dumps(_row(1, 0.0)) + "\n{oops\n" + json.dumps(_row(2, 0.0)) + "\n")
    with pytest.raises(MillstreamError, match=r"metrics\.jsonl:2: not JSON"):
        history.read(path)
    assert [r["step"] for r in history.read(path, strict=False).rows] == [1, 2]


def test_the_chaos_harness_and_bench_read_past_a_resume_row(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[3] / "bench"))
    from bench_vs_peers import read_metrics

    from tests.chaos.harness import trained_twice

    path = tmp_path / "metrics.jsonl"
    rows = [_row(1, 0.0), _row(2, 0.0), _row(3, 0.0)]
    resume = {"resumed_from": 1, "discarded_iterations": [2, 3], "discarded_trained": 4}
    rows += [resume, _row(2, 0.0), _row(3, 0.0)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert trained_twice(path) == 0
    assert [r["step"] for r in read_metrics(tmp_path)] == [1, 2, 3, 2, 3]
