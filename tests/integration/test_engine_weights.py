"""Weight updates into a running engine: over gloo from a real second process (the trainer
side, tests/support/weight_sender.py), from base64 safetensors blobs, and from disk. After
each, the engine must generate exactly what a fresh HF model with those weights gives, and
report the new weight_version everywhere."""

from __future__ import annotations

import base64
import json
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch

from tests.support.engine_proc import REPO_ROOT, EngineProcess, engine_fixtures
from tests.support.redis_server import free_port

pytestmark = [pytest.mark.integration, pytest.mark.timeout(180)]

PROMPTS = [list(b"Weights, please"), list(b"abc")]
NEW_TOKENS = 16
TIMEOUT_S = 5


# On the CPU and on a simulated GPU (tests/support/sim_cuda/): there each route lands host
# tensors (gloo's, the blobs', the shared bucket's, the files') in device parameters.
engine, client = engine_fixtures(
    "--weight-version", "v0", "--weight-update-timeout", str(TIMEOUT_S),
    devices=("cpu", "sim-cuda"),
)  # fmt: skip


def post(client: httpx.Client, engine: EngineProcess, path: str, body: Any) -> Any:
    resp = client.post(path, json=body)
    assert resp.status_code == 200, f"{path} -> {resp.status_code} {resp.text}\n{engine.log_tail()}"
    return resp.json()


def engine_greedy(client: httpx.Client, engine: EngineProcess) -> list[dict[str, Any]]:
    body = {
        "input_ids": PROMPTS,
        "sampling_params": {"max_new_tokens": NEW_TOKENS, "temperature": 0, "ignore_eos": True},
        "return_logprob": True,
    }
    return post(client, engine, "/generate", body)


def hf_model(model_dir: Path, state: dict[str, torch.Tensor] | None = None):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, local_files_only=True).eval()
    if state is not None:
        model.load_state_dict(state, strict=False)
    return model


def assert_matches_hf(outs: list[dict[str, Any]], model, version: str) -> None:
    """Greedy ids equal a plain HF greedy loop; logprobs equal a full forward within 1e-4."""
    for prompt, out in zip(PROMPTS, outs, strict=True):
        assert out["meta_info"]["weight_version"] == version
        ids: list[int] = []
        with torch.no_grad():
            for _ in range(NEW_TOKENS):
                logits_V = model(input_ids=torch.tensor([prompt + ids])).logits[0, -1]
                ids.append(int(logits_V.argmax()))
            logits_TV = model(input_ids=torch.tensor([prompt + ids])).logits[0]
        assert out["output_ids"] == ids
        logp = torch.log_softmax(logits_TV, -1)[len(prompt) - 1 : -1]
        expected = logp.gather(-1, torch.tensor(ids)[:, None])[:, 0]
        got = torch.tensor([lp for lp, _, _ in out["meta_info"]["output_token_logprobs"]])
        assert torch.allclose(got, expected, atol=1e-4)


