"""Prometheus metrics of every service: one naming scheme across their registries, values read
from the objects they describe, the scrape server of the processes without HTTP, stream
depths from a real Redis, and the --metrics-port flags."""

from __future__ import annotations

import asyncio
import math
import re
from collections import Counter
from types import SimpleNamespace
from typing import Any

import httpx
import pytest
import redis as redis_sync
import redis.asyncio as aioredis
from prometheus_client import CollectorRegistry
from prometheus_client.parser import text_string_to_metric_families

from millstream.common.config import parse_run_config
from millstream.common.errors import MillstreamError
from millstream.common.keys import GROUP_REWARD, GROUP_ROLLOUT, RunKeys
from millstream.common.prom import StreamDepths, render, start_metrics, sync_redis
from millstream.engine.prom import engine_registry, version_number
from millstream.reward.scorer import GroupScorer
from millstream.reward.worker import RewardWorker
from millstream.rollout.client import RouterClient
from millstream.rollout.worker import RolloutWorker
from millstream.router.metrics import RouterMetrics
from millstream.router.registry import Registry
from millstream.trainer.admission import Admission
from millstream.trainer.buffer import Buffer
from millstream.trainer.observe.prom import TERMINAL_STATES, TrainerMetrics

SHARED = ("worker", "stream")  # millstream_worker_*, millstream_stream_*: in several services
NAME = re.compile(r"^millstream_[a-z][a-z0-9_]*[a-z0-9]$")
UNITS = ("_seconds", "_bytes", "_tokens", "_entries")


def families(registry: CollectorRegistry) -> dict[str, Any]:
    return {f.name: f for f in text_string_to_metric_families(render(registry).decode())}


def value(registry: CollectorRegistry, sample: str, **labels: str) -> float:
    found = [
        s.value
        for f in families(registry).values()
        for s in f.samples
        if s.name == sample and all(s.labels.get(k) == v for k, v in labels.items())
    ]
    assert len(found) == 1, f"{sample}{labels}: {found}"
    return found[0]


def run_cfg(*flags: str):
    return parse_run_config(["--run-id", "r", "--rollout-batch-size", "2", *flags], mode="async")


class _NoExecutor:
    async def aclose(self) -> None:
        pass


def trainer_like(cfg: Any) -> SimpleNamespace:
    """The parts of a Trainer its metrics read: a real Admission and Buffer, a few numbers."""
    redis = aioredis.Redis()  # never connected: nothing here talks to Redis
    keys = RunKeys(cfg.run_id)
    admission = Admission(redis, keys.prompts, SimpleNamespace(), 2, 4, 1)
    admission.counts.admitted, admission.counts.trained, admission.counts.failed = 7, 3, 1
    admission.in_flight.update({"a": (0, 1), "b": (0, 2), "c": (0, 3)})
    buffer = Buffer(
        redis, keys, "trainer-0", claim_idle_ms=1000, max_deliveries=3, block_ms=100,
        on_terminal=lambda gid, state: None, expected=admission.in_flight.__contains__,
    )  # fmt: skip
    buffer.duplicates = 2
    buffer.worker.processed = 5
    return SimpleNamespace(
        p=SimpleNamespace(admission=admission, buffer=buffer),
        version=4,
        iteration=3,
        completions=24,
    )


def fake_engine_core(version: str = "12") -> SimpleNamespace:
    stats = SimpleNamespace(generated_tokens=40, finished=5, aborted=1, retracted=2, steps=30)
    info = {"num_running_reqs": 3, "num_waiting_reqs": 1, "paused": False}
    scheduler = SimpleNamespace(stats=stats, paused=False, info=lambda: info)
    return SimpleNamespace(scheduler=scheduler, weight_version=version)


def service_registries() -> dict[str, CollectorRegistry]:
    """A live registry per service, built from the real metric classes; every family gets at
    least one sample (streams: the depth families are checked with a real Redis below)."""
    cfg = run_cfg()
    router_registry = Registry()
    router_registry.add("http://engine:1")
    router = RouterMetrics(router_registry)
    router.requests.labels("http://engine:1", "200").inc()
    router.retries.labels("http://engine:1", "connect").inc()
    router.latency.observe(0.1)

    redis = aioredis.Redis()
    rollout = RolloutWorker(cfg, redis, RouterClient("http://router", max_concurrency=1), "r-0")
    rollout.metrics.observe({"rollout": 0.5, "rollout_queue": 0.1})
    reward = RewardWorker(redis, cfg, GroupScorer(cfg, _NoExecutor()), "w-0")
    reward.metrics.group_seconds.observe(0.2)

    trainer = TrainerMetrics()
    trainer.watch(trainer_like(cfg))
    trainer.sync_seconds.observe(1.5)
    return {
        "router": router.prom,
        "engine": engine_registry(fake_engine_core()),
        "rollout": rollout.metrics.registry,
        "reward": reward.metrics.registry,
        "trainer": trainer.registry,
    }


