"""What one command starts on this machine, and with which of its resources, from the flags.

`given_router_url(cfg)`: engines running elsewhere (none started here) or not. `cpu_budget`:
how the cores are split between the trainer and the engines started here: torch gives every
process a pool of one thread per core, so an engine and a trainer that compute at the same
time each wait on threads the other holds; the split is made once, at start-up (the shares
themselves: common/threads.py). `gpu_plan`: which GPUs each trainer rank and each engine
gets, from Miles' placement flags, printed at start-up (`millstream plan` prints it for any
GPU count without starting anything); `engine_device_args`: an engine's device flags.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from dataclasses import dataclass, replace
from pathlib import Path

from millstream.common import threads
from millstream.common.config import RunConfig
from millstream.common.errors import MillstreamError

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


@dataclass(frozen=True)
class GpuPlan:
    """Which GPUs (indices of this machine's) each local trainer rank and each engine gets.

    `trainer[i]`: local rank i's GPU (torchrun's LOCAL_RANK i uses cuda:i); `engines[k]`:
    engine k's GPUs, empty for an engine on the CPU, given to it as CUDA_VISIBLE_DEVICES.
    `shares`: the engines are on the trainer's GPUs (--colocate, or too few GPUs to give
    them their own when nobody asked for any)."""

    gpus: int
    trainer: tuple[int, ...]
    engines: tuple[tuple[int, ...], ...]
    colocated: bool = False
    shares: bool = False

    def engine_env(self, k: int) -> dict[str, str]:
        """What engine k sees: its GPUs (an engine on the CPU is told --device cpu)."""
        gpus = self.engines[k]
        return {"CUDA_VISIBLE_DEVICES": ",".join(map(str, gpus))} if gpus else {}

    def engine_fraction(self, cfg: RunConfig) -> float | None:
        """The engines' --mem-fraction-static: --sglang-mem-fraction-static, else a share
        that leaves the trainer room where they share its GPU, else the engine's default."""
        if cfg.sglang.sglang_mem_fraction_static is not None:
            return cfg.sglang.sglang_mem_fraction_static
        if not self.shares:
            return None
        return COLOCATED_MEM_FRACTION if self.colocated else SHARED_MEM_FRACTION

    def describe(self) -> str:
        if not self.gpus:
            where = "; ".join(f"engine-{k}: CPU" for k in range(len(self.engines)))
            return f"GPU plan: no GPU here; trainer: CPU; {where or 'no engines started'}"
        ranks = ", ".join(f"rank {i}: GPU {g}" for i, g in enumerate(self.trainer))
        engines = "; ".join(
            f"engine-{k}: " + (f"GPU {','.join(map(str, g))}" if g else "CPU")
            for k, g in enumerate(self.engines)
        )
        how = " (colocated: they take turns)" if self.colocated else ""
        if self.shares and not self.colocated:
            how = " (sharing the trainer's GPU: --colocate makes them take turns)"
        return (
            f"GPU plan on {self.gpus} GPU(s): trainer {ranks}; "
            f"{engines or 'no engines started'}{how}"
        )


def gpu_plan(cfg: RunConfig, gpus: int) -> GpuPlan:
    """The placement Miles' flags ask for on a machine with `gpus` GPUs (MillstreamError when
    it has fewer than asked). As in Miles: the trainer's ranks take the first GPUs
    (--actor-num-gpus-per-node of this node); --rollout-num-gpus more follow for the engines,
    --rollout-num-gpus-per-engine each, or, with --colocate, the engines take the trainer's
    own GPUs (as many as --rollout-num-gpus, by default the trainer's). Nobody asking
    (--rollout-num-gpus not given), the --rollout-num-engines engines get GPUs of their own
    when the machine has them, else share the trainer's; --rollout-num-gpus 0 puts them on
    the CPU."""
    s = cfg.sglang
    per_engine = s.rollout_num_gpus_per_engine
    local_ranks = cfg.megatron.actor_num_gpus_per_node
    if given_router_url(cfg) is not None:  # the engines run elsewhere
        return GpuPlan(gpus, tuple(range(min(local_ranks, gpus))), ())
    asked = s.rollout_num_gpus
    if gpus == 0 or asked == 0:
        if asked:
            raise MillstreamError(
                f"--rollout-num-gpus {asked}: this machine shows no GPU (torch sees none); "
                "drop it to run the engines on the CPU"
            )
        trainer = tuple(range(min(local_ranks, gpus)))
        return GpuPlan(gpus, trainer, ((),) * s.rollout_num_engines)
    if s.colocate:
        rollout = asked if asked is not None else local_ranks
        first, need = 0, max(local_ranks, rollout)
    elif asked is not None:
        rollout = asked
        first, need = local_ranks, local_ranks + rollout
    else:
        rollout = s.rollout_num_engines * per_engine
        first, need = local_ranks, local_ranks + rollout
        if need > gpus and rollout <= gpus:  # nobody asked for GPUs of their own: share
            first, need = 0, max(local_ranks, rollout)
    if rollout % per_engine:
        raise MillstreamError(
            f"--rollout-num-gpus {rollout} is not a multiple of --rollout-num-gpus-per-engine "
            f"{per_engine}: every engine gets {per_engine} GPU(s)"
        )
    if need > gpus:
        raise MillstreamError(
            f"the placement needs {need} GPUs ({local_ranks} for the trainer's ranks"
            f"{'' if first == 0 else ' then ' + str(rollout) + ' for the engines'}"
            f"{', the engines on the same ones (--colocate)' if first == 0 else ''}); this "
            f"machine shows {gpus}: lower --actor-num-gpus-per-node or --rollout-num-gpus, "
            "or use --colocate"
        )
    n = rollout // per_engine
    if asked is not None and s.rollout_num_engines not in (1, n):
        raise MillstreamError(
            f"--rollout-num-engines {s.rollout_num_engines} and --rollout-num-gpus {rollout} / "
            f"--rollout-num-gpus-per-engine {per_engine} = {n} engines disagree: give one"
        )
    engines = tuple(
        tuple(range(first + k * per_engine, first + (k + 1) * per_engine)) for k in range(n)
    )
    return GpuPlan(gpus, tuple(range(local_ranks)), engines, s.colocate, shares=first == 0)


