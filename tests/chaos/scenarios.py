"""The chaos scenarios: each deploys a run, injects one kind of fault while the trainer trains,
and returns a `Row` of the table with what it saw and every broken promise in `problems`.

`size` scales a scenario: `make test` runs them short (seconds), `make chaos` long (minutes).
The promises checked everywhere: the trainer exits 0, no admitted group is lost (admitted ==
the sum of terminal states, none in flight at the end), none is trained twice.
"""

from __future__ import annotations

import json
import random
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import httpx
import redis

from millstream.common.keys import RunKeys
from millstream.common.streams import entry_fields
from millstream.common.types import PromptGroup

from .harness import (
    HEALTH_INTERVAL_S,
    ROOT,
    Deployment,
    Row,
    RunResult,
    failed_groups,
    write_prompts,
)


def check_run(row: Row, result: RunResult) -> Row:
    row.result = result
    if result.returncode != 0:
        row.problems.append(f"trainer exited {result.returncode}:\n{result.log[-3000:]}")
    if not result.counts:
        row.problems.append("no summary.json")
    if result.lost:
        row.problems.append(f"{result.lost} groups lost: {result.counts}")
    if result.trained_twice:
        row.problems.append(f"{result.trained_twice} groups trained twice")
    return row


def _all_alive(d: Deployment, row: Row) -> None:
    for name, proc in d.workers.procs.items():
        if proc.poll() is not None:
            row.problems.append(f"{name} died:\n{d.workers.log(name)[-2000:]}")


def workers_killed(workdir: Path, model: Path, *, iterations: int, every_s: float) -> Row:
    """SIGKILL a rollout or a reward worker every `every_s`, and start it again at once."""
    d = Deployment(workdir, model, write_prompts(workdir / "prompts.jsonl"), rollout=2, reward=2)
    kills = 0
    try:
        trainer = d.start_trainer(iterations)
        d.wait_iterations(1, trainer)
        rng = random.Random(0)
        while trainer.poll() is None:
            time.sleep(every_s)
            if trainer.poll() is not None:
                break
            name = rng.choice(sorted(d.workers.procs))
            d.workers.kill(name)
            d.spawn_worker(name.split("-")[0], name)
            kills += 1
        row = Row("SIGKILL a rollout/reward worker", kills, "")
        check_run(row, d.finish(trainer))
        _all_alive(d, row)
        row.outcome = f"every kill recovered; {row.result.counts.get('failed', '?')} failed"
        return row
    finally:
        d.stop()


