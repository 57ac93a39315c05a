"""--update-weight-transport: the route each engine gets from where both sides live, the group's
collective backend, and the shared tensors the tensor route hands over (the shared-memory twin
of CUDA IPC, exercised here; the CUDA IPC handle needs a GPU)."""

from __future__ import annotations

import json

import pytest
import torch

from millstream.common import tensor_share
from millstream.common.weight_routes import DISK, NCCL, TENSOR
from millstream.trainer.weights.routes.base import (
    CUDA_IPC,
    SGLANG,
    SGLANG_BYTES,
    SHM,
    TransportError,
)
from millstream.trainer.weights.routes.choose import choose
from millstream.trainer.weights.routes.nccl import group_backend

HOST = {"host": "boot:1:2", "device": "cpu", "gpu_uuid": None}
TAKES = {"weight_transports": ["distributed", "tensor", "disk"]}


def place(host: str = "boot:1:2", device: str = "cpu", gpu: str | None = None, takes=True):
    return {"host": host, "device": device, "gpu_uuid": gpu, **(TAKES if takes else {})}


GPU0 = place(device="cuda:0", gpu="GPU-aaa")
GPU1 = place(device="cuda:1", gpu="GPU-bbb")
OTHER_HOST_GPU = place(host="boot2:1:2", device="cuda:0", gpu="GPU-ccc")


@pytest.mark.parametrize(
    ("trainer", "engine", "name", "handle"),
    [
        (GPU0, place(device="cuda:0", gpu="GPU-aaa"), TENSOR, CUDA_IPC),  # one GPU, colocated
        (GPU0, GPU1, NCCL, None),  # two GPUs of one machine: NCCL
        (GPU0, OTHER_HOST_GPU, NCCL, None),  # another machine
        (GPU0, place(), TENSOR, SHM),  # engine on this machine's CPU (today's engine on a GPU box)
        (place(), place(), TENSOR, SHM),  # everything on CPU: `make test`
        (place(), place(host="boot2:1:2"), NCCL, None),  # another machine's CPU
        (place(), place(host="boot:9:9"), NCCL, None),  # a container with its own /dev/shm
        (GPU0, None, NCCL, None),  # says nothing (real SGLang): the group, as before
        (place(), place(takes=False), NCCL, None),  # does not take shared tensors
    ],
)
def test_auto_routes_by_where_the_two_live(trainer, engine, name, handle):
    route = choose("auto", trainer, engine)
    assert (route.name, route.handle) == (name, handle), route


def test_forced_transports_say_why_they_cannot_work():
    assert choose("nccl", GPU0, GPU1).name == NCCL
    assert choose("disk", GPU0, place(device="cuda:0", gpu="GPU-aaa")).name == DISK
    with pytest.raises(TransportError, match="cannot put two ranks on one GPU"):
        choose("nccl", GPU0, place(device="cuda:0", gpu="GPU-aaa"))
    with pytest.raises(TransportError, match="handles work only on one machine"):
        choose("tensor", GPU0, OTHER_HOST_GPU)
    with pytest.raises(TransportError, match="handles work only on one machine"):
        choose("tensor", place(), None)
    assert choose("tensor", place(), place()).handle == SHM


def test_the_group_uses_nccl_only_when_every_member_is_on_a_gpu():
    assert group_backend(GPU0, [GPU1, OTHER_HOST_GPU]) == "nccl"
    assert group_backend(GPU0, [GPU1, place()]) == "gloo"  # one CPU engine: through the CPU
    assert group_backend(place(), [GPU1]) == "gloo"
    assert group_backend(GPU0, [None]) == "nccl"  # real SGLang: where the trainer is


def test_this_process_places_itself():
    here = tensor_share.placement("cpu")
    assert here["device"] == "cpu" and here["gpu_uuid"] is None
    assert tensor_share.same_host(here, tensor_share.placement(torch.device("cpu")))
    assert not tensor_share.same_gpu(here, here)  # no GPU: never CUDA IPC


