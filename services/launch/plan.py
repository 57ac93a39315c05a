"""What one command starts on this machine, and with which of its resources, from the flags.

`given_router_url(cfg)`: engines running elsewhere (none started here) or not. `cpu_budget`:
how the cores are split between the trainer and the engines started here: torch gives every
process a pool of one thread per core, so an engine and a trainer that compute at the same
time each wait on threads the other holds; the split is made once, at start-up (the shares
themselves: common/threads.py). `gpu_plan`: which GPUs each trainer rank and each engine
gets, from Miles' placement flags, printed at start-up (`millstream plan` prints it for any
GPU count without starting anything); `engine_device_args`: an engine's device flags.

The plan's GPU numbers are indices into the GPUs this process sees (torch's cuda:i, torchrun's
LOCAL_RANK i); a child is told its GPUs in CUDA_VISIBLE_DEVICES, which the child reads as the
driver's ids, not as indices into ours. So the plan keeps the ids its indices stand for
(`visible_devices`: this process's CUDA_VISIBLE_DEVICES entries, integers or `GPU-...`/`MIG-...`
UUIDs as written, else the driver's 0..n-1) and hands a child those: under
CUDA_VISIBLE_DEVICES=2,3 the engine on index 1 is given `3`, not `1`. A child inherits
CUDA_DEVICE_ORDER, so it reads the ids in the order they were written for. `millstream gpus`:
how many GPUs torch sees (what examples/arith/run.sh asks before adding --colocate --bf16).
"""

from __future__ import annotations

import os
import shutil
import subprocess
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

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
    """Which GPUs (indices of the GPUs this process sees) each local trainer rank and each
    engine gets.

    `trainer[i]`: local rank i's GPU (torchrun's LOCAL_RANK i uses cuda:i); `engines[k]`:
    engine k's GPUs, empty for an engine on the CPU, given to it as CUDA_VISIBLE_DEVICES.
    `shares`: the engines are on the trainer's GPUs (--colocate, or too few GPUs to give
    them their own when nobody asked for any). `devices[i]`: the id of index i as a child
    must be told it (`visible_devices`); empty: the indices are the ids (a plan for N GPUs of
    some machine, `millstream plan --gpus N`)."""

    gpus: int
    trainer: tuple[int, ...]
    engines: tuple[tuple[int, ...], ...]
    colocated: bool = False
    shares: bool = False
    devices: tuple[str, ...] = ()

    def ids(self, indices: Sequence[int]) -> list[str]:
        """The ids of these GPUs for a child's CUDA_VISIBLE_DEVICES (and for the plan's
        print-out: the numbers nvidia-smi shows where nothing hid some)."""
        return [self.devices[i] if self.devices else str(i) for i in indices]

    def engine_env(self, k: int) -> dict[str, str]:
        """What engine k sees: its GPUs (an engine on the CPU is told --device cpu)."""
        gpus = self.engines[k]
        return {"CUDA_VISIBLE_DEVICES": ",".join(self.ids(gpus))} if gpus else {}

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
        ranks = ", ".join(f"rank {i}: GPU {g}" for i, g in enumerate(self.ids(self.trainer)))
        engines = "; ".join(
            f"engine-{k}: " + (f"GPU {','.join(self.ids(g))}" if g else "CPU")
            for k, g in enumerate(self.engines)
        )
        how = " (colocated: they take turns)" if self.colocated else ""
        if self.shares and not self.colocated:
            how = " (sharing the trainer's GPU: --colocate makes them take turns)"
        hidden = ""  # ids that are not the indices came from CUDA_VISIBLE_DEVICES: say so
        if self.devices and self.devices != tuple(map(str, range(self.gpus))):
            hidden = f" (CUDA_VISIBLE_DEVICES={','.join(self.devices)})"
        return (
            f"GPU plan on {self.gpus} GPU(s){hidden}: trainer {ranks}; "
            f"{engines or 'no engines started'}{how}"
        )