def start_sender(src: Path, dst: Path, port: int, group: str, seed: int) -> subprocess.Popen:
    args = [
        sys.executable,
        "-m",
        "tests.support.weight_sender",
        "--model-path",
        str(src),
        "--out-dir",
        str(dst),
        "--master-port",
        str(port),
        "--group-name",
        group,
        "--seed",
        str(seed),
    ]
    return subprocess.Popen(
        args,
        cwd=REPO_ROOT,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


def wait_for_line(proc: subprocess.Popen, expected: str, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    assert proc.stdout is not None
    seen = []
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line:
            break
        seen.append(line)
        if line.startswith(expected):
            return
    raise AssertionError(f"sender never printed {expected!r}; output:\n{''.join(seen)}")


def test_engine_starts_at_its_configured_version_with_the_original_weights(
    client: httpx.Client, engine: EngineProcess, tiny_model_dir: Path
):
    assert client.get("/get_weight_version").json() == {"weight_version": "v0"}
    assert_matches_hf(engine_greedy(client, engine), hf_model(tiny_model_dir), "v0")


def test_update_from_distributed_over_gloo_with_a_real_sender_process(
    client: httpx.Client, engine: EngineProcess, tiny_model_dir: Path, tmp_path: Path
):
    port, group, new_dir = free_port(), "wsync", tmp_path / "perturbed"
    sender = start_sender(tiny_model_dir, new_dir, port, group, seed=1)
    try:
        wait_for_line(sender, "READY")
        init = {
            "master_address": "127.0.0.1",
            "master_port": port,
            "rank_offset": 1,
            "world_size": 2,
            "group_name": group,
            "backend": "gloo",
        }
        assert post(client, engine, "/init_weights_update_group", init)["success"] is True
        wait_for_line(sender, "JOINED")
        assert group in client.get("/get_server_info").json()["weight_update_groups"]
        manifest = json.loads((new_dir / "manifest.json").read_text())
        update = {**manifest, "group_name": group, "weight_version": "v1"}
        result = post(client, engine, "/update_weights_from_distributed", update)
        assert result["success"] is True, result
        wait_for_line(sender, "SENT")
        destroyed = post(client, engine, "/destroy_weights_update_group", {"group_name": group})
        assert destroyed["success"] is True
    finally:
        sender.communicate(timeout=30)
    assert client.get("/get_weight_version").json() == {"weight_version": "v1"}
    outs = engine_greedy(client, engine)
    assert_matches_hf(outs, hf_model(new_dir), "v1")
    assert client.get("/health_generate").status_code == 200


def test_init_group_with_no_trainer_times_out_instead_of_hanging(
    client: httpx.Client, engine: EngineProcess
):
    body = {
        "master_address": "127.0.0.1",
        "master_port": free_port(),
        "rank_offset": 1,
        "world_size": 2,
        "group_name": "nobody",
        "backend": "gloo",
    }
    with ThreadPoolExecutor(1) as pool:
        pending = pool.submit(client.post, "/init_weights_update_group", json=body)
        # The engine keeps serving while the join waits.
        assert engine_greedy(client, engine)[0]["meta_info"]["finish_reason"]["type"] == "length"
        resp = pending.result(TIMEOUT_S * 3)
    assert resp.status_code == 400
    assert resp.json()["success"] is False
    assert "nobody" not in client.get("/get_server_info").json()["weight_update_groups"]


def test_update_from_tensor_takes_base64_safetensors(
    client: httpx.Client, engine: EngineProcess, tiny_model_dir: Path
):
    from safetensors.torch import load_file, save

    original = load_file(tiny_model_dir / "model.safetensors")
    generator = torch.Generator().manual_seed(2)
    new = {k: v + 0.05 * torch.randn(v.shape, generator=generator) for k, v in original.items()}
    names = sorted(new)
    blobs = [
        base64.b64encode(save({n: new[n] for n in names[i : i + 5]})).decode()
        for i in range(0, len(names), 5)
    ]
    body = {"serialized_named_tensors": blobs, "weight_version": "v2", "flush_cache": True}
    assert post(client, engine, "/update_weights_from_tensor", body)["success"] is True
    assert_matches_hf(engine_greedy(client, engine), hf_model(tiny_model_dir, new), "v2")


def test_update_from_tensor_takes_a_shared_memory_bucket_and_refuses_a_stray_path(
    client: httpx.Client, engine: EngineProcess, tiny_model_dir: Path, tmp_path: Path
):
    """load_format flattened_bucket: one JSON handle to the trainer's bytes, no copy over HTTP
    (common/tensor_share.py); a handle the engine cannot open is a clear failure."""
    from safetensors.torch import load_file

    from millstream.common import tensor_share

    original = load_file(tiny_model_dir / "model.safetensors")
    generator = torch.Generator().manual_seed(4)
    new = {k: v + 0.05 * torch.randn(v.shape, generator=generator) for k, v in original.items()}
    names = sorted(new)
    buffer = tensor_share.ShmBuffer()
    try:
        handle = buffer.write([new[n] for n in names])
        entry = tensor_share.bucket_request(
            handle, names, [new[n].dtype for n in names], [list(new[n].shape) for n in names]
        )
        body = {"serialized_named_tensors": [entry], "load_format": "flattened_bucket",
                "weight_version": "v4"}  # fmt: skip
        assert post(client, engine, "/update_weights_from_tensor", body)["success"] is True
        assert_matches_hf(engine_greedy(client, engine), hf_model(tiny_model_dir, new), "v4")
    finally:
        buffer.close()
    stray = dict(json.loads(entry))
    stray["flattened_tensor"] = {**stray["flattened_tensor"], "path": str(tmp_path / "x")}
    body = {"serialized_named_tensors": [json.dumps(stray)], "load_format": "flattened_bucket"}
    resp = client.post("/update_weights_from_tensor", json=body)
    assert resp.status_code == 400 and "opening the shared bucket failed" in resp.json()["message"]
    two = {**body, "serialized_named_tensors": [entry, entry]}
    resp = client.post("/update_weights_from_tensor", json=two)
    assert resp.status_code in (400, 422) and "one entry per tensor parallel rank" in resp.text
    assert client.get("/get_model_info").json()["weight_version"] == "v4"


def test_update_from_disk_restores_the_original_weights(
    client: httpx.Client, engine: EngineProcess, tiny_model_dir: Path
):
    body = {"model_path": str(tiny_model_dir), "weight_version": "v3"}
    assert post(client, engine, "/update_weights_from_disk", body)["success"] is True
    assert client.get("/get_model_info").json()["weight_version"] == "v3"
    assert_matches_hf(engine_greedy(client, engine), hf_model(tiny_model_dir), "v3")