def test_every_service_names_its_metrics_the_same_way():
    seen: dict[str, tuple[str, frozenset[str]]] = {}
    for service, registry in service_registries().items():
        found = families(registry)
        assert found, service
        for name, family in found.items():
            where = f"{service}: {name}"
            assert NAME.match(name), f"{where}: not millstream_ snake_case"
            part = name.split("_")[1]
            assert part == service or part in SHARED, f"{where}: not millstream_{service}_*"
            assert family.documentation, f"{where}: no help text"
            assert family.samples, f"{where}: exported with no sample"
            if family.type == "counter":
                assert not name.endswith("_total"), where  # the parser strips one _total
                assert {s.name for s in family.samples} <= {
                    f"{name}_total",
                    f"{name}_created",
                }, where
            else:
                assert not name.endswith("_total"), f"{where}: a {family.type} named _total"
            if family.type == "histogram":
                assert name.endswith(UNITS), f"{where}: a histogram without its unit"
            for unit in ("_ms", "_milliseconds", "_minutes", "_kb", "_mb"):
                assert unit not in name, f"{where}: not in base units"
            labels = frozenset(
                k for s in family.samples for k in s.labels if k not in ("le", "quantile")
            )
            if name in seen:  # shared families look the same in every service
                assert seen[name] == (family.type, labels), f"{where} differs elsewhere"
            seen[name] = (family.type, labels)
    wanted = {
        "millstream_engine_generated_tokens": "counter",
        "millstream_engine_completions": "counter",
        "millstream_engine_weight_version": "gauge",
        "millstream_rollout_group_duration_seconds": "histogram",
        "millstream_reward_group_duration_seconds": "histogram",
        "millstream_reward_groups": "counter",
        "millstream_trainer_weight_version": "gauge",
        "millstream_trainer_groups_in_flight": "gauge",
        "millstream_trainer_weight_sync_duration_seconds": "histogram",
        "millstream_worker_jobs_processed": "counter",
        "millstream_worker_jobs_failed": "counter",
        "millstream_router_requests": "counter",
    }
    assert {name: seen[name][0] for name in wanted} == wanted


def test_the_trainer_exports_what_its_parts_hold():
    cfg = run_cfg()
    trainer = trainer_like(cfg)
    metrics = TrainerMetrics()
    metrics.watch(trainer)
    reg = metrics.registry
    assert value(reg, "millstream_trainer_weight_version") == 4
    assert value(reg, "millstream_trainer_iteration") == 3
    assert value(reg, "millstream_trainer_groups_in_flight") == 3
    assert value(reg, "millstream_trainer_groups_admitted_total") == 7
    assert value(reg, "millstream_trainer_groups_terminal_total", state="trained") == 3
    assert value(reg, "millstream_trainer_groups_terminal_total", state="failed") == 1
    assert value(reg, "millstream_trainer_samples_trained_total") == 24
    assert value(reg, "millstream_trainer_duplicate_groups_total") == 2
    assert value(reg, "millstream_worker_jobs_processed_total", worker="buffer") == 5
    assert value(reg, "millstream_worker_jobs_processed_total", worker="buffer:dead") == 0
    trainer.version = 5  # read at scrape time: no stale copy
    trainer.p.admission.in_flight.pop("a")
    assert value(reg, "millstream_trainer_weight_version") == 5
    assert value(reg, "millstream_trainer_groups_in_flight") == 2
    assert len(TERMINAL_STATES) == len(families(reg)["millstream_trainer_groups_terminal"].samples)


def test_weight_syncs_are_timed_and_everything_else_passes_through():
    calls: list[tuple[Any, ...]] = []

    class Sync:
        routed = ("http://e:1",)

        async def sync(self, weights: Any, version: int, **kwargs: Any) -> str:
            calls.append((weights, version, kwargs))
            await asyncio.sleep(0.05)
            if version < 0:
                raise RuntimeError("engine gone")
            return f"report v{version}"

    metrics = TrainerMetrics()
    timed = metrics.timed(Sync())
    assert asyncio.run(timed.sync("w", 3, join=())) == "report v3"
    assert calls == [("w", 3, {"join": ()})] and timed.routed == ("http://e:1",)
    reg = metrics.registry
    assert value(reg, "millstream_trainer_weight_sync_duration_seconds_count") == 1
    assert value(reg, "millstream_trainer_weight_sync_duration_seconds_sum") >= 0.05
    with pytest.raises(RuntimeError):
        asyncio.run(timed.sync("w", -1))
    assert value(reg, "millstream_trainer_weight_sync_duration_seconds_count") == 1


def test_the_engine_reads_its_scheduler_and_weight_version():
    core = fake_engine_core("12")
    reg = engine_registry(core)
    assert value(reg, "millstream_engine_generated_tokens_total") == 40
    assert value(reg, "millstream_engine_completions_total", outcome="finished") == 5
    assert value(reg, "millstream_engine_completions_total", outcome="aborted") == 1
    assert value(reg, "millstream_engine_running_requests") == 3
    assert value(reg, "millstream_engine_weight_version") == 12
    core.weight_version = "default"
    assert math.isnan(value(reg, "millstream_engine_weight_version"))
    assert version_number("3") == 3 and math.isnan(version_number("v3"))