def gpu_plan(cfg: RunConfig, gpus: int | Sequence[str]) -> GpuPlan:
    """The placement Miles' flags ask for on a machine with `gpus` GPUs: a count (a plan for
    any machine), or this process's GPU ids (`visible_devices()`: the plan hands its children
    those). MillstreamError when the machine has fewer than asked."""
    if isinstance(gpus, int):
        return _place(cfg, gpus)
    return replace(_place(cfg, len(gpus)), devices=tuple(gpus))


def _place(cfg: RunConfig, gpus: int) -> GpuPlan:
    """The plan on `gpus` GPUs indexed 0..gpus-1. As in Miles: the trainer's ranks take the
    first GPUs (--actor-num-gpus-per-node of this node); --rollout-num-gpus more follow for
    the engines, --rollout-num-gpus-per-engine each, or, with --colocate, the engines take the
    trainer's own GPUs (as many as --rollout-num-gpus, by default the trainer's). Nobody
    asking (--rollout-num-gpus not given), the --rollout-num-engines engines get GPUs of their
    own when the machine has them, else share the trainer's; --rollout-num-gpus 0 puts them
    on the CPU."""
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


def visible_devices() -> tuple[str, ...]:
    """The GPUs this process may use, by the ids a child must be given to see the same ones
    (cuda:i here is the i-th), found without importing torch (the launcher starts the engines
    before the trainer spends seconds importing it): CUDA_VISIBLE_DEVICES' entries when it is
    set (as written: integers, or GPU-/MIG- UUIDs; at most as many as the driver has), else
    the NVIDIA driver's GPUs 0..n-1."""
    driver = _driver_gpus()
    listed = os.environ.get("CUDA_VISIBLE_DEVICES")
    if listed is None:
        return tuple(map(str, range(driver)))
    ids = [x.strip() for x in listed.split(",") if x.strip()]
    return tuple(ids[:driver])


def visible_gpus() -> int:
    """How many GPUs this process may use (`visible_devices`), without importing torch."""
    return len(visible_devices())


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


def sglang_engine_command(
    cfg: RunConfig, plan: GpuPlan, k: int, model: str, host: str, port: int, weight_version: str
) -> Any:
    """Engine k of the plan as an SGLang server (launch/engines.py `sglang_command`): its
    memory fraction and device from the plan."""
    from . import engines

    return engines.sglang_command(
        cfg, model, host, port, weight_version, plan.engine_fraction(cfg),
        on_gpu=bool(plan.engines[k]),
    )  # fmt: skip


def main(argv: list[str]) -> int:
    """`millstream plan [--gpus N] [--async] <train flags>`: the flags checked as `millstream
    train` checks them (those alone: no file is read), then the GPU plan they make on a machine
    with N GPUs (default: this one's, by the ids CUDA_VISIBLE_DEVICES gives them) and which
    engine server would start. Exit 2 on a refusal.
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
    gpus = visible_devices() if ns.gpus is None else ns.gpus
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
        shown = f", --mem-fraction-static {fraction}" if fraction is not None and plan.gpus else ""
        print(f"engines: {len(plan.engines)} x {server}{shown}")
    return 0


def gpus_main(argv: list[str]) -> int:
    """`millstream gpus`: how many GPUs torch sees in this process: the count on the first line
    (0 without CUDA; without a driver or a visible GPU, torch is not even imported, so a CPU
    machine's `make run` pays nothing), then one line per GPU (index, name, UUID). A script asks millstream
    itself, not a python it guesses beside it, so the answer is the trainer's own torch's
    (examples/arith/run.sh decides --colocate --bf16 by it)."""
    import argparse

    argparse.ArgumentParser(
        prog="millstream gpus", description="print how many GPUs torch sees here"
    ).parse_args(argv)
    if visible_gpus() == 0:  # no NVIDIA driver, or none visible: 0 without importing torch
        print(0)
        return 0
    import torch

    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    print(count)
    for i in range(count):
        props = torch.cuda.get_device_properties(i)
        print(f"cuda:{i} {props.name} {props.uuid}")
    return 0
