"""Every admin body millstream's senders put on the wire, judged by SGLang's own classes.

The real senders run against the SGLang stand-in (sglang_server.py: each route validates its
body into the io_struct class SGLang's http_server.py names, refuses unknown fields, records
what came): `WeightSync` on the group route (a real `millstream router` lists the stand-in;
transport "nccl" forces the group, gloo on a CPU, and SGLang's own `WeightUpdater` joins it
and receives the buckets) and on the disk route, `Colocation` for release and resume,
`WeightSync.close` for destroy. Each recorded body must pass with no unknown field, every
distributed update must come inside a weight-update session (/begin_weight_update ..
/end_weight_update: the stand-in refuses one outside, as SGLang's scheduler does), and what
SGLang's receiving code got must be the trainer's tensors, byte for byte (a bucket of mixed
dtypes too: SGLang's receiving bucket refuses a tensor at an unaligned offset).

The tensor route's body for millstream's own engine (JSON of a handle) is checked to be what
SGLang refuses, so it must never reach an SGLang server (SGLang's format: test_tensor_route.py).
The router's version probe once gated SGLang out after every sync (no /get_weight_version
there): `test_router_keeps_routing_to_sglang_after_a_sync` keeps it fixed.
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch

from millstream.common import tensor_share
from millstream.common.weight_routes import TENSOR
from millstream.trainer.weights.colocate import Colocation
from millstream.trainer.weights.routes.base import SHM, Route, plan_buckets
from millstream.trainer.weights.routes.tensor import push_tensors
from millstream.trainer.weights.sync import WeightSync
from tests.contract.sglang_server import (
    ADMIN_PATHS,
    SESSION_PATHS,
    StandInProcess,
    admin_problems,
    digest,
    sglang_routes,
)
from tests.support.router_proc import ServiceProcess, start_router

pytestmark = pytest.mark.timeout(300)

# What SGLang 0.5.23's http_server.py validates each body into (None: no body, a query only).
SGLANG_CLASSES = {
    "/init_weights_update_group": "InitWeightsUpdateGroupReqInput",
    "/update_weights_from_distributed": "UpdateWeightsFromDistributedReqInput",
    "/update_weights_from_tensor": "UpdateWeightsFromTensorReqInput",
    "/update_weights_from_disk": "UpdateWeightFromDiskReqInput",
    "/pause_generation": "PauseGenerationReqInput",
    "/continue_generation": "ContinueGenerationReqInput",
    "/release_memory_occupation": "ReleaseMemoryOccupationReqInput",
    "/resume_memory_occupation": "ResumeMemoryOccupationReqInput",
    "/flush_cache": None,
    "/destroy_weights_update_group": "DestroyWeightsUpdateGroupReqInput",
    "/begin_weight_update": "BeginWeightUpdateReqInput",
    "/end_weight_update": "EndWeightUpdateReqInput",
}
BUCKET_BYTES = 64  # the tensors below make two buckets, mixed dtypes in the first


def tensors(version: int) -> list[tuple[str, torch.Tensor]]:
    """A float32 matrix and a bf16 vector (bucket 1, aligned), a float32 vector (bucket 2)."""
    base = torch.arange(12, dtype=torch.float32).reshape(4, 3) + version
    return [
        ("model.embed_tokens.weight", base),
        ("model.norm.weight", (torch.arange(4) * 0.5 + version).to(torch.bfloat16)),
        ("lm_head.bias", torch.linspace(-1, 1, 5) * version),
    ]


def digests(named: list[tuple[str, torch.Tensor]]) -> dict[str, list[Any]]:
    return {name: digest(t) for name, t in named}


@pytest.fixture(scope="module")
def standin(tmp_path_factory: pytest.TempPathFactory) -> Iterator[StandInProcess]:
    proc = StandInProcess(tmp_path_factory.mktemp("sglang-standin"))
    yield proc
    proc.stop()


@pytest.fixture(scope="module")
def router(standin: StandInProcess, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    # SGLang's package stays off the router's path, as in a real deployment's router.
    args = ["--worker-urls", standin.url, "--health-check-interval", "0.3"]
    proc: ServiceProcess = start_router(
        tmp_path_factory.mktemp("router"), *args, "--health-check-timeout", "2",
        env={"PYTHONPATH": ""},
    )  # fmt: skip
    yield proc
    proc.stop()


def run_sync(sync: WeightSync, *versions: int, after: Any = None, named: Any = None) -> Any:
    async def go() -> Any:
        try:
            for version in versions:
                await sync.sync(named or tensors(version), version)
            return await after(sync) if after is not None else None
        finally:
            await sync.close()

    return asyncio.run(go())


def assert_all_pass(recorded: list[dict[str, Any]]) -> None:
    bad = [(r["path"], r["body"], r["problems"], r["status"]) for r in recorded if r["problems"]]
    assert not bad, f"bodies SGLang would refuse or cut: {bad}"
    for r in recorded:  # and each one passes in-process through the same check
        assert admin_problems(r["path"], r["body"] or {}) == [], r


@pytest.fixture(scope="module")
def group_sync(standin: StandInProcess, router: ServiceProcess) -> list[dict[str, Any]]:
    """Two syncs on the group route (the second reuses the group), then close: recorded."""
    standin.reset()
    sync = WeightSync(router.url, transport="nccl", bucket_bytes=BUCKET_BYTES, timeout_s=60)
    run_sync(sync, 1, 2)
    return standin.recorded()


def test_sglang_routes_validate_into_the_classes_this_table_names():
    routes = sglang_routes()
    assert {p: routes.get(p, "<no route>") for p in SGLANG_CLASSES} == SGLANG_CLASSES
    assert set(ADMIN_PATHS) | set(SESSION_PATHS) == set(SGLANG_CLASSES)
    # The router's version probe (router/health.py) is not an SGLang route: /model_info is.
    assert "/get_weight_version" not in routes and "/model_info" in routes


# Bodies SGLang refuses, each with the message the stand-in answers: the checks can fail.
REFUSED = [
    ("/init_weights_update_group", {"master_address": "127.0.0.1", "rank_offset": 1,
     "world_size": 2}, 422, "master_port: Field required"),
    ("/pause_generation", {"mode": "stop"}, 422,
     "mode: Input should be 'abort', 'retract' or 'in_place'"),
    ("/update_weights_from_distributed", {"names": ["w"], "dtypes": ["float32"],
     "shapes": [[2]], "flush_cache": "often"}, 422, "flush_cache: Input should be a valid boolean"),
    ("/update_weights_from_disk", {"model_path": "/m", "version": "3"}, 400,
     "unknown field(s) ['version']"),
    ("/release_memory_occupation", {"tags": "kv_cache"}, 422, "tags: Input should be a valid list"),
]  # fmt: skip


@pytest.mark.parametrize(("path", "body", "status", "why"), REFUSED, ids=[r[0] for r in REFUSED])
def test_what_sglang_refuses_is_refused(standin, path, body, status, why):
    standin.reset()
    answer = httpx.post(standin.url + path, json=body, timeout=10)
    assert answer.status_code == status, answer.text
    (recorded,) = standin.recorded()
    assert any(why in p for p in recorded["problems"]), recorded
    assert any(why in p for p in admin_problems(path, body))


def test_every_pause_mode_millstream_accepts_is_one_sglang_takes():
    from typing import get_args

    import msgspec
    from sglang.srt.managers.io_struct import PauseGenerationReqInput

    from millstream.common.config.sglang import SglangConfig

    (field,) = [f for f in dataclasses.fields(SglangConfig) if f.name == "pause_mode"]
    (mode,) = [f for f in msgspec.structs.fields(PauseGenerationReqInput) if f.name == "mode"]
    sglangs = get_args(mode.type)
    assert set(field.metadata["choices"]) == set(sglangs)
    assert all(admin_problems("/pause_generation", {"mode": m}) == [] for m in sglangs)


def test_group_sync_sends_bodies_sglang_takes_whole(group_sync):
    assert_all_pass(group_sync)
    paths = [r["path"] for r in group_sync]
    # each sync's updates inside one weight-update session, as SGLang's scheduler wants them
    updates = ["/update_weights_from_distributed"] * 2
    assert paths == [
        "/pause_generation", "/begin_weight_update", "/init_weights_update_group", *updates,
        "/end_weight_update", "/continue_generation",
        "/pause_generation", "/begin_weight_update", *updates, "/end_weight_update",
        "/continue_generation", "/destroy_weights_update_group",
    ]  # fmt: skip
    assert all(r["status"] == 200 for r in group_sync), group_sync
    init = next(r["body"] for r in group_sync if r["path"] == "/init_weights_update_group")
    assert (init["rank_offset"], init["world_size"], init["backend"]) == (1, 2, "gloo")
    updates = [r for r in group_sync if r["path"] == "/update_weights_from_distributed"]
    # flush_cache and the version go with a sync's last bucket only
    assert [(u["body"]["flush_cache"], u["body"].get("weight_version")) for u in updates] == [
        (False, None), (True, "1"), (False, None), (True, "2"),
    ]  # fmt: skip
    assert {u["body"]["load_format"] for u in updates} == {"flattened_bucket"}
    assert all(u["in_session"] for u in updates)
    assert group_sync[-1]["body"] == {"group_name": init["group_name"]}


def test_sglangs_own_receive_gets_the_trainers_bytes(group_sync):
    updates = [r for r in group_sync if r["path"] == "/update_weights_from_distributed"]
    for version, pair in ((1, updates[:2]), (2, updates[2:])):
        received = {name: d for u in pair for name, d in u["received"].items()}
        assert received == digests(tensors(version))


def test_disk_sync_sends_a_body_sglang_takes_whole(standin, router, tmp_path: Path):
    standin.reset()
    sync = WeightSync(router.url, transport="disk", disk_dir=tmp_path, timeout_s=60)
    run_sync(sync, 3)
    recorded = standin.recorded()
    assert_all_pass(recorded)
    assert [r["path"] for r in recorded] == [
        "/pause_generation", "/update_weights_from_disk", "/continue_generation",
    ]  # fmt: skip
    disk = recorded[1]
    assert disk["body"] == {
        "model_path": str(tmp_path / "v3"),
        "weight_version": "3",
        "flush_cache": True,
    }
    assert disk["received"] == digests(tensors(3))


def test_colocation_release_and_resume_bodies_pass(standin, router):
    standin.reset()
    sync = WeightSync(router.url, timeout_s=60)
    turns = Colocation(sync, offload=None, release_engines=True)

    async def iteration(_sync: WeightSync) -> None:
        await turns.before_train()
        await turns.before_sync()
        await turns.after_sync()

    asyncio.run(_close_after(sync, iteration))
    recorded = standin.recorded()
    assert_all_pass(recorded)
    assert [(r["path"], r["body"]) for r in recorded] == [
        ("/release_memory_occupation", {"tags": ["kv_cache", "weights"]}),
        ("/resume_memory_occupation", {"tags": ["weights"]}),
        ("/resume_memory_occupation", {"tags": ["kv_cache"]}),
    ]


async def _close_after(sync: WeightSync, body: Any) -> None:
    try:
        await body(sync)
    finally:
        await sync.close()


def test_millstreams_own_tensor_body_is_not_for_sglang(tmp_path: Path):
    """The tensor route's body for millstream's engine (JSON of a shared-memory or CUDA IPC
    handle) is no UpdateWeightsFromTensorReqInput: SGLang takes base64 of
    MultiprocessingSerializer bytes per TP rank, which SGLang servers get instead
    (routes/sglang_format.py, test_tensor_route.py). This pins the difference."""
    sent: list[dict[str, Any]] = []

    class Capture:
        async def each(self, urls, path, body):
            sent.extend(body(i, u) for i, u in enumerate(urls))
            return {}

    shm = tensor_share.ShmBuffer(str(tmp_path))
    routes = {"http://sglang": Route(TENSOR, "shared memory", SHM)}
    try:
        buckets = plan_buckets(tensors(1), BUCKET_BYTES)
        asyncio.run(push_tensors(Capture(), routes, buckets, 1, shm))
    finally:
        shm.close()
    assert len(sent) == 2
    expected = ["serialized_named_tensors: Value error, Expected base64-encoded bytes"]
    assert [admin_problems("/update_weights_from_tensor", b) for b in sent] == [expected] * 2


def test_router_keeps_routing_to_sglang_after_a_sync(standin, router):
    """SGLang 0.5.23 serves no GET /get_weight_version (its version is in /model_info): the
    router's version probe falls back to it, so the next health rounds keep SGLang in."""
    sync = WeightSync(router.url, transport="nccl", timeout_s=60)

    async def watch(s: WeightSync) -> list[list[str] | None]:
        """What the router routes to, through ~15 health rounds (--health-check-interval
        0.3), stopping at the first look without the engine."""
        seen: list[list[str] | None] = []
        for _ in range(20):
            seen.append(await s.eligible_engines())
            if seen[-1] != [standin.url]:
                break
            await asyncio.sleep(0.25)
        return seen

    seen = run_sync(sync, 4, after=watch)
    assert all(eligible == [standin.url] for eligible in seen), seen


