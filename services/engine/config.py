"""`millstream engine` flags, parsed once into a frozen EngineConfig.

Flag names follow SGLang's server args where one exists (--model-path, --max-running-requests,
--max-total-tokens, --context-length, --weight-version, --served-model-name), so a launch
script for a real SGLang server reads the same. Nothing here imports torch.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Sequence
from dataclasses import dataclass

from millstream.common.auth import ADMIN_TOKEN_ENV
from millstream.common.config.errors import ConfigError
from millstream.common.config.schema import add_group, flag, from_namespace
from millstream.common.http_limits import DEFAULT_MAX_REQUEST_BYTES

from .kv.sizing import DEFAULT_MEM_FRACTION

DTYPES = ("auto", "float32", "bfloat16")
FP8_GEMMS = ("auto", "scaled_mm", "dequant")  # quant/fp8.py GEMMS; this module imports no torch


@dataclass(frozen=True)
class EngineConfig:
    model_path: str | None = flag(None, "Hugging Face model directory (required; no download)")
    host: str = flag("127.0.0.1", "address to listen on")
    port: int = flag(30000, "port to listen on")
    served_model_name: str | None = flag(None, "model name in OpenAI responses (default: path)")
    max_running_requests: int = flag(64, "most requests decoding together in the running batch")
    max_total_tokens: int | None = flag(
        None,
        "SGLang's: tokens in the KV token pool shared by every request (default: on a GPU, "
        "what --mem-fraction-static leaves; on the CPU, a quarter of the free memory, "
        "allocated as it fills)",
    )
    context_length: int | None = flag(None, "longest prompt + output (default: the model's)")
    device: str = flag(
        "auto", "where the model runs: auto (cuda when torch sees a GPU, else cpu), cpu, cuda[:N]"
    )
    dtype: str = flag(
        "auto", "model dtype (auto: bfloat16 on a GPU, float32 on the CPU)", choices=DTYPES
    )
    mem_fraction_static: float | None = flag(
        None,
        "SGLang's: the share of the GPU's memory for weights plus the KV token pool "
        f"(default {DEFAULT_MEM_FRACTION} on a GPU; Miles' --sglang-mem-fraction-static maps to it)",
    )
    cuda_graph_max_bs: int | None = flag(
        None, "largest decode batch captured in a CUDA graph (default: --max-running-requests)"
    )
    disable_cuda_graph: bool = flag(False, "decode eagerly on the GPU (no CUDA graphs)")
    fp8_gemm: str = flag(
        "auto",
        "an FP8 checkpoint's Linears: scaled_mm (FP8 weights and activations, torch._scaled_mm), "
        "dequant (FP8 weights dequantized for each matmul), auto (scaled_mm on a GPU of compute "
        "capability >= 8.9, else dequant)",
        choices=FP8_GEMMS,
    )
    weight_version: str = flag("default", "weight version reported until the first update")
    weight_update_timeout: float = flag(
        300.0, "seconds an update-group init or a distributed weight update may take"
    )
    register_with: str | None = flag(None, "router URL: add this engine on start, remove on exit")
    coordinator: str | None = flag(
        None,
        "HOST:PORT of the trainer's Coordinator: ask to join (JoinEngine) once serving; the "
        "trainer adds this engine to the router with the current weights at its next sync "
        "(with --register-with too, the engine only removes itself from the router on exit)",
    )
    admin_token: str | None = flag(
        None,
        "bearer token required by this engine's admin endpoints (weights, pause, abort) and "
        f"sent to --register-with's router and --coordinator (or {ADMIN_TOKEN_ENV})",
    )
    max_request_bytes: int = flag(
        DEFAULT_MAX_REQUEST_BYTES, "largest request body accepted (larger: 413, not read)"
    )
    seed: int = flag(0, "seed of the engine's RNG (seeds unseeded requests)")
    num_threads: int = flag(
        0, "torch compute threads (0: every core; `millstream train` passes its CPU split)"
    )
    log_level: str = flag("info", "", choices=("debug", "info", "warning", "error"))
    run_dir: str | None = flag(None, "traces go to RUN_DIR/traces when no OTLP endpoint is set")

    def __post_init__(self) -> None:
        if not self.model_path:
            raise ConfigError("--model-path is required (a Hugging Face model directory)")
        if self.num_threads < 0:
            raise ConfigError(f"--num-threads must be >= 0 (got {self.num_threads})")
        for name in (
            "max_running_requests",
            "max_total_tokens",
            "context_length",
            "max_request_bytes",
        ):
            value = getattr(self, name)
            if value is not None and value <= 0:
                raise ConfigError(f"--{name.replace('_', '-')} must be > 0 (got {value})")
        if not 0 < self.port < 65536:
            raise ConfigError(f"--port must be in 1..65535 (got {self.port})")
        if self.admin_token is not None and not self.admin_token.strip():
            raise ConfigError("--admin-token must not be empty")
        if self.mem_fraction_static is not None and not 0 < self.mem_fraction_static < 1:
            raise ConfigError(
                f"--mem-fraction-static must be in (0, 1) (got {self.mem_fraction_static})"
            )
        if self.cuda_graph_max_bs is not None and self.cuda_graph_max_bs <= 0:
            raise ConfigError(f"--cuda-graph-max-bs must be > 0 (got {self.cuda_graph_max_bs})")
        if not (self.device in ("auto", "cpu", "cuda") or self.device.startswith("cuda:")):
            raise ConfigError(f"--device must be auto, cpu, cuda or cuda:N (got {self.device!r})")
        if self.weight_update_timeout <= 0:
            raise ConfigError(
                f"--weight-update-timeout must be > 0 (got {self.weight_update_timeout})"
            )

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    @property
    def model_name(self) -> str:
        return self.served_model_name or str(self.model_path)


def build_parser(prog: str = "millstream engine") -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=prog,
        description="inference server speaking SGLang's HTTP API (CPU or one GPU)",
        # A typo'd or partial flag is an error, never silently another flag.
        allow_abbrev=False,
    )
    add_group(parser, EngineConfig, "engine")
    return parser


def parse_engine_config(argv: Sequence[str], prog: str = "millstream engine") -> EngineConfig:
    parser = build_parser(prog)
    ns = parser.parse_args(list(argv))
    if not hasattr(ns, "admin_token") and os.environ.get(ADMIN_TOKEN_ENV):
        ns.admin_token = os.environ[ADMIN_TOKEN_ENV]
    try:
        return from_namespace(EngineConfig, ns)
    except ConfigError as err:
        parser.error(str(err))
        raise  # unreachable: parser.error exits