def engine_killed(
    workdir: Path, model: Path, *, iterations: int, kills: int, first_at: int | None = None
) -> Row:
    """SIGKILL one of two engines while it generates; the router must take it out of routing
    within a health interval, and the engine started again must serve the trainer's current
    weights before the router sends it anything."""
    d = Deployment(workdir, model, write_prompts(workdir / "prompts.jsonl"), engines=2)
    row = Row("SIGKILL an engine mid-generation", 0, "")
    ejections: list[float] = []
    try:
        trainer = d.start_trainer(iterations)
        victim = d.engines[1]
        for k in range(kills):
            # Early enough that the run outlasts the restarted engine's boot (~5-10 s). The
            # trainer goes on while a restarted engine boots and joins (~100 iterations of
            # the tiny model on 2 cores): the full suite runs 600 for 3 kills, or the last
            # restart would still be booting when the run ends.
            at = first_at if first_at and k == 0 else (k + 1) * iterations // (4 * kills)
            d.wait_iterations(max(2, at), trainer)
            # Both engines routed first: an engine slow to boot (a busy machine) may join
            # after the run started, and killing the only one routed ends the run.
            deadline = time.monotonic() + 60
            while not all(d.engine_eligible(e.url) for e in d.engines):
                if time.monotonic() > deadline or trainer.poll() is not None:
                    row.problems.append("the engines were never both routed")
                    break
                time.sleep(0.05)
            victim.kill()
            victim.stop()  # reaped, its log closed
            row.injected += 1
            killed_at = time.monotonic()
            while d.engine_eligible(victim.url) and time.monotonic() - killed_at < 30:
                time.sleep(0.05)
            ejections.append(time.monotonic() - killed_at)
            time.sleep(1.0)  # some rollouts run on the other engine alone
            victim = d.engines[1] = d.start_engine(port=victim.port)
            victim.wait_ready("/health")
            # Up again, it must not be routed before the trainer synced it in.
            while not d.engine_eligible(victim.url) and trainer.poll() is None:
                time.sleep(0.05)
            if trainer.poll() is None:
                served = int(d.engine_version(victim.url))
                if served < d.iterations() - 1:
                    row.problems.append(f"restarted engine routed at v{served}, trainer further")
            else:
                row.problems.append("the run ended before the restarted engine was routed")
        result = d.finish(trainer)
        check_run(row, result)
        if result.counts.get("failed"):
            row.problems.append(f"{result.counts['failed']} groups failed: not retried elsewhere")
        for engine in d.engines:
            if result.returncode == 0 and d.engine_version(engine.url) != str(iterations):
                row.problems.append(f"{engine.url} serves v{d.engine_version(engine.url)}")
        slowest = max(ejections, default=0.0)
        if slowest > 2 * HEALTH_INTERVAL_S + 1:
            row.problems.append(f"the router took {slowest:.1f}s to eject a dead engine")
        row.outcome = f"ejected in <= {slowest:.1f}s; rejoined at the current version"
        return row
    finally:
        d.stop()


def trainer_killed(workdir: Path, model: Path, *, iterations: int, save_interval: int) -> Row:
    """SIGKILL the trainer halfway between two checkpoints and start it again with --load: it
    resumes from the last checkpoint and the run's counts add up."""
    d = Deployment(workdir, model, write_prompts(workdir / "prompts.jsonl"))
    ckpt = str(workdir / "ckpt")
    flags = ("--save", ckpt, "--load", ckpt, "--save-interval", str(save_interval))
    try:
        trainer = d.start_trainer(iterations, *flags)
        kill_at = save_interval + save_interval // 2
        d.wait_iterations(kill_at, trainer)
        trainer.send_signal(signal.SIGKILL)
        trainer.wait()
        killed_after = d.iterations()
        # On a busy machine the trainer may pass the next checkpoint before the kill lands:
        # it must resume from the last one it wrote, whichever that is.
        saved = int((workdir / "ckpt" / "latest_checkpointed_iteration.txt").read_text())
        resumed = d.start_trainer(iterations, *flags)
        row = Row("SIGKILL the trainer mid-iteration", 1, "")
        result = d.finish(resumed)
        check_run(row, result)
        if not save_interval <= saved < iterations:
            row.problems.append(f"killed with checkpoint {saved} on disk, not mid-run")
        if f"resumed at iteration {saved}" not in result.log:
            row.problems.append(f"did not resume from iteration {saved}")
        _all_alive(d, row)
        row.outcome = f"killed after iter {killed_after}, resumed from {saved}"
        return row
    finally:
        d.stop()