def test_a_mixed_dtype_bucket_reaches_sglangs_receive_intact(standin, router):
    """A float32 tensor after an odd number of bf16 elements: SGLang's receiving
    `FlattenedTensorBucket.empty` refuses a tensor at an offset its item size does not divide
    ("Unaligned received tensor"), so the trainer must lay the bucket out aligned."""
    standin.reset()
    named = [("norm.weight", torch.ones(3, dtype=torch.bfloat16)), ("head.bias", torch.zeros(2))]
    run_sync(WeightSync(router.url, transport="nccl", timeout_s=10), 5, named=named)
    recorded = standin.recorded()
    assert_all_pass(recorded)
    (update,) = [r for r in recorded if r["path"] == "/update_weights_from_distributed"]
    assert update["status"] == 200 and update["received"] == digests(named)


@pytest.mark.parametrize(
    ("mode", "flush"), [("abort", True), ("retract", True), ("in_place", False)]
)
def test_the_last_bucket_flushes_the_cache_unless_paused_in_place(
    standin, router, tmp_path: Path, mode, flush
):
    """SGLang fails an update whose flush_cache it cannot honour (weight_updater.py: "the cache
    was not flushed because requests are still running or queued"), and --pause-mode in_place
    leaves the paused requests in its running batch, on their KV cache: then the sync asks no
    flush, on every route (the disk route here, the group's and the tensor routes' the same
    SyncReport.flush_cache)."""
    standin.reset()
    run_sync(WeightSync(router.url, transport="disk", disk_dir=tmp_path, pause_mode=mode), 6)
    (update,) = [r for r in standin.recorded() if r["path"] == "/update_weights_from_disk"]
    assert update["body"]["flush_cache"] is flush
    assert_all_pass(standin.recorded())
