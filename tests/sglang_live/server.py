"""A real SGLang server for the live tier: SGLang 0.5.23 from its own venv
(scripts/bootstrap_sglang.sh), on the CPU, started from the command line millstream's launcher
builds (launch/engines.py `sglang_command`) out of a Miles launch script's SGLANG_ARGS.

    server = LiveSglang(model_dir, log_dir).start()     # waits for /health
    server.url, server.model_info(), server.version()
    server.kill()                                       # SIGKILL of every process it started
    server.start()                                      # again, on the same port
    server.stop()
    LiveSglang(model_dir, log_dir, env={"OMP_NUM_THREADS": "2"})   # over server_env()'s

The flags a user passes to run SGLang on a CPU, as Miles' --sglang-* flags (CPU_SGLANG_ARGS),
and the environment its CPU engine needs (`server_env`): SGLANG_USE_CPU_ENGINE=1 (else SGLang
imports vllm for the rotary embedding), OMP_NUM_THREADS=1 (else each of its processes spins a
pool as wide as the machine: 10-60x slower on 2 cores), and the kernel stand-in of
kernel_standin/ first on its PYTHONPATH (its docstring names the two ops and where SGLang calls
them), and bytecode written: SGLang's venv is installed without it (pip --no-compile), and where
PYTHONDONTWRITEBYTECODE is set, as on this project's machines, each of the server's processes
compiled torch, transformers and sglang from source at every start (92-102 s to answer /health
on 2 cores; the first start that writes it 63 s, every later one ~30 s). `--max-total-tokens`
keeps SGLang's KV cache small: on a CPU it otherwise takes --mem-fraction-static of the host's
memory (15 GB of this machine's 24).

SGLang's server is three processes (the HTTP server, its scheduler, its detokenizer) in one
session of their own here: SIGTERM stops none of them quickly, so `stop` gives it GRACE_S,
then SIGKILLs the whole group.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import httpx

from millstream.common.config import parse_run_config
from millstream.launch import engines
from tests.support.redis_server import free_port

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
STANDIN = HERE / "kernel_standin"
ARITH_MODEL = REPO / "examples" / "arith" / "model"
HOST = "127.0.0.1"
START_TIMEOUT_S = 300.0  # ~25 s alone on 2 cores; minutes beside a loaded machine
GRACE_S = 5.0

# A Miles launch script's SGLANG_ARGS for a CPU run of SGLang 0.5.23.
CPU_SGLANG_ARGS = [
    "--sglang-attention-backend", "torch_native",
    "--sglang-sampling-backend", "pytorch",
    "--sglang-grammar-backend", "none",
    "--sglang-disable-cuda-graph",
    "--sglang-dtype", "float32",
    "--sglang-sleep-on-idle",
    "--sglang-skip-server-warmup",
    "--sglang-max-total-tokens", "65536",
]  # fmt: skip


def eval_prompts(n: int) -> list[list[int]]:
    """The token ids of the arith job's first `n` eval prompts."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(ARITH_MODEL)
    rows = (ARITH_MODEL.parent / "data" / "eval.jsonl").read_text().splitlines()[:n]
    return [tokenizer.encode(json.loads(row)["prompt"]) for row in rows]


def sglang_python() -> str | None:
    """The live server's Python ($MILLSTREAM_SGLANG_PYTHON: make test sets it from
    scripts/bootstrap_sglang.sh), or None."""
    return os.environ.get(engines.SGLANG_PYTHON_ENV) or None


def server_env(extra_pythonpath: str = "") -> dict[str, str]:
    """The environment of an SGLang server on the CPU (module docstring)."""
    path = os.pathsep.join(p for p in (str(STANDIN), extra_pythonpath) if p)
    return {
        "SGLANG_USE_CPU_ENGINE": "1",
        "OMP_NUM_THREADS": "1",
        "PYTHONPATH": path,
        "PYTHONUNBUFFERED": "1",
        "PYTHONDONTWRITEBYTECODE": "",  # empty: write it (module docstring)
    }


