"""Network partitions as silence: each scenario deploys a run with every service in its own
namespace (deployment.py), makes a link silent for a while (netns.py) and returns a `Row` of
the chaos table.

Every scenario checks what `make chaos` checks (scenarios.check_run: the trainer exits 0,
admitted == the terminal states, nothing lost, nothing trained twice, a summary), that the
workers lived, that the fault was felt (a log line of the service that met it), and that the
longest stall (restarts.Stalls: the longest time without a new iteration) stays within the
bound its docstring states and explains: the partition's length plus what coming back takes,
or less where another engine or worker carries the run meanwhile. The bounds are for the
2-core machine: a trainer iteration of the tiny model takes ~0.1 s there, the services'
own timeouts are what the bounds are made of.
"""

from __future__ import annotations

import contextlib
import subprocess
import time
from pathlib import Path

import httpx
import redis

from millstream.common.keys import GROUP_ROLLOUT, RunKeys

from ..harness import Row, write_prompts
from ..restarts import Stalls, bounded
from ..scenarios import _all_alive, check_run
from .deployment import NetDeployment


def _deploy(workdir: Path, model: Path, **kwargs: int) -> NetDeployment:
    return NetDeployment(workdir, model, write_prompts(workdir / "prompts.jsonl"), **kwargs)


def _felt(row: Row, log: str, who: str, *marks: str) -> None:
    """The fault was met: `who`'s log holds every one of `marks` (else the partition, or the
    scenario, did not do what it says)."""
    missing = [m for m in marks if m not in log]
    if missing:
        row.problems.append(f"{who} never logged {missing}: did the partition hit it?")


def _wait(what: str, until, timeout_s: float, row: Row) -> float | None:
    """Poll `until()` every 0.1 s; the seconds it took, or a problem and None at the timeout."""
    start = time.monotonic()
    while time.monotonic() - start < timeout_s:
        with contextlib.suppress(httpx.HTTPError, redis.RedisError):
            if until():
                return time.monotonic() - start
        time.sleep(0.1)
    row.problems.append(f"{what}: not within {timeout_s:g} s")
    return None