def redis_restarted(workdir: Path, model: Path, *, iterations: int, restarts: int) -> Row:
    """Restart Redis (SIGTERM, AOF on) while the run goes: every service reconnects."""
    d = Deployment(workdir, model, write_prompts(workdir / "prompts.jsonl"))
    row = Row("restart Redis (AOF on)", 0, "")
    try:
        trainer = d.start_trainer(iterations)
        for k in range(restarts):
            d.wait_iterations((k + 1) * iterations // (restarts + 1), trainer)
            d.redis.restart()
            row.injected += 1
        check_run(row, d.finish(trainer))
        _all_alive(d, row)
        row.outcome = "services reconnected"
        return row
    finally:
        d.stop()


BAD_LABELS = ("boom", "hang", "nan")
LONG_PROMPT = "1+" * 600  # 1200 characters: longer than the tiny model's 1024 positions


def poison(workdir: Path, model: Path, *, iterations: int, entries: int) -> Row:
    """Poison entries on every stream (bad bytes, an unknown schema version, no data), a
    reward function that raises, hangs or returns NaN for some prompts, and a prompt longer
    than the model's context: those groups fail with the reason (never a reward of 0), the
    poison is dead-lettered, the workers live on."""
    prompts = write_prompts(workdir / "prompts.jsonl", n=40, bad_labels=BAD_LABELS)
    with prompts.open("a") as f:
        f.write(json.dumps({"prompt": LONG_PROMPT, "label": "0"}) + "\n")
    bad_rows = {40 + i for i in range(len(BAD_LABELS) + 1)}
    d = Deployment(workdir, model, prompts)
    row = Row("poison entries; reward raises/hangs/NaN", 0, "")
    keys = RunKeys(d.run_id)
    client = redis.Redis.from_url(d.redis.url)
    try:
        trainer = d.start_trainer(iterations)
        d.wait_iterations(1, trainer)
        poisons: list[Callable[[str], dict]] = [
            lambda s: {"data": b"\xff\xfe not protobuf", "v": "1"},
            lambda s: {**entry_fields(PromptGroup(group_id="from-the-future")), "v": "99"},
            lambda s: {"traceparent": "", "v": "1"},
        ]
        for i in range(entries):
            stream = (keys.prompts, keys.generated, keys.scored)[i % 3]
            client.xadd(stream, poisons[(i // 3) % len(poisons)](stream))
            row.injected += 1
            time.sleep(0.05)
        result = d.finish(trainer)
        check_run(row, result)
        _all_alive(d, row)
        reasons = {row_index: "reward" for row_index in bad_rows}
        reasons[40 + len(BAD_LABELS)] = "context length"
        failed = _check_bad_groups(row, d, result, reasons)
        dead = client.xlen(keys.dead)
        row.outcome = f"{len(failed)} groups failed with the reason; {dead} dead letters"
        return row
    finally:
        client.close()
        d.stop()


def _check_bad_groups(
    row: Row, d: Deployment, result: RunResult, reasons: dict[int, str]
) -> dict[str, str]:
    """The groups of the data rows in `reasons` (row -> a word their failure reason must
    hold) failed with it and were never trained; no other group failed. Returns the failed."""
    failed = failed_groups(result.log)
    index = {gid: int(gid.rsplit("-i", 1)[1]) for gid in failed}
    wrongly = [gid for gid, i in index.items() if i not in reasons]
    if wrongly:
        row.problems.append(f"good groups failed: {wrongly}")
    trained = _trained_rows(d) & set(reasons)
    if trained:
        row.problems.append(f"groups with a broken reward or prompt were trained: {trained}")
    if not failed or any(reasons.get(i, "") not in failed[gid] for gid, i in index.items()):
        row.problems.append(f"bad groups did not fail with their reason: {failed}")
    return failed


def _trained_rows(d: Deployment) -> set[int]:
    rows = set()
    for line in (d.run_dir / "metrics.jsonl").read_text().splitlines():
        for gid in json.loads(line).get("group_ids", []):
            rows.add(int(gid.rsplit("-i", 1)[1]))
    return rows


def oversized_request(workdir: Path, model: Path) -> Row:
    """A 50 MB request to the router: refused (413) and the router serves on."""
    d = Deployment(workdir, model, write_prompts(workdir / "prompts.jsonl"), rollout=0, reward=0)
    row = Row("50 MB request to the router", 1, "")
    try:
        body = b'{"text": "' + b"x" * (50 * 2**20) + b'"}'
        answer = httpx.post(
            f"{d.router.url}/generate",
            content=body,
            headers={"content-type": "application/json"},
            timeout=60,
        )
        alive = httpx.get(f"{d.router.url}/liveness", timeout=5).status_code
        if answer.status_code != 413 or alive != 200:
            row.problems.append(f"got {answer.status_code}, then liveness {alive}")
        row.outcome = f"HTTP {answer.status_code}; router still serving"
        return row
    finally:
        d.stop()


def bad_input(workdir: Path, model: Path) -> Row:
    """Bad prompt data: a clear error naming the file and line, before anything starts."""
    row = Row("bad input: malformed/empty data", 0, "")
    cases = {
        "malformed line": '{"prompt": "1+1=", "label": "2"}\n{"prompt": "2+2=", "label": \n',
        "empty data set": "",
        "label of the wrong type": '{"prompt": "1+1=", "label": {"answer": 2}}\n',
    }
    outcomes = []
    for name, text in cases.items():
        data = workdir / f"{name.replace(' ', '-')}.jsonl"
        data.write_text(text)
        run_dir = workdir / f"run-{data.stem}"
        proc = subprocess.run(
            [sys.executable, "-m", "millstream.cli", "train", "--hf-checkpoint", str(model),
             "--prompt-data", str(data), "--input-key", "prompt", "--label-key", "label",
             "--rm-type", "exact", "--num-rollout", "1", "--rollout-batch-size", "2",
             "--n-samples-per-prompt", "2", "--run-dir", str(run_dir)],
            capture_output=True, text=True, timeout=120, cwd=ROOT,
        )  # fmt: skip
        row.injected += 1
        started = (run_dir / "logs").exists() or (run_dir / "redis").exists()
        if proc.returncode == 0 or data.name not in proc.stderr or started:
            row.problems.append(f"{name}: exit {proc.returncode}, started {started}: {proc.stderr}")
        outcomes.append(f"{name}: exit {proc.returncode}")
    row.outcome = "; ".join(outcomes) + ", nothing started"
    return row


def mixed(workdir: Path, model: Path, *, iterations: int) -> list[Row]:
    """The short run of `make test`: worker kills, a Redis restart and poison in one run (one
    deployment instead of three); a row per fault, each with the whole run's promises."""
    prompts = write_prompts(workdir / "prompts.jsonl", n=40, bad_labels=BAD_LABELS)
    d = Deployment(workdir, model, prompts, rollout=2, reward=2)
    keys = RunKeys(d.run_id)
    client = redis.Redis.from_url(d.redis.url)
    kills = Row("SIGKILL a rollout/reward worker", 0, "")
    restart = Row("restart Redis (AOF on)", 0, "")
    bad = Row("poison entries; reward raises/hangs/NaN", 0, "")
    try:
        trainer = d.start_trainer(iterations)
        d.wait_iterations(2, trainer)
        for i, stream in enumerate((keys.prompts, keys.generated, keys.scored)):
            client.xadd(stream, {"data": b"\xff\xfe not protobuf", "v": "1"})
            client.xadd(stream, {**entry_fields(PromptGroup(group_id=f"future-{i}")), "v": "99"})
            bad.injected += 2
        for at, name in ((iterations // 5, "rollout-0"), (2 * iterations // 5, "reward-1")):
            d.wait_iterations(at, trainer)
            d.workers.kill(name)
            d.spawn_worker(name.split("-")[0], name)
            kills.injected += 1
        d.wait_iterations(3 * iterations // 5, trainer)
        d.redis.restart()
        restart.injected += 1
        result = d.finish(trainer)
        for row in (kills, restart, bad):
            check_run(row, result)
            _all_alive(d, row)
        failed = _check_bad_groups(
            bad, d, result, dict.fromkeys(range(40, 40 + len(BAD_LABELS)), "reward")
        )
        kills.outcome = "every kill recovered"
        restart.outcome = "services reconnected"
        bad.outcome = (
            f"{len(failed)} groups failed with the reason; {client.xlen(keys.dead)} dead letters"
        )
        return [kills, restart, bad]
    finally:
        client.close()
        d.stop()
