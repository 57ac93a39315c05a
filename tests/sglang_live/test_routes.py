"""Every weight route millstream has for an SGLang server, against a real one: each push (the
trainer's own WeightSync, tests/sglang_live/push.py) must make the server answer as a plain
forward of the pushed weights, within 1e-4 of every greedy token's log-prob, and report the
pushed version in /model_info.

  group   --update-weight-transport nccl (gloo: both on the CPU): /init_weights_update_group
          joined by SGLang's `init_custom_process_group` rendezvous, the buckets broadcast
          between /begin_weight_update and /end_weight_update (SGLang 0.5.23 refuses an update
          outside them), /destroy_weights_update_group at the end;
  tensor  --update-weight-transport tensor: SGLang's format (a FlattenedTensorBucket through
          its MultiprocessingSerializer, one payload per TP rank) inside the same session, the
          CPU bucket's bytes in the payload: torch's handles to shared memory do not suit a
          server that is no child of the trainer (routes/sglang_format.py `_by_value` says why; the
          default, file descriptors behind an authkey, kills SGLang's scheduler);
  disk    --update-weight-transport disk: safetensors files and /update_weights_from_disk.

Each push moves the weights far from the last (the arith model plus a seeded perturbation):
an engine that skipped it answers more than 100x the tolerance away, which the check refuses.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from tests.sglang_live.push import perturbed, save_model
from tests.sglang_live.server import REPO, LiveSglang, eval_prompts

pytestmark = pytest.mark.timeout(300)

ATOL = 1e-4
ROUTES = {"nccl": "group", "tensor": "tensor", "disk": "disk"}


class Pusher:
    """The sync of push.py in a process of its own, started ready (imports done, weights
    made) and waiting for `go()`: a sync aimed at a moment (test_pause.py) lands then."""

    def __init__(
        self, routed: str, sglang: LiveSglang, version: int, tmp: Path, *extra: str,
        transport: str = "nccl",
    ):  # fmt: skip
        self.sglang, self.model = sglang, tmp / f"pushed-{version}"
        self.trigger = tmp / f"go-{version}"
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        if transport == "tensor":  # sglang importable beside the trainer (the contract tier's)
            env["PYTHONPATH"] = os.pathsep.join([str(REPO / ".venv" / "sglang"), str(REPO)])
        argv = [sys.executable, "-m", "tests.sglang_live.push", "--router", routed,
                "--engine", sglang.url, "--transport", transport, "--version", str(version),
                "--seed", str(version), "--save", str(self.model), "--disk-dir",
                str(tmp / "disk"), "--wait-for", str(self.trigger), *extra]  # fmt: skip
        self.proc = subprocess.Popen(
            argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=REPO
        )

    def __enter__(self) -> Pusher:
        return self

    def __exit__(self, *exc: object) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.communicate()

    def go(self, timeout_s: float = 240) -> dict:
        """Sync now; the report."""
        self.trigger.touch()
        out, err = self.proc.communicate(timeout=timeout_s)
        assert self.proc.returncode == 0, out[-3000:] + err[-3000:] + self.sglang.tail()
        return json.loads(out.strip().splitlines()[-1])


def push(
    routed: str, sglang: LiveSglang, transport: str, version: int, tmp: Path, *extra: str
) -> tuple[dict, Path]:
    """One sync by `transport` at once: its report, and the model it pushed."""
    with Pusher(routed, sglang, version, tmp, *extra, transport=transport) as pusher:
        return pusher.go(), pusher.model


def reference_logprobs(model: Path, prompts: list[list[int]], answers: list[list[int]]):
    """Each answer token's log-prob under a plain forward of `model` (float32)."""
    lm = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32).eval()
    out = []
    with torch.inference_mode():
        for prompt, answer in zip(prompts, answers, strict=True):
            ids = torch.tensor([prompt + answer])
            logp = torch.log_softmax(lm(ids).logits[0, :-1].float(), dim=-1)
            rows = torch.arange(len(prompt) - 1, len(prompt) + len(answer) - 1)
            out.append(logp[rows, torch.tensor(answer)].tolist())
    return out


def gap_to(sglang: LiveSglang, model: Path) -> float:
    """The largest gap between SGLang's greedy log-probs and a plain forward of `model`."""
    prompts = eval_prompts(16)
    served = sglang.greedy(prompts)
    answers = [r["output_ids"] for r in served]
    want = reference_logprobs(model, prompts, answers)
    got = [[lp for lp, _, _ in r["meta_info"]["output_token_logprobs"]] for r in served]
    return max(
        abs(a - b) for g, w in zip(got, want, strict=True) for a, b in zip(g, w, strict=True)
    )


@pytest.mark.parametrize("transport", list(ROUTES), ids=list(ROUTES.values()))
def test_the_route_makes_sglang_serve_the_pushed_weights(
    routed: str, sglang: LiveSglang, transport: str, tmp_path: Path
):
    version = 100 + list(ROUTES).index(transport)
    report, model = push(routed, sglang, transport, version, tmp_path)
    assert report["engines"] == [sglang.url] and report["removed"] == {}, report
    assert sglang.version() == str(version)
    gap = gap_to(sglang, model)
    print(f"\n{ROUTES[transport]}: {report['bytes']} bytes in {report['buckets']} bucket(s), "
          f"{report['seconds']}; served within {gap:.1e} of the pushed weights")  # fmt: skip
    assert gap < ATOL
    # The check can tell: weights of another seed are far off.
    save_model(perturbed(version + 1000), tmp_path / "other")
    assert gap_to(sglang, tmp_path / "other") > 100 * ATOL
    log = sglang.tail(200_000)
    if transport != "disk":  # a session around the update, as SGLang 0.5.23 wants
        assert '"POST /begin_weight_update HTTP/1.1" 200' in log
        assert '"POST /end_weight_update HTTP/1.1" 200' in log
    if transport == "nccl":
        assert '"POST /init_weights_update_group HTTP/1.1" 200' in log
        assert '"POST /destroy_weights_update_group HTTP/1.1" 200' in log