def launcher_argv(model: Path, port: int, *flags: str) -> list[str]:
    """The command line millstream's launcher starts an SGLang engine with, on the CPU, for
    the train flags `flags` plus CPU_SGLANG_ARGS."""
    cfg = parse_run_config(
        ["--hf-checkpoint", str(model), "--rollout-batch-size", "1", *CPU_SGLANG_ARGS, *flags]
    )
    return engines.sglang_command(cfg, str(model), HOST, port, "0", None, on_gpu=False).argv


class LiveSglang:
    def __init__(
        self, model: Path, log_dir: Path, *flags: str, env: Mapping[str, str] | None = None
    ):
        self.model, self.flags = model, flags
        self.env = dict(env or {})  # over server_env(): bench/engine_peer.py's thread count
        self.port = free_port()
        self.url = f"http://{HOST}:{self.port}"
        self.log_path = log_dir / f"sglang-{self.port}.log"
        self.proc: subprocess.Popen[bytes] | None = None
        self.started_s: list[float] = []  # how long each start took to answer /health

    @property
    def argv(self) -> list[str]:
        return launcher_argv(self.model, self.port, *self.flags)

    def start(self, timeout_s: float = START_TIMEOUT_S) -> LiveSglang:
        env = {**os.environ, **server_env(), **self.env}
        start = time.monotonic()
        with self.log_path.open("ab") as log:
            log.write(f"\n--- started: {' '.join(self.argv)}\n".encode())
            log.flush()
            self.proc = subprocess.Popen(
                self.argv,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                env=env,
                cwd=REPO,
                start_new_session=True,
            )
        deadline = start + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"SGLang exited with {self.proc.returncode}:\n{self.tail()}")
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(self.url + "/health", timeout=5).status_code == 200:
                    self.started_s.append(time.monotonic() - start)
                    return self
            time.sleep(0.5)
        self.kill()
        raise RuntimeError(f"SGLang did not answer /health in {timeout_s:.0f} s:\n{self.tail()}")

    def tail(self, chars: int = 4000) -> str:
        return self.log_path.read_text(errors="replace")[-chars:]

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def kill(self) -> None:
        """SIGKILL to every process of the server's session, as a crash would end it."""
        if self.proc is None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait()

    def stop(self) -> None:
        if self.proc is None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGTERM)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(GRACE_S)
        self.kill()

    # -- what it says of itself ---------------------------------------------------------------

    def model_info(self) -> dict[str, Any]:
        return httpx.get(self.url + "/model_info", timeout=10).json()

    def version(self) -> str:
        return str(self.model_info()["weight_version"])

    def load_base(self) -> None:
        """The model it started with, back (/update_weights_from_disk): the run's tests leave
        their weights on the shared server; one that compares with the base model calls this.
        As version "0", what a run's base weights are called: a sample's token versions are
        integers (a name such as "base" would read back as the rollout's fallback, 0)."""
        body = {"model_path": str(self.model), "weight_version": "0", "flush_cache": True}
        resp = httpx.post(self.url + "/update_weights_from_disk", json=body, timeout=120)
        assert resp.status_code == 200 and resp.json().get("success"), resp.text

    def greedy(self, input_ids: list[list[int]], max_new_tokens: int = 4) -> list[dict[str, Any]]:
        return self.greedy_at(self.url, input_ids, max_new_tokens)

    @staticmethod
    def greedy_at(
        url: str, input_ids: list[list[int]], max_new_tokens: int = 4
    ) -> list[dict[str, Any]]:
        """Greedy answers with their log-probs, one per prompt, from the engine at `url`
        (SGLang's /generate, which millstream's engine speaks too)."""
        body = {
            "input_ids": input_ids,
            "sampling_params": {"max_new_tokens": max_new_tokens, "temperature": 0},
            "return_logprob": True,
        }
        resp = httpx.post(url + "/generate", json=body, timeout=120)
        resp.raise_for_status()
        return resp.json()