def test_a_metrics_port_serves_the_registry_over_http_and_stops(redis_url):
    metrics = TrainerMetrics()
    metrics.watch(trainer_like(run_cfg()))
    keys = RunKeys("r")
    server = start_metrics(
        "trainer", metrics.registry, 0, redis_url=redis_url, streams=[keys.prompts, keys.dead]
    )
    try:
        assert server.port > 0
        body = httpx.get(f"http://127.0.0.1:{server.port}/metrics", timeout=5).text
        got = {f.name: f for f in text_string_to_metric_families(body)}
        assert got["millstream_trainer_weight_version"].samples[0].value == 4
        # Neither stream exists yet: lengths 0, no group.
        lengths = {s.labels["stream"]: s.value for s in got["millstream_stream_entries"].samples}
        assert lengths == {"prompts": 0, "dead": 0}
        assert got["millstream_stream_lag_entries"].samples == []
        with pytest.raises(MillstreamError, match=f"--metrics-port {server.port}: cannot listen"):
            start_metrics("trainer", CollectorRegistry(), server.port)
    finally:
        server.close()
    with pytest.raises(httpx.ConnectError):
        httpx.get(f"http://127.0.0.1:{server.port}/metrics", timeout=5)


def test_stream_depths_count_the_queue_and_the_work_in_progress(redis_url):
    keys = RunKeys("r")
    client = redis_sync.Redis.from_url(redis_url)
    try:
        for i in range(5):
            client.xadd(keys.prompts, {"data": str(i)})
        client.xgroup_create(keys.prompts, GROUP_ROLLOUT, id="0")
        client.xreadgroup(GROUP_ROLLOUT, "c", {keys.prompts: ">"}, count=2)  # 2 in the works
        client.xadd(keys.generated, {"data": "x"})
        client.xgroup_create(keys.generated, GROUP_REWARD, id="0")
    finally:
        client.close()
    depths = StreamDepths(lambda: sync_redis(redis_url, None), [keys.prompts, keys.generated])
    reg = CollectorRegistry()
    reg.register(depths)
    try:
        assert value(reg, "millstream_stream_entries", run="r", stream="prompts") == 5
        assert value(reg, "millstream_stream_lag_entries", stream="prompts", group="rollout") == 3
        assert value(reg, "millstream_stream_pending_entries", stream="prompts") == 2
        assert value(reg, "millstream_stream_lag_entries", stream="generated", group="reward") == 1
        assert value(reg, "millstream_stream_pending_entries", stream="generated") == 0
    finally:
        depths.close()
    gone = StreamDepths(lambda: sync_redis("redis://127.0.0.1:1/0", None), [keys.prompts])
    reg = CollectorRegistry()
    reg.register(gone)  # describes itself without asking Redis
    assert families(reg)["millstream_stream_entries"].samples == []  # a scrape still answers


def test_the_reward_worker_counts_verdicts_and_the_scorers_retries():
    from millstream.common.types import SampleGroup, ScoredGroup, Verdict

    cfg = run_cfg()
    worker = RewardWorker(aioredis.Redis(), cfg, GroupScorer(cfg, _NoExecutor()), "w-0")
    worker.scorer.stats.update({"reward_timeouts": 2, "reward_retries": 3})
    group = SampleGroup()
    group.timings["reward"] = 0.3
    worker.metrics.observe(ScoredGroup(group=group, verdict=Verdict.VERDICT_FAILED))
    worker.metrics.observe(ScoredGroup(group=group, verdict=Verdict.VERDICT_KEPT))
    worker.stream_worker.failed = 1
    reg = worker.metrics.registry
    assert value(reg, "millstream_reward_groups_total", verdict="failed") == 1
    assert value(reg, "millstream_reward_groups_total", verdict="filtered") == 0
    assert value(reg, "millstream_reward_group_duration_seconds_count") == 2
    assert value(reg, "millstream_reward_attempts_failed_total", reason="timeout") == 2
    assert value(reg, "millstream_reward_retries_total") == 3
    labels = {"worker": "w-0", "stream": "generated", "group": "reward"}
    assert value(reg, "millstream_worker_jobs_failed_total", **labels) == 1
    assert Counter(worker.scorer.stats)["reward_errors"] == 0


@pytest.mark.parametrize("command", ["train", "rollout", "reward"])
def test_metrics_port_is_a_flag_of_each_process_without_http(command, capsys):
    from millstream.reward.config import parse_worker_args as parse_reward_args
    from millstream.rollout.config import parse_worker_args as parse_rollout_args

    parse = {
        "train": lambda a: parse_run_config([*a, "--rollout-batch-size", "1"]).service,
        "rollout": parse_rollout_args,
        "reward": parse_reward_args,
    }[command]
    where = ["--redis-url", "redis://h:1/0", "--run-id", "r"]
    assert parse(where).metrics_port is None
    assert parse([*where, "--metrics-port", "0"]).metrics_port == 0
    assert parse([*where, "--metrics-port", "9400"]).metrics_port == 9400
    with pytest.raises(SystemExit) as exit_info:
        parse([*where, "--metrics-port", "70000"])
    assert exit_info.value.code == 2
    assert "--metrics-port must be in 0..65535" in capsys.readouterr().err
