"""What one command starts on this machine, and with which of its resources, from the flags.

`given_router_url(cfg)`: engines running elsewhere (none started here) or not. `cpu_budget`:
how the cores are split between the trainer and the engines started here: torch gives every
process a pool of one thread per core, so an engine and a trainer that compute at the same
time each wait on threads the other holds; the split is made once, at start-up (the shares
themselves: common/threads.py). `engine_device_args`: where the engines started here run
and how much of a GPU they take. GPU placement (which GPUs each trainer rank and engine
sees) belongs here too.
"""

from __future__ import annotations

from dataclasses import replace

from millstream.common import threads
from millstream.common.config import RunConfig

# An engine's --mem-fraction-static when it shares the trainer's GPU: colocated, the
# trainer's state is in host memory while the engine generates, but both hold their weights
# at start-up and during the sync; not colocated, the trainer keeps its state there always.
COLOCATED_MEM_FRACTION = 0.6
SHARED_MEM_FRACTION = 0.4


def given_router_url(cfg: RunConfig) -> str | None:
    """--router-url, or the Miles spelling --sglang-router-ip/--sglang-router-port: engines
    running elsewhere, so none is started here."""
    if cfg.service.router_url:
        return cfg.service.router_url.rstrip("/")
    ip, port = cfg.sglang.sglang_router_ip, cfg.sglang.sglang_router_port
    return f"http://{ip}:{port}" if ip and port else None


def cpu_budget(cfg: RunConfig) -> threads.CpuBudget:
    """How this machine's cores are split between the trainer and the engines started here
    (none when --router-url names running ones): disjoint shares in async mode; in sync mode,
    where they take turns, every core for the trainer and every core between the engines;
    --num-threads and --engine-num-threads override the split."""
    engines = 0 if given_router_url(cfg) else cfg.sglang.rollout_num_engines
    budget = threads.split_cores(
        threads.machine_cores(), engines, cfg.service.num_threads, overlap=cfg.max_staleness > 0
    )
    if cfg.service.engine_num_threads:
        budget = replace(budget, engine=cfg.service.engine_num_threads)
    return budget


def engine_device_args(cfg: RunConfig, gpus: int) -> list[str]:
    """The device flags of the engines `millstream train` starts when this machine shows
    `gpus` GPUs: none, the CPU; else the trainer's GPU (every engine and the trainer see the
    same ones until placement is built), with --sglang-mem-fraction-static as the engine's
    --mem-fraction-static, by default a share that leaves the trainer room."""
    if gpus == 0:
        return ["--device", "cpu"]
    fraction = cfg.sglang.sglang_mem_fraction_static
    if fraction is None:
        fraction = COLOCATED_MEM_FRACTION if cfg.sglang.colocate else SHARED_MEM_FRACTION
    return ["--device", "cuda", "--mem-fraction-static", str(fraction)]


def visible_gpus() -> int:
    """The GPUs torch sees in this process (0 without a CUDA build)."""
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0
