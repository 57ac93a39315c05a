"""Chaos scenarios of one service going away and coming back (issue 33): the router restarted,
the last engine lost and replaced, Redis down for tens of seconds, the trainer stopped with
SIGTERM and started again, and an admin call through the router without the token.

Each returns a `Row` whose `longest_stall_s` is the longest time the run went without a new
iteration while the fault lasted and after (the `Stalls` clock), beside the promises every
scenario checks (scenarios.check_run: exit 0, nothing lost, nothing trained twice, a summary).
"""

from __future__ import annotations

import json
import signal
import threading
import time
from pathlib import Path

import httpx

from tests.support.router_proc import ServiceProcess

from .harness import HEALTH_INTERVAL_S, Deployment, Row, write_prompts
from .scenarios import _all_alive, check_run


class Stalls:
    """Samples the run's iteration count every 0.1 s in a thread: the longest time between
    two new iterations from the first one on."""

    def __init__(self, d: Deployment):
        self.d = d
        self.longest = 0.0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        seen, since = 0, None
        while not self._stop.wait(0.1):
            n = self.d.iterations()
            now = time.monotonic()
            if n > seen:
                seen, since = n, now
            elif since is not None:
                self.longest = max(self.longest, now - since)

    def stop(self) -> float:
        self._stop.set()
        self._thread.join()
        return self.longest


def bounded(row: Row, stalls: Stalls, bound_s: float) -> None:
    """The run's longest stall into `row`, a broken promise when it passed `bound_s` (the
    fault's own length plus what coming back may take on 2 cores)."""
    row.longest_stall_s = stalls.stop()
    row.stall_bound_s = bound_s
    if row.longest_stall_s > bound_s:
        row.problems.append(f"a stall of {row.longest_stall_s:.1f} s > {bound_s:g} s")


def restart_router(d: Deployment, down_s: float) -> None:
    """SIGKILL the router, `down_s` of absence, a new one on the same port (it knows no
    engine and no weight version: the trainer puts both back)."""
    port = d.router.port
    d.router.kill()
    d.router.stop()
    time.sleep(down_s)
    args = ["--health-check-interval", str(HEALTH_INTERVAL_S), "--log-level", "warning"]
    d.router = ServiceProcess("router", args, d.workdir, port=port).wait_ready("/liveness", 30)


