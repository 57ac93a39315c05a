"""The whole loop through real processes: `millstream train` / `train-async` on a tiny model.

Each run starts its own redis-server, engine(s), router and workers as children, trains,
syncs weights to the engines over gloo, and shuts everything down.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import httpx
import pytest
import torch

from millstream.tools import trace_cli
from tests.support.tiny_job import job_flags, write_prompts

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(400)]


@pytest.fixture(scope="module")
def prompts(tmp_path_factory) -> Path:
    return write_prompts(tmp_path_factory.mktemp("data") / "prompts.jsonl")


def _flags(model: Path, prompts: Path, run_dir: Path, *extra: str) -> list[str]:
    return job_flags(
        model, prompts, run_dir, "--rollout-temperature", "1.0", "--lr", "1e-3",
        "--num-rollout-workers", "2", "--num-reward-workers", "1", *extra,
    )  # fmt: skip


SPREAD = "tests.support.reward_plugins.spread"


def _spread_reward(flags: list[str]) -> list[str]:
    """`flags` scored by a reward under which the random tiny model has something to learn
    (`--rm-type exact` gives it 0 for every answer: a zero gradient)."""
    i = flags.index("--rm-type")
    return [*flags[:i], "--custom-rm-path", SPREAD, *flags[i + 2 :]]


def _train(command: str, flags: list[str]) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    return subprocess.run(
        [sys.executable, "-m", "millstream.cli", command, *flags],
        capture_output=True,
        text=True,
        timeout=360,
        env=env,
    )


def _records(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def _check_run(proc: subprocess.CompletedProcess[str], run_dir: Path, iterations: int) -> dict:
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = [line for line in proc.stdout.splitlines() if line.startswith("[trainer] iter ")]
    assert len(rows) == iterations and rows[-1].startswith(
        f"[trainer] iter {iterations}/{iterations} | loss="
    )
    summary = json.loads((run_dir / "summary.json").read_text())
    c = summary["counts"]
    assert (
        c["admitted"]
        == c["trained"] + c["filtered"] + c["failed"] + c["dropped_stale"] + c["dropped_at_end"]
    )
    assert c["in_flight_lost"] == 0 and c["trained"] == 2 * iterations
    trained = [gid for r in _records(run_dir) for gid in r["group_ids"]]
    assert len(trained) == len(set(trained)) == 2 * iterations
    # It trained: a run with a zero gradient everywhere would pass every check above.
    assert any(r["grad_norm"] > 0 for r in _records(run_dir)), _records(run_dir)
    return summary


def _check_whole_traces(run_dir: Path) -> trace_cli.Run:
    """At least 95% of the trained groups (here: all) have a whole trace: admission, rollout,
    the router and engine spans of the request that carried them (a batch's too, though it is
    in one group's trace only), reward, buffer, the train step and the sync that shipped it."""
    spans, unreadable = trace_cli.read_spans(run_dir)
    assert unreadable == 0
    run = trace_cli.Run.index(spans)
    broken = trace_cli.not_whole(run)
    assert run.trained_in and len(broken) <= 0.05 * len(run.trained_in), broken
    return run


# The stages of spans shared by many groups, which telemetry.mirror copies into their traces.
MIRRORED = ("router", "engine", "train_step", "weight_sync")


def _check_mirrors(run_dir: Path, run: trace_cli.Run) -> Counter[str]:
    """A trace viewer shows one trace at a time, so each trained group's own trace holds a
    copy, under one of its spans, of every shared span of its life that lives in another
    trace: the train step that consumed it and the sync that shipped it (the trainer's
    iteration trace), and the router and engine spans of a batch request (its first member's
    trace). `millstream trace` skips the copies (it follows the links), so only this sees them.
    Returns how many shared spans of each stage were found copied."""
    copies = trace_cli.read_mirrors(run_dir)
    found: Counter[str] = Counter()
    missing = []
    for gid in sorted(run.trained_in):
        admit = [s for s in run.groups[gid] if s.stage == "admit"]
        assert admit, f"group {gid} has no admit span: which trace is its own?"
        trace_id, own = admit[0].trace_id, {s.span_id for s in run.groups[gid]}
        copy_of = {c.mirror_of: c for c in copies.get(trace_id, ()) if c.parent in own}
        for s in trace_cli.group_timeline(run, gid):
            if s.stage not in MIRRORED or s.trace_id == trace_id:
                continue
            if s.span_id in copy_of and copy_of[s.span_id].stage == s.stage:
                found[s.stage] += 1
            else:
                missing.append(f"group {gid}: its trace {trace_id} lacks a copy of its {s.stage} "
                               f"span {s.name!r} ({s.service}, span {s.span_id})")  # fmt: skip
    assert not missing, "shared spans not mirrored into the groups' traces:\n" + "\n".join(missing)
    trained = len(run.trained_in)
    assert found["train_step"] == found["weight_sync"] == trained, (found, trained)
    return found


def _check_traces(run_dir: Path) -> None:
    """`millstream trace` finds every stage of a group's life in the services' span files,
    and one trained group's waterfall runs from its admission to the sync that shipped it."""
    from millstream.common.telemetry import STAGES

    run = _check_whole_traces(run_dir)
    # The two groups of a batch are claimed together and go out as one request, in the first
    # one's trace: so the other's router and engine spans are copies (the check is not empty).
    mirrored = _check_mirrors(run_dir, run)
    assert mirrored["router"] >= 1 and mirrored["engine"] >= 1, mirrored
    spans = run.spans
    assert set(trace_cli.stage_table(run)) == set(STAGES) - {"reward_task"}  # no Celery here
    assert sorted(run.iterations) == [1, 2, 3] and len(run.trained_in) == 6
    assert sorted(run.evals) == [0, 3]
    services = {s.service for s in spans}
    assert services == {"trainer", "rollout", "router", "engine", "reward"}  # compose's names
    # Sync mode hands out the next iteration's prompts while the idle sync ships their weights
    # (the router holds their requests until the engines have them).
    syncs = sorted((s.start, s.end) for s in spans if s.name == "trainer.weight_sync")
    sends = [s.start for s in spans if s.name.startswith("send ") and s.name.endswith(":prompts")]
    assert len(syncs) == 3 and all(any(a <= t <= b for t in sends) for a, b in syncs[:2])
    gid = min(run.trained_in)
    stages = [s.stage for s in trace_cli.group_timeline(run, gid)]
    assert stages[0] == "admit" and stages[-2:] == ["train_step", "weight_sync"]
    out = subprocess.run(
        [sys.executable, "-m", "millstream.cli", "trace", str(run_dir), "--group", gid],
        capture_output=True, text=True, timeout=60, env={**os.environ, "COLUMNS": "120"},
    ).stdout  # fmt: skip
    assert f"group {gid}:" in out and "trainer.weight_sync" in out and "█" in out


def _check_curves_tensorboard_and_profile(run_dir: Path) -> None:
    """The run's plots are drawn, its tensorboard events read back under Miles' namespaces,
    and the profiled rollout's trace opens with the train step in it."""
    import gzip

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from millstream.trainer.observe import plot

    assert plot.main([str(run_dir)]) == 0
    assert {p.name for p in (run_dir / "plots").glob("*.png")} >= {"reward.png", "timings.png"}
    acc = EventAccumulator(str(run_dir / "tb"))
    acc.Reload()
    tags = set(acc.Tags()["scalars"])
    assert {"train/loss", "rollout/raw_reward", "perf/update_weights_time", "eval/dev_set"} <= tags
    assert [e.step for e in acc.Scalars("rollout/raw_reward")] == [0, 1, 2]  # Miles' rollout ids
    (trace_file,) = (run_dir / "tb").glob("train_overall_rollout1.pt.trace.json*")
    events = json.loads(gzip.decompress(trace_file.read_bytes()))["traceEvents"]
    assert any(e.get("name") == "millstream.train_overall" for e in events)


@pytest.mark.parametrize("command", ["train", "train-async"])
def test_three_iterations_through_every_service(command, tiny_model_dir, prompts, tmp_path):
    run_dir = tmp_path / f"run-{command}"
    extra = ["--num-rollout", "3", "--save", str(run_dir / "ckpt"), "--save-interval", "3"]
    if command == "train-async":  # and with plugins written for Miles, Miles' imports and all
        extra += ["--max-staleness", "2", "--metrics-port", "0",
                  "--data-source-path", f"{MILES}.JsonlDataSource",
                  "--custom-generate-function-path", f"{MILES}.generate",
                  "--custom-rm-path", f"{MILES}.length_rm",
                  "--dynamic-sampling-filter-path", f"{MILES}.drop_marked",
                  "--rollout-sample-filter-path", f"{MILES}.sample_filter",
                  "--custom-rollout-log-function-path", f"{MILES}.log_rollout_data"]  # fmt: skip
    else:  # eval through the same services: before training and after iteration 3
        extra += ["--eval-prompt-data", "dev_set", str(prompts), "--eval-interval", "3",
                  "--eval-temperature", "0", "--eval-max-prompt-len", "4",
                  "--tensorboard-dir", str(run_dir / "tb"), "--use-pytorch-profiler",
                  "--profile-step-start", "1", "--profile-step-end", "2"]  # fmt: skip
    flags = _flags(tiny_model_dir, prompts, run_dir, *extra)
    proc = _train(command, flags if command == "train-async" else _spread_reward(flags))
    summary = _check_run(proc, run_dir, 3)
    if command == "train":
        assert all(r["grad_norm"] > 0 for r in _records(run_dir))
        assert [(it, sorted(acc)) for it, _, acc in summary["eval_curve"]] == [
            (0, ["dev_set"]),
            (3, ["dev_set"]),
        ]
        assert (
            "eval/dev_set" in _records(run_dir)[-1]
            and "eval at iter 3 (version 3): dev_set=" in proc.stdout
        )
        _check_traces(run_dir)
        _check_curves_tensorboard_and_profile(run_dir)
        # The batch after the last one is never handed out (the sync ships nothing to wait for).
        counts = summary["counts"]
        assert counts["admitted"] == counts["trained"] == 6 and counts["dropped_at_end"] == 0
    versions = [r["version"] for r in _records(run_dir)]
    assert versions == [1, 2, 3]
    # Said at start-up: how the weights reach the engine (one machine, CPU: shared memory).
    assert "weight transport to http://127.0.0.1:" in proc.stdout
    assert "tensor over shared memory (on this machine, on a CPU)" in proc.stdout
    assert (run_dir / "ckpt" / "latest_checkpointed_iteration.txt").read_text() == "3"
    if command == "train-async":
        assert max(r["staleness_max"] for r in _records(run_dir)) <= 2
        assert "[trainer] Prometheus /metrics on port " in proc.stdout  # served, then closed
        # Miles' generate posts with the group's trace context, one request per sample
        _check_mirrors(run_dir, _check_whole_traces(run_dir))
        _check_miles_plugins(run_dir, summary)


MILES = "tests.support.miles_plugins"


def _check_miles_plugins(run_dir: Path, summary: dict) -> None:
    """The Miles plugins' run: prompts came from the data source (every third marked and
    filtered, then replaced), samples from Miles' per-sample generate, rewards from the custom
    rm, sample 0 of each group out of the loss, and the log function saw Miles' Samples; the
    data source saved with the checkpoint."""
    assert summary["counts"]["filtered"] >= 1  # the marked groups, replaced by admission
    logged = [json.loads(line) for line in (run_dir / "miles_log.jsonl").read_text().splitlines()]
    assert [r["rollout_id"] for r in logged] == [0, 1, 2]
    samples = [s for r in logged for s in r["samples"]]
    assert len(samples) == 3 * 2 * 2 and all(r["n_samples_per_prompt"] == 2 for r in logged)
    for s in samples:
        row = s["metadata"]["row"]
        assert s["prompt"] == f"{row}+{row}=" and not s["metadata"]["drop"]
        assert s["group_index"] == s["metadata"]["group_index"]
        assert s["reward"] == float(len(s["response"])) and s["response_length"] > 0
        assert s["metadata"]["generated_by"] == "miles generate"
        if s["index"] == 0:  # the sample filter's: out of the loss
            assert s["loss_mask"] == ([0] * s["response_length"] or None)
        else:
            assert s["loss_mask"] is None or all(s["loss_mask"])
    assert json.loads((run_dir / "data_source_2.json").read_text())["offset"] >= 6


def test_engine_weights_equal_the_trainers_after_sync(tiny_model_dir, prompts, tmp_path):
    """A run against engines we started ourselves: after it, the engine answers with the
    trainer's final weights (its logprobs equal a forward pass of the saved checkpoint). The
    run trains with a non-zero gradient and moves the weights far more than the check's
    tolerance, so an engine that skipped the syncs fails the same check: a second engine, of
    the same starting model but never in the router's list, is that broken variant.
    The Megatron tensor-parallel run's: tests/e2e/test_train_ddp.py."""
    from tests.support.engine_proc import EngineProcess
    from tests.support.router_proc import start_router

    run_dir = tmp_path / "run-ext"
    engine = EngineProcess(tiny_model_dir, tmp_path, "--weight-version", "0")
    skipped = EngineProcess(tiny_model_dir, tmp_path, "--weight-version", "0")
    router = start_router(tmp_path, "--worker-urls", engine.url)
    try:
        flags = _flags(
            tiny_model_dir, prompts, run_dir, "--num-rollout", "2", "--save", str(run_dir / "ckpt")
        )
        proc = _train("train", [*_spread_reward(flags), "--router-url", router.url])
        _check_run(proc, run_dir, 2)
        assert all(r["grad_norm"] > 0 for r in _records(run_dir)), _records(run_dir)
        trained = run_dir / "ckpt" / "iter_0000002" / "model"
        check_engine_serves(engine.url, trained, "2")
        # The check can tell: the engine that missed both syncs is far off, and fails it.
        gap = _logprob_gap(skipped.url, trained)
        assert gap > 100 * LOGPROB_ATOL, f"training moved the logprobs by only {gap:.2e}"
        with pytest.raises(AssertionError, match="logprobs are"):
            check_engine_serves(skipped.url, trained, "0")
    finally:
        router.stop()
        engine.stop()
        skipped.stop()


LOGPROB_ATOL = 1e-4


def _logprob_gap(engine_url: str, model_dir: Path) -> float:
    """Largest |engine logprob - `model_dir`'s logprob| over a greedy answer of the engine."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir)
    prompt = [5, 6, 7, 8]
    out = httpx.post(
        f"{engine_url}/generate",
        json={
            "input_ids": prompt,
            "sampling_params": {"max_new_tokens": 5, "temperature": 0},
            "return_logprob": True,
        },
        timeout=60,
    ).json()
    tokens = [t for _, t, _ in out["meta_info"]["output_token_logprobs"]]
    engine_logp = torch.tensor([lp for lp, _, _ in out["meta_info"]["output_token_logprobs"]])
    with torch.no_grad():
        logits = model(torch.tensor([prompt + tokens])).logits[0]
    expected = torch.log_softmax(logits, -1)[
        torch.arange(len(prompt) - 1, len(prompt) + len(tokens) - 1), tokens
    ]
    return float((engine_logp - expected).abs().max())


def check_engine_serves(engine_url: str, model_dir: Path, version: str) -> None:
    """The engine serves `version`, and its logprobs of a greedy answer equal a forward pass
    of the Hugging Face model saved in `model_dir` (the trainer's weights)."""
    assert httpx.get(f"{engine_url}/get_weight_version").json()["weight_version"] == version
    gap = _logprob_gap(engine_url, model_dir)
    assert gap <= LOGPROB_ATOL, f"the engine's logprobs are {gap:.2e} off {model_dir}'s"


def _children_from(lines: list[str]) -> dict[str, int]:
    """name -> pid of every service the launcher said it started."""
    found = {}
    for line in lines:
        if line.startswith("[launcher] starting ") and "(pid " in line:
            name = line.split()[2]
            found[name] = int(line.split("(pid ", 1)[1].split(",", 1)[0])
    return found


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return Path(f"/proc/{pid}/stat").exists() and " Z " not in Path(f"/proc/{pid}/stat").read_text()


@pytest.mark.parametrize(
    "sig", [signal.SIGTERM, pytest.param(signal.SIGKILL, marks=pytest.mark.long)]
)
def test_stopping_the_trainer_stops_every_child_quietly(sig, tiny_model_dir, prompts, tmp_path):
    """SIGTERM stops the run like Ctrl-C, service by service; SIGKILL leaves each child its
    death signal. Either way every child is gone within seconds, and no log shows a
    traceback or an unretrieved task exception (a worker retrying a gone router, say)."""
    run_dir = tmp_path / "run-stop"
    flags = _flags(tiny_model_dir, prompts, run_dir, "--num-rollout", "100000")
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    trainer = subprocess.Popen(
        [sys.executable, "-m", "millstream.cli", "train-async", *flags],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
    )  # fmt: skip
    lines: list[str] = []
    try:
        for line in trainer.stdout:  # type: ignore[union-attr]
            lines.append(line)
            if line.startswith("[trainer] iter 3/"):
                break
        children = _children_from(lines)
        assert {"redis", "engine-0", "router", "rollout-0", "reward-0"} <= set(children), lines
        trainer.send_signal(sig)
        lines += trainer.stdout.read().splitlines()  # type: ignore[union-attr]
        trainer.wait(timeout=30)
        deadline = time.monotonic() + 10
        while any(_alive(pid) for pid in children.values()) and time.monotonic() < deadline:
            time.sleep(0.1)
        left = {name: pid for name, pid in children.items() if _alive(pid)}
        assert not left, f"still running 10 s after the trainer: {left}"
    finally:
        if trainer.poll() is None:
            trainer.kill()
            trainer.wait()
        trainer.stdout.close()  # type: ignore[union-attr]
    for log in (run_dir / "logs").glob("*.log"):
        text = log.read_text(errors="replace")
        assert "Traceback" not in text and "never retrieved" not in text, (log.name, text[-3000:])
    if sig == signal.SIGTERM:
        assert "Traceback" not in "".join(lines), "".join(lines)[-3000:]
        stops = [line for line in lines if line.startswith("[launcher] stopped ")]
        assert stops and "reward-0" in stops[0], lines  # in order: workers first