def _bucket() -> list[tuple[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    return [
        ("w", torch.randn(3, 4, generator=g)),
        ("ids", torch.arange(5)),
        ("b", torch.randn(7, generator=g).to(torch.bfloat16)),  # odd offset after it below
        ("h", torch.randn(2, generator=g).to(torch.float16)),
    ]


def _entry(handle, named) -> str:
    return tensor_share.bucket_request(
        handle,
        [n for n, _ in named],
        [t.dtype for _, t in named],
        [list(t.shape) for _, t in named],
    )


def test_a_shared_memory_bucket_reaches_the_receiver_whole_and_the_file_is_reused(tmp_path):
    buffer = tensor_share.ShmBuffer()
    mappings = tensor_share.Mappings()
    try:
        named = _bucket()
        handle = buffer.write([t for _, t in named])
        first_path = handle["path"]
        got = tensor_share.open_bucket(_entry(handle, named), mappings)
        assert [n for n, _ in got] == [n for n, _ in named]
        for (_, want), (_, have) in zip(named, got, strict=True):
            assert have.dtype == want.dtype and torch.equal(have, want)
        # The next bucket goes into the same file and mapping: the receiver copied the last.
        smaller = named[:2]
        handle = buffer.write([t * 0 + 1 if t.is_floating_point() else t for _, t in smaller])
        assert handle["path"] == first_path
        again = dict(tensor_share.open_bucket(_entry(handle, smaller), mappings))
        assert torch.equal(again["w"], torch.ones(3, 4))
        # A bigger bucket needs a bigger file: a new one, the old one removed.
        big = [("big", torch.zeros(10_000))]
        handle = buffer.write([big[0][1]])
        assert handle["path"] != first_path and not (tmp_path / first_path).exists()
        assert torch.equal(dict(tensor_share.open_bucket(_entry(handle, big), mappings))["big"],
                           big[0][1])  # fmt: skip
    finally:
        path = buffer.path
        buffer.close()
    assert path is not None and not path.exists()


def test_the_receiver_opens_only_millstream_buckets_in_dev_shm(tmp_path):
    outside = tmp_path / "millstream-weights-x"
    outside.write_bytes(b"\0" * 8)
    for path in (str(outside), "/dev/shm/../etc/passwd", "/etc/passwd"):
        handle = {"kind": "shm", "path": path, "numel": 8}
        with pytest.raises(ValueError, match="not a millstream weight bucket"):
            tensor_share.open_flat(handle)
    with pytest.raises(ValueError, match="unknown handle kind"):
        tensor_share.open_flat({"kind": "pickle", "numel": 0})


def test_a_bucket_request_must_cover_the_handle_exactly():
    named = _bucket()
    nbytes = sum(t.numel() * t.element_size() for _, t in named)
    with pytest.raises(ValueError, match="the handle"):
        _entry({"kind": "shm", "path": "/dev/shm/millstream-weights-y", "numel": nbytes + 1}, named)
    entry = json.loads(_entry({"kind": "shm", "path": "p", "numel": nbytes}, named))
    assert [m["end_idx"] for m in entry["metadata"]][-1] == nbytes  # SGLang's fields, in bytes
    assert entry["metadata"][1] == {"name": "ids", "shape": [5], "dtype": "int64",
                                    "start_idx": 48, "end_idx": 88, "numel": 5}  # fmt: skip


def test_cuda_ipc_needs_a_cuda_tensor():
    with pytest.raises(ValueError, match="CUDA tensor"):
        tensor_share.share(torch.zeros(4, dtype=torch.uint8))


# Two GPUs as torch names them (bare UUIDs), and a third this process does not see.
UUID_A = "8f0c1d2e-0000-4000-8000-00000000000a"
UUID_B = "5b6a7c8d-0000-4000-8000-00000000000b"
ELSEWHERE = "GPU-dead0000-0000-4000-8000-00000000beef"


def _cuda_handle(**fields) -> dict:
    """A cuda_ipc handle as `share` writes it (the CUDA fields are never opened here)."""
    raw = tensor_share._b64(b"\0" * 64)
    return {"kind": "cuda_ipc", "gpu_uuid": UUID_A, "device": 0, "handle": raw,
            "storage_size_bytes": 64, "storage_offset_bytes": 0,
            "ref_counter_handle": tensor_share._b64(b"/torch_millstream_test_counter"),
            "ref_counter_offset": 0, "event_handle": raw, "event_sync_required": False,
            "tensor_offset": 0, "numel": 64, **fields}  # fmt: skip


def test_the_receiver_finds_the_producers_gpu_by_its_uuid_not_its_index():
    """The producer's cuda:0 is the receiver's cuda:1 when the two number GPUs differently
    (CUDA_VISIBLE_DEVICES=1,0 in one of them): the UUID says which, the index does not."""
    here = [UUID_B, UUID_A]
    assert tensor_share.local_device(_cuda_handle(gpu_uuid=UUID_A, device=0), here) == 1
    assert tensor_share.local_device(_cuda_handle(gpu_uuid=UUID_B, device=1), here) == 0
    # As nvidia-smi and CUDA_VISIBLE_DEVICES write it, or a MIG instance's: the same GPU.
    assert tensor_share.local_device(_cuda_handle(gpu_uuid=f"GPU-{UUID_A.upper()}"), here) == 1
    assert tensor_share.local_device(_cuda_handle(gpu_uuid=f"MIG-{UUID_B}"), [UUID_B]) == 0
    # A handle without a UUID (an older producer): its index is all there is.
    legacy = _cuda_handle(device=1)
    del legacy["gpu_uuid"]
    assert tensor_share.local_device(legacy, here) == 1


def test_a_handle_for_a_gpu_this_process_does_not_see_is_refused_by_name():
    with pytest.raises(ValueError, match=f"sees no GPU with UUID {ELSEWHERE} .*cuda:1 {UUID_A}"):
        tensor_share.local_device(_cuda_handle(gpu_uuid=ELSEWHERE), [UUID_B, UUID_A])
    with pytest.raises(ValueError, match=r"\(its GPUs: none\)"):
        tensor_share.local_device(_cuda_handle(), [])


def test_the_engine_refuses_such_a_handle_so_the_sync_falls_back():
    """open_flat refuses a handle whose GPU this process does not see (here: any GPU on a CPU
    machine, an unknown one on a GPU machine) before opening anything; the engine turns that
    into the error the trainer reads as "not shared with it", and moves the engine to the
    update group (routes/tensor.py `opening_failed`)."""
    from millstream.engine.http.control import RequestError, _open_shared
    from millstream.trainer.weights.routes.tensor import opening_failed

    handle = _cuda_handle(gpu_uuid=ELSEWHERE)
    with pytest.raises(ValueError, match=f"no GPU with UUID {ELSEWHERE}"):
        tensor_share.open_flat(handle)
    entry = json.dumps({"flattened_tensor": handle, "metadata": []})
    with pytest.raises(RequestError) as err:
        _open_shared(entry, tensor_share.Mappings())
    assert opening_failed(err.value)


def test_an_sglang_server_on_the_trainers_gpu_gets_sglangs_format_or_files():
    """A placement the launcher gave (no weight_transports: a real SGLang server) on the
    trainer's GPU: NCCL cannot (two ranks on one GPU) and our handle is not SGLang's, so
    SGLang's own format over CUDA IPC where sglang imports here, else files, the start-up
    line saying why. On another GPU: the group."""
    trainer = {"host": "h", "device": "cuda:0", "gpu_uuid": "GPU-a"}
    sglang_here = {"host": "h", "device": "cuda:0", "gpu_uuid": "GPU-a"}
    sglang_there = {"host": "h", "device": "cuda:1", "gpu_uuid": "GPU-b"}
    missing = "sglang not importable here: ModuleNotFoundError: No module named 'sglang'"
    route = choose("auto", trainer, sglang_here, lambda: None)
    assert (route.name, route.handle) == (TENSOR, SGLANG)
    assert str(route) == (
        "tensor in SGLang's format over CUDA IPC (an SGLang server on the trainer's GPU)"
    )
    route = choose("auto", trainer, sglang_here, lambda: missing)
    assert route.name == DISK
    assert str(route) == f"disk (an SGLang server on the trainer's GPU; {missing})"
    assert choose("auto", trainer, sglang_there, lambda: None).name == NCCL
    # Forced: tensor takes SGLang's format where it can be made, and says why where not.
    assert choose("tensor", trainer, sglang_here, lambda: None).handle == SGLANG
    with pytest.raises(TransportError, match="SGLang's format, and sglang not importable"):
        choose("tensor", trainer, sglang_here, lambda: missing)
    with pytest.raises(TransportError, match="handles work only on one machine"):
        choose("tensor", trainer, sglang_there, lambda: None)
    # In this test run sglang is not importable (it must not be: the launcher would start
    # SGLang servers), so the default asks and gets disk.
    assert choose("auto", trainer, sglang_here).name == DISK


def test_an_sglang_server_on_this_machines_cpu_gets_the_group_or_its_format_when_forced():
    """An SGLang server the launcher started on this machine's CPU (the live tier's; a CPU
    trial run): the group by default (gloo, what SGLang's CPU engine has run longest); forced
    `tensor`, SGLang's format with the bytes in the request, where sglang imports here. Elsewhere, or
    saying nothing of where it lives, tensor cannot reach it."""
    sglang_cpu = {"host": "boot:1:2", "device": "cpu", "gpu_uuid": None}
    missing = "sglang not importable here: ModuleNotFoundError: No module named 'sglang'"
    for trainer in (place(), GPU0):
        route = choose("auto", trainer, sglang_cpu, lambda: None)
        assert (route.name, str(route)) == (NCCL, "nccl (on this machine's CPU)")
        route = choose("tensor", trainer, sglang_cpu, lambda: None)
        assert (route.name, route.handle) == (TENSOR, SGLANG_BYTES)
        assert str(route) == (
            "tensor in SGLang's format, its bytes in the request (--update-weight-transport "
            "tensor; an SGLang server on this machine's CPU)"
        )
    with pytest.raises(TransportError, match="SGLang's format, and sglang not importable"):
        choose("tensor", place(), sglang_cpu, lambda: missing)
    with pytest.raises(TransportError, match="handles work only on one machine"):
        choose("tensor", place(), {**sglang_cpu, "host": "boot2:1:2"}, lambda: None)


def test_engines_with_several_gpus_take_as_many_ranks_in_the_update_group():
    """SGLang joins each tensor-parallel rank at rank_offset + its rank: an engine with tp 2
    takes two ranks, and the next engine's offset follows them (Miles' layout)."""
    from millstream.trainer.weights.routes.nccl import engine_ranks, group_layout

    assert group_layout([1, 1, 1]) == ([1, 2, 3], 4)
    assert group_layout([2, 2]) == ([1, 3], 5)
    assert group_layout([4, 1, 2]) == ([1, 5, 6], 8)
    assert engine_ranks({"tp_size": 2, "dp_size": 2}) == 4
    assert engine_ranks({"tp_size": 2}) == 2
    assert engine_ranks({}) == 1 and engine_ranks({"tp_size": "x"}) == 1


def test_a_bucket_keeps_its_order_unless_a_tensor_would_sit_unaligned():
    """SGLang views each piece of a flattened bucket as its dtype: an int64 at byte 60 is
    refused there, so such a bucket goes largest item size first (stable)."""
    from millstream.trainer.weights.routes.base import plan_buckets

    fine = [
        ("a", torch.zeros(3, dtype=torch.bfloat16)),
        ("b", torch.zeros(2, dtype=torch.bfloat16)),
    ]
    assert plan_buckets(fine, 1 << 20)[0].names == ["a", "b"]
    odd = [("w", torch.zeros(15)), ("ids", torch.zeros(7, dtype=torch.int64)),
           ("n", torch.zeros(3, dtype=torch.bfloat16)), ("v", torch.zeros(1))]  # fmt: skip
    (bucket,) = plan_buckets(odd, 1 << 20)
    assert bucket.names == ["ids", "w", "v", "n"] and bucket.nbytes == 60 + 56 + 6 + 4


URL = "http://sglang:30000"


def fp8_checkpoint(path, **quantization) -> str:
    """A checkpoint dir as Qwen3-*-FP8 lays one out: one FP8 Linear, one plain norm."""
    from safetensors.torch import save_file

    config = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
              "weight_block_size": [128, 128], **quantization}  # fmt: skip
    path.mkdir()
    (path / "config.json").write_text(json.dumps({"quantization_config": config}))
    save_file({"model.q_proj.weight": torch.zeros(200, 130).to(torch.float8_e4m3fn),
               "model.q_proj.weight_scale_inv": torch.ones(2, 2),
               "model.norm.weight": torch.ones(130)}, str(path / "model.safetensors"))  # fmt: skip
    return str(path)


def test_the_fp8_layout_is_read_from_the_engines_checkpoint_and_refused_by_name(tmp_path):
    from millstream.trainer.weights.fp8_weights import Fp8Buckets, layout_of
    from millstream.trainer.weights.routes.base import plan_buckets

    layout = layout_of({"model_path": fp8_checkpoint(tmp_path / "fp8")})
    assert layout is not None and layout.quantized == {"model.q_proj.weight"}
    assert layout.block == (128, 128)
    (bucket,) = Fp8Buckets(plan_buckets([("model.norm.weight", torch.ones(3)),
                                         ("model.q_proj.weight", torch.randn(201, 131))],
                                        1 << 20), layout)  # fmt: skip
    assert [
        (n, t.dtype, list(t.shape)) for n, t in zip(bucket.names, bucket.tensors, strict=True)
    ] == [
        ("model.norm.weight", torch.float32, [3]),
        ("model.q_proj.weight_scale_inv", torch.float32, [2, 2]),
        ("model.q_proj.weight", torch.float8_e4m3fn, [201, 131]),
    ]  # the scales went first: after 26331 e4m3 bytes they would sit unaligned
    ue8m0 = fp8_checkpoint(tmp_path / "ue8m0", scale_fmt="ue8m0")
    with pytest.raises(ValueError, match="scale_fmt 'ue8m0': the trainer writes fp32 block"):
        layout_of({"model_path": ue8m0})
    with pytest.raises(ValueError, match="per-tensor and per-channel FP8 checkpoints"):
        layout_of({"model_path": fp8_checkpoint(tmp_path / "tensor", weight_block_size=None)})
    with pytest.raises(ValueError, match=r"config\.json is not readable here"):
        layout_of({"model_path": "/elsewhere/Qwen3-8B-FP8", "quantization": "fp8"})
    assert layout_of({"model_path": "/elsewhere/Qwen3-8B", "quantization": None}) is None


class FakeSGLang:
    """An SGLang server's answers as the sync sees them: its /get_server_info, and every admin
    call recorded."""

    def __init__(self, info):
        self._info, self.calls = info, []

    async def info(self, url):
        return self._info

    async def each(self, urls, path, body):
        self.calls += [(path, body(i, u)) for i, u in enumerate(urls)]
        return {}


def deliver(monkeypatch, tmp_path, info):
    """One sync's step 2 and 3 to an SGLang server the launcher put on the trainer's GPU, with
    SGLang's serializer stood in for (sglang is not importable here)."""
    import asyncio

    from millstream.trainer.weights import delivery
    from millstream.trainer.weights.delivery import Delivery
    from millstream.trainer.weights.engines import EngineBook
    from millstream.trainer.weights.routes import sglang_format
    from millstream.trainer.weights.routes.base import plan_buckets
    from millstream.trainer.weights.routes.choose import senders
    from millstream.trainer.weights.routes.nccl import GroupRoute
    from millstream.trainer.weights.sync import SyncReport

    serialized = []

    def serialize(bucket, copies, to_host=False):
        serialized.append([(n, t.dtype) for n, t in zip(bucket.names, bucket.tensors, strict=True)])
        return [f"payload {len(serialized)}.{i}" for i in range(copies)], torch.zeros(1)

    async def remove(_router, engines, failed, report):
        report.removed |= {u: str(w) for u, w in failed.items()}
        return [u for u in engines if u not in failed]

    monkeypatch.setattr(sglang_format, "unavailable", lambda: None)
    monkeypatch.setattr(sglang_format, "serialize_bucket", serialize)
    monkeypatch.setattr(delivery, "trainer_placement", lambda _buckets: GPU0)
    book = EngineBook("auto", {URL: {k: v for k, v in GPU0.items() if k != "weight_transports"}})
    group = GroupRoute(master_address="127.0.0.1", group_name="g", load_format=None,
                       timeout_s=5, remove=remove)  # fmt: skip
    sender = Delivery(book, senders(group, disk_dir=None, shm_dir=str(tmp_path)), remove)
    engine, report = FakeSGLang(info), SyncReport(5)
    named = [("model.norm.weight", torch.ones(130)), ("model.q_proj.weight", torch.randn(201, 131))]
    buckets = plan_buckets(named, 1000)  # two buckets
    synced = asyncio.run(sender.push(engine, None, [URL], buckets, report))  # type: ignore[arg-type]
    return synced, engine.calls, serialized, report


def test_an_sglang_server_on_the_trainers_gpu_gets_fp8_payloads_per_rank_in_a_session(
    monkeypatch, tmp_path, capsys
):
    info = {"tp_size": 2, "dp_size": 1, "model_path": fp8_checkpoint(tmp_path / "fp8")}
    synced, calls, serialized, _ = deliver(monkeypatch, tmp_path / "shm", info)
    assert synced == [URL]
    assert [p for p, _ in calls] == ["/begin_weight_update", "/update_weights_from_tensor",
                                     "/update_weights_from_tensor", "/end_weight_update"]  # fmt: skip
    assert calls[0][1] == {"selector": "all"} and calls[-1][1] == {}
    assert [b for _, b in calls[1:3]] == [
        {"serialized_named_tensors": ["payload 1.0", "payload 1.1"],  # one per TP rank
         "load_format": "flattened_bucket", "flush_cache": False},
        {"serialized_named_tensors": ["payload 2.0", "payload 2.1"],
         "load_format": "flattened_bucket", "flush_cache": True, "weight_version": "5"},
    ]  # fmt: skip
    assert serialized == [
        [("model.norm.weight", torch.float32)],
        [("model.q_proj.weight_scale_inv", torch.float32),
         ("model.q_proj.weight", torch.float8_e4m3fn)],
    ]  # fmt: skip
    line = capsys.readouterr().out
    assert (
        f"[trainer] weight transport to {URL}: tensor in SGLang's format over CUDA IPC (an "
        "SGLang server on the trainer's GPU); FP8 checkpoint: the trainer casts 1 weight to "
        "e4m3 in 128x128 blocks" in line
    )


def test_an_fp8_sglang_server_whose_weights_cannot_be_made_is_removed_with_why(
    monkeypatch, tmp_path
):
    info = {"tp_size": 1, "model_path": fp8_checkpoint(tmp_path / "ue8m0", scale_fmt="ue8m0")}
    synced, calls, _, report = deliver(monkeypatch, tmp_path / "shm", info)
    assert synced == [] and calls == []
    assert "scale_fmt 'ue8m0'" in report.removed[URL]