def router_restarted(workdir: Path, model: Path, *, iterations: int, restarts: int) -> Row:
    """SIGKILL the router and start it again 2 s later: the trainer waits for it, puts the
    engines back into it at the current version, and the run goes on."""
    d = Deployment(workdir, model, write_prompts(workdir / "prompts.jsonl"))
    row = Row("SIGKILL the router, back 2 s later", 0, "")
    try:
        trainer = d.start_trainer(iterations)
        stalls = Stalls(d)
        for k in range(restarts):
            d.wait_iterations((k + 1) * iterations // (restarts + 1), trainer)
            restart_router(d, down_s=2.0)
            row.injected += 1
        check_run(row, d.finish(trainer))
        bounded(row, stalls, 20.0)
        _all_alive(d, row)
        row.outcome = "the trainer waited; engines re-added at the current version"
        return row
    finally:
        d.stop()


def last_engine_replaced(workdir: Path, model: Path, *, iterations: int, gap_s: float) -> Row:
    """SIGKILL the only engine and start a new one `gap_s` later: the trainer waits (it says
    so once), syncs the newcomer in and goes on."""
    d = Deployment(workdir, model, write_prompts(workdir / "prompts.jsonl"))
    row = Row(f"SIGKILL the last engine, a new one {gap_s:g} s later", 0, "")
    try:
        trainer = d.start_trainer(iterations)
        stalls = Stalls(d)
        d.wait_iterations(max(2, iterations // 4), trainer)
        said_before = len(d.trainer_log.read_text(errors="replace"))
        d.engines[0].kill()
        d.engines[0].stop()
        row.injected += 1
        time.sleep(gap_s)
        d.engines[0] = d.start_engine()
        d.engines[0].wait_ready("/health")
        result = d.finish(trainer)
        check_run(row, result)
        bounded(row, stalls, gap_s + 30.0)
        # Once per loss, with how long it may wait (a start before the engine joined says
        # it too, earlier in the log).
        said = result.log[said_before:].count("no engine left: waiting up to")
        if said != 1:
            row.problems.append(
                f"the trainer said {said} times after the kill that it waits for an engine, "
                "not once"
            )
        _all_alive(d, row)
        row.outcome = "the trainer waited, synced the new engine in, went on"
        return row
    finally:
        d.stop()


def redis_down(workdir: Path, model: Path, *, iterations: int, down_s: float) -> Row:
    """Redis away for `down_s` (SIGTERM, AOF on, back on the same port): every service holds
    on (--redis-outage-timeout, default 120 s) and reconnects."""
    d = Deployment(workdir, model, write_prompts(workdir / "prompts.jsonl"))
    row = Row(f"Redis down {down_s:g} s (AOF on)", 0, "")
    try:
        trainer = d.start_trainer(iterations)
        stalls = Stalls(d)
        d.wait_iterations(max(2, iterations // 3), trainer)
        d.redis.restart(down_s=down_s)
        row.injected += 1
        result = d.finish(trainer)
        check_run(row, result)
        bounded(row, stalls, down_s + 30.0)
        if "reconnected" not in result.log:
            row.problems.append("the trainer never said it reconnected")
        _all_alive(d, row)
        row.outcome = "every service reconnected"
        return row
    finally:
        d.stop()


def trainer_terminated(workdir: Path, model: Path, *, iterations: int) -> Row:
    """SIGTERM the trainer mid-run (--save given): it checkpoints, writes a summary that says
    why it ended, and a new trainer with --load finishes the run."""
    d = Deployment(workdir, model, write_prompts(workdir / "prompts.jsonl"))
    ckpt = str(workdir / "ckpt")
    flags = ("--save", ckpt, "--load", ckpt, "--save-interval", str(10 * iterations))
    row = Row("SIGTERM the trainer mid-run, then --load", 1, "")
    try:
        trainer = d.start_trainer(iterations, *flags)
        stalls = Stalls(d)
        d.wait_iterations(iterations // 3, trainer)
        trainer.send_signal(signal.SIGTERM)
        code = trainer.wait(timeout=60)
        summary = json.loads((d.run_dir / "summary.json").read_text())
        saved = (workdir / "ckpt" / "latest_checkpointed_iteration.txt").read_text().strip()
        if "SIGTERM" not in str(summary.get("ended")):
            row.problems.append(f"the summary after SIGTERM says {summary.get('ended')!r}")
        if code != 130:
            row.problems.append(f"the trainer exited {code} at SIGTERM, not 130")
        resumed = d.start_trainer(iterations, *flags)
        check_run(row, d.finish(resumed))
        bounded(row, stalls, 60.0)  # the stop and the new trainer's start included
        _all_alive(d, row)
        row.outcome = f"exit {code}, checkpoint at iteration {saved}, resumed and finished"
        return row
    finally:
        d.stop()


def unauthenticated_admin(workdir: Path, model: Path) -> Row:
    """An admin call through a router that has a token, without it: refused (401) before it
    reaches the engine (which has no token of its own); with it: served."""
    token = "chaos-admin-token"
    engine = ServiceProcess("engine", ["--model-path", str(model), "--num-threads", "1"], workdir)
    router = None
    row = Row("admin call through the router without its token", 0, "")
    try:
        engine.wait_ready("/health")
        router = ServiceProcess(
            "router", ["--worker-urls", engine.url, "--admin-token", token], workdir
        ).wait_ready("/liveness", 30)
        answers = []
        for path in ("/pause_generation", "/update_weights_from_disk", "/flush_cache"):
            body = {"model_path": str(model)} if "disk" in path else {}
            r = httpx.post(router.url + path, json=body, timeout=30)
            row.injected += 1
            answers.append(r.status_code)
        paused = httpx.get(engine.url + "/get_server_info", timeout=10).json()["scheduler"]
        if answers != [401, 401, 401] or paused["paused"]:
            row.problems.append(f"answers {answers}; engine paused: {paused['paused']}")
        auth = {"Authorization": f"Bearer {token}"}
        ok = httpx.post(router.url + "/flush_cache", json={}, headers=auth, timeout=30)
        if ok.status_code != 200:
            row.problems.append(f"with the token: {ok.status_code} {ok.text[:200]}")
        row.outcome = f"HTTP {answers[0]} without the token, {ok.status_code} with it"
        return row
    finally:
        if router is not None:
            router.stop()
        engine.stop()