def engine_device_args(plan: GpuPlan, cfg: RunConfig, k: int) -> list[str]:
    """Engine k's device flags (millstream's engine): the CPU, or its GPUs with the memory
    fraction of the plan (CUDA_VISIBLE_DEVICES from `plan.engine_env` names them)."""
    if not plan.engines[k]:
        return ["--device", "cpu"]
    fraction = plan.engine_fraction(cfg)
    return ["--device", "cuda"] + (
        ["--mem-fraction-static", str(fraction)] if fraction is not None else []
    )


def visible_gpus() -> int:
    """The GPUs this process may use, found without importing torch (the launcher starts the
    engines before the trainer spends seconds importing it): CUDA_VISIBLE_DEVICES when set
    (as many ids as it lists, at most the driver's), else the NVIDIA driver's count."""
    driver = _driver_gpus()
    listed = os.environ.get("CUDA_VISIBLE_DEVICES")
    if listed is None:
        return driver
    ids = [x.strip() for x in listed.split(",") if x.strip()]
    return min(len(ids), driver)


def _driver_gpus() -> int:
    gpus = Path("/proc/driver/nvidia/gpus")
    if gpus.is_dir():
        return sum(1 for _ in gpus.iterdir())
    if shutil.which("nvidia-smi") is None:
        return 0
    try:
        out = subprocess.run(
            ["nvidia-smi", "-L"], capture_output=True, text=True, timeout=10, check=False
        ).stdout
    except (OSError, subprocess.TimeoutExpired):
        return 0
    return sum(1 for line in out.splitlines() if line.startswith("GPU "))


def main(argv: list[str]) -> int:
    """`millstream plan [--gpus N] [--async] <train flags>`: the flags checked as `millstream
    train` checks them (those alone: no file is read), then the GPU plan they make on a machine
    with N GPUs (default: this one's) and which engine server would start. Exit 2 on a refusal.
    """
    import argparse

    from millstream.common.config import checks, parse_run_config
    from millstream.common.config.errors import ConfigError

    from . import engines

    pre = argparse.ArgumentParser(prog="millstream plan", add_help=False, allow_abbrev=False)
    pre.add_argument("--gpus", type=int, default=None)
    pre.add_argument("--async", dest="async_mode", action="store_true")
    ns, rest = pre.parse_known_args(argv)
    mode = "async" if ns.async_mode else "sync"
    cfg = parse_run_config(rest, mode=mode, prog="millstream plan")
    gpus = visible_gpus() if ns.gpus is None else ns.gpus
    sglang = engines.sglang_installed()
    try:
        checks.check(cfg)
        plan = gpu_plan(cfg, gpus)
        if plan.engines:
            engines.check(cfg, sglang)
    except (ConfigError, MillstreamError) as err:
        print(f"millstream plan: error: {err}")
        return 2
    print(plan.describe())
    if plan.engines:
        server = "SGLang (sglang.launch_server)" if sglang else "millstream engine"
        fraction = plan.engine_fraction(cfg)
        shown = f", --mem-fraction-static {fraction}" if fraction is not None and gpus else ""
        print(f"engines: {len(plan.engines)} x {server}{shown}")
    return 0