def trainer_redis(workdir: Path, model: Path, *, iterations: int, seconds: float) -> Row:
    """Only the trainer <-> Redis pair silent for `seconds` (the workers keep Redis, the
    trainer keeps the router and engines). The trainer's Redis calls wait out their socket
    timeout, are sent again for up to --redis-outage-timeout (120 s) and go through once the
    link is back. Bound: partition + 20 s = a call that went out just before the heal waiting
    out its socket timeout (5 s), or a connect retransmitting its SYN (<= 4 s), plus the
    backoff between tries (2 s), plus the batch and step after (~1 s), with room for 2
    busy cores."""
    d = _deploy(workdir, model)
    row = Row(f"trainer <-> Redis silent {seconds:g} s", 0, "")
    try:
        trainer = d.start_trainer(iterations)
        stalls = Stalls(d)
        d.wait_iterations(iterations // 3, trainer)
        d.net.partition("trainer", seconds, peers=["redis"]).wait()
        row.injected += 1
        result = d.finish(trainer)
        check_run(row, result)
        bounded(row, stalls, seconds + 20.0)
        _felt(row, result.log, "the trainer", "connection lost", "reconnected")
        _all_alive(d, row)
        row.outcome = "the trainer waited in silence and reconnected"
        return row
    finally:
        d.stop()


def engine_in_sync(
    workdir: Path, model: Path, *, iterations: int, seconds: float, sync_timeout: float
) -> Row:
    """One of two engines silent to everything for `seconds`, from the end of an iteration
    on, when the trainer starts that iteration's weight sync (train-async syncs after every
    step, the update group's gloo collective included): each step of the sync that meets the
    silence waits out --weight-sync-timeout, the engine is removed from routing, the run goes
    on with the other, and once the link is back the trainer's look at removed engines finds
    it and the next sync brings it to the current version before the router routes to it.
    Bound: 2 x --weight-sync-timeout + 10 s whatever the partition's length (the other
    engine carries the run): a step that timed out (a collective: the group is rebuilt
    without the engine and the buckets sent again) and one more bounded step, then an
    iteration.
    Rejoining is checked apart: within the removed engine's next look after the heal (looks
    at 2, 4, 8, 16 s after its removal, then twice as far apart) plus a sync."""
    d = _deploy(workdir, model, engines=2)
    row = Row(f"engine silent {seconds:g} s from a weight sync", 0, "")
    try:
        trainer = d.start_trainer(iterations, "--weight-sync-timeout", f"{sync_timeout:g}")
        stalls = Stalls(d)
        victim = d.engines[1]
        d.wait_iterations(iterations // 8, trainer)
        _wait("both engines routed", lambda: all(d.engine_eligible(e.url) for e in d.engines),
              60, row)  # fmt: skip
        at = d.iterations() + 1
        while d.iterations() < at and trainer.poll() is None:
            time.sleep(0.005)  # the step is logged, its sync follows: cut now
        partition = d.net.partition(victim.role, seconds)
        row.injected += 1
        dropped = _wait("the router dropping the silent engine",
                        lambda: not d.engine_eligible(victim.url), seconds, row)  # fmt: skip
        partition.wait()
        back = _wait(
            "the engine routed again at the current version",
            lambda: d.engine_eligible(victim.url)
            and int(d.engine_version(victim.url)) >= d.iterations() - 1,
            sync_timeout + 60.0, row,
        )  # fmt: skip
        result = d.finish(trainer)
        check_run(row, result)
        bounded(row, stalls, 2 * sync_timeout + 10.0)
        _felt(row, result.log, "the trainer", f"removing engine {victim.url}")
        for engine in d.engines:
            if result.returncode == 0 and d.engine_version(engine.url) != str(iterations):
                row.problems.append(f"{engine.url} serves v{d.engine_version(engine.url)}")
        _all_alive(d, row)
        dropped_s = "-" if dropped is None else f"{dropped:.1f}"
        back_s = "-" if back is None else f"{back:.1f}"
        row.outcome = f"dropped after {dropped_s} s; synced back {back_s} s after the heal"
        return row
    finally:
        d.stop()


def only_engine(workdir: Path, model: Path, *, iterations: int, seconds: float) -> Row:
    """The only engine silent to everything for `seconds`: the sync that meets it waits out
    --weight-sync-timeout (10 s) and removes it, the trainer waits for an engine (up to
    --stall-timeout, 150 s here), rollouts wait or fail at the router, and once the link is
    back the trainer's keeper, which looks at removed engines every second while none is
    left, finds it and syncs it in. Bound: partition + 20 s = that look, the sync, and the
    rollouts that waited through the silence answered or retried (the router gives up on a
    request to the silent engine 40 s into the silence at the latest: http_pool.py's TCP
    keepalive; before it, one waited for the router's 600 s request timeout)."""
    d = _deploy(workdir, model)
    row = Row(f"the only engine silent {seconds:g} s", 0, "")
    try:
        trainer = d.start_trainer(
            iterations, "--weight-sync-timeout", "10", "--stall-timeout", "150"
        )
        stalls = Stalls(d)
        d.wait_iterations(iterations // 4, trainer)
        d.net.partition("engine-0", seconds).wait()
        row.injected += 1
        result = d.finish(trainer)
        check_run(row, result)
        bounded(row, stalls, seconds + 20.0)
        _felt(row, result.log, "the trainer", "removing engine", "answer again")
        _all_alive(d, row)
        row.outcome = (
            f"waited for the engine, synced it in; {result.counts.get('failed', '?')} failed"
        )
        return row
    finally:
        d.stop()


def rollout_worker(
    workdir: Path, model: Path, *, iterations: int, seconds: float, claim_idle_s: float
) -> Row:
    """One of two rollout workers silent to everything for `seconds` (longer than
    --claim-idle-ms) while it holds claimed prompts (pending under its name: mid-generation).
    The other worker takes them over after --claim-idle-ms (checked in Redis while the
    silence lasts) and hands them off; the silent one, once healed, finishes its copy late,
    and its hand-off publishes nothing (streams.py: the ack and the publish are one script,
    which publishes only if the ack removed the entry), so each group trains once. Bound:
    --claim-idle-ms + 10 s whatever the partition's length (the other worker carries the
    run): the held groups wait for the claim, the other worker's next look for idle entries
    and their rollout.
    """
    d = _deploy(workdir, model, rollout=2)
    flags = ("--claim-idle-ms", str(int(claim_idle_s * 1000)))
    row = Row(f"rollout worker silent {seconds:g} s mid-generation", 0, "")
    keys = RunKeys(d.run_id)

    def owners() -> dict[bytes, bytes]:
        with redis.Redis.from_url(d.redis.url, socket_timeout=2) as client:
            rows = client.xpending_range(keys.prompts, GROUP_ROLLOUT, "-", "+", 1000)
            return {r["message_id"]: r["consumer"] for r in rows}

    def held_by_victim() -> list[bytes]:
        return [i for i, who in d.net.call_in("probe", owners).items() if who == b"rollout-0"]

    try:
        trainer = d.start_trainer(iterations, *flags)
        stalls = Stalls(d)
        d.wait_iterations(iterations // 4, trainer)
        _wait("rollout-0 holding prompts", held_by_victim, 30, row)
        partition = d.net.partition("rollout-0", seconds)
        row.injected += 1
        time.sleep(1.0)  # what it holds now, it holds until the silence ends
        held = held_by_victim()
        if not held:
            row.problems.append("rollout-0 held no prompt in the silence: not mid-generation")
        taken = _wait(
            "rollout-0's prompts taken over",
            lambda: not set(held) & set(held_by_victim()),
            seconds, row,
        )  # fmt: skip
        partition.wait()
        result = d.finish(trainer)
        check_run(row, result)
        bounded(row, stalls, claim_idle_s + 10.0)
        _felt(row, d.workers.log("rollout-0"), "rollout-0", "connection lost", "reconnected")
        _all_alive(d, row)
        taken_s = "-" if taken is None else f"{taken + 1.0:.1f}"
        dup = result.counts.get("duplicates_ignored", "?")
        row.outcome = (
            f"{len(held)} prompts taken over after {taken_s} s; {dup} duplicates reached "
            "the trainer"
        )
        return row
    finally:
        d.stop()


def redis_isolated(workdir: Path, model: Path, *, iterations: int, seconds: float) -> Row:
    """Redis silent to every service for `seconds`: each one's calls wait out the socket
    timeout and are sent again until the link is back (--redis-outage-timeout, 120 s). Bound:
    partition + 20 s, as trainer <-> Redis (a call's socket timeout or a SYN's retransmission,
    the backoff, then the workers' and the trainer's first batch)."""
    d = _deploy(workdir, model)
    row = Row(f"Redis silent to everyone {seconds:g} s", 0, "")
    try:
        trainer = d.start_trainer(iterations)
        stalls = Stalls(d)
        d.wait_iterations(iterations // 3, trainer)
        d.net.partition("redis", seconds).wait()
        row.injected += 1
        result = d.finish(trainer)
        check_run(row, result)
        bounded(row, stalls, seconds + 20.0)
        _felt(row, result.log, "the trainer", "connection lost", "reconnected")
        for name in d.workers.procs:
            _felt(row, d.workers.log(name), name, "connection lost", "reconnected")
        _all_alive(d, row)
        row.outcome = "every service waited in silence and reconnected"
        return row
    finally:
        d.stop()


def trainer_replaced(
    workdir: Path, model: Path, *, iterations: int, seconds: float, ttl_s: float
) -> Row:
    """The trainer silent to everything, longer than its lease (--lease-ttl `ttl_s`), while a
    second trainer started meanwhile in another namespace (what an orchestrator does when it
    lost a node) takes the run and finishes it; both have --load/--save on one checkpoint
    folder and one run folder. The silence lasts at least `seconds` and until the second
    trainer has ended, so the first one comes back to a finished run: it must find the run
    taken and exit 5 ("lost the lease") without training on or leaving its own record (the
    run's summary.json must stay the second trainer's). The second waits until the lease
    expires, takes the run with a larger fencing number and resumes from the last checkpoint.
    Bound: `ttl_s` + 40 s, however long the silence: the lease's expiry, then the second
    trainer's start on 2 busy cores (overlapping the wait), its resume and first sync."""
    d = _deploy(workdir, model, trainers=2)
    ckpt = str(workdir / "ckpt")
    flags = ("--lease-ttl", f"{ttl_s:g}", "--save", ckpt, "--load", ckpt, "--save-interval", "20")
    row = Row("trainer silent past its lease; a second one finishes", 0, "")
    try:
        first = d.start_trainer(iterations, *flags)
        stalls = Stalls(d)
        d.wait_iterations(iterations // 4, first)
        partition = d.net.partition("trainer", 3600)  # healed below
        cut_at = time.monotonic()
        row.injected += 1
        second = d.start_trainer(iterations, *flags, role="trainer-1")
        d.finish(second)  # its whole run, the first trainer still silent
        time.sleep(max(0.0, seconds - (time.monotonic() - cut_at)))
        silent_s = time.monotonic() - cut_at
        partition.heal()
        try:
            first_code = first.wait(timeout=60)
        except subprocess.TimeoutExpired:
            first_code = None
        first_log = (workdir / "trainer.log").read_text(errors="replace")
        result = d.finish(second)  # the run's files as both trainers left them
        check_run(row, result)
        bounded(row, stalls, ttl_s + 40.0)
        if first_code != 5 or "lost the lease" not in first_log:
            row.problems.append(
                f"the first trainer exited {first_code} once the link was back, not 5 with "
                f"'lost the lease':\n{first_log[-2000:]}"
            )
        _felt(row, result.log, "the second trainer", "waiting for it", "the lease is ours")
        _all_alive(d, row)
        row.outcome = (
            f"silent {silent_s:.0f} s; the second took over and finished; the first exited "
            f"{first_code}"
        )
        return row
    finally:
        d.stop()
