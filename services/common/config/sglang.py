"""Inference flags (Miles' SGLANG_ARGS): how many engines, and the weight-sync transport."""

from __future__ import annotations

from dataclasses import dataclass

from .. import weight_routes
from ..weight_routes import AUTO, SPELLINGS
from .errors import ConfigError
from .schema import derived, flag

SERVER_PREFIX = "--sglang-"


def server_arg(server_args: list[str], name: str) -> str | None:
    """The value of --sglang-`name` among the collected server flags (`--x v` or `--x=v`)."""
    option = SERVER_PREFIX + name
    for i, arg in enumerate(server_args):
        if arg.startswith(option + "="):
            return arg.split("=", 1)[1]
        if arg == option and i + 1 < len(server_args) and not server_args[i + 1].startswith("--"):
            return server_args[i + 1]
    return None


def split_server_args(extras: list[str]) -> tuple[list[str], list[str]]:
    """(the --sglang-X flags argparse did not know, each with the values that follow it;
    the rest). Values are the arguments up to the next one that starts with "--"."""
    server: list[str] = []
    rest: list[str] = []
    taking = False
    for arg in extras:
        if arg.startswith("--"):
            taking = arg.startswith(SERVER_PREFIX)
        (server if taking else rest).append(arg)
    return server, rest


@dataclass(frozen=True)
class SglangConfig:
    rollout_num_engines: int = flag(1, "inference engines `millstream train` starts locally")
    rollout_num_gpus: int | None = flag(
        None,
        "Miles: GPUs for the engines started here (with --colocate: default the trainer's; "
        "0: engines on the CPU); placement: launch/plan.py",
    )
    rollout_num_gpus_per_engine: int = flag(
        1, "Miles: GPUs per engine (SGLang's --tp-size; millstream's own engine takes 1)"
    )
    colocate: bool = flag(
        False,
        "Miles: the engines run on the trainer's GPU and take turns with it (one GPU: "
        "the engine's memory is released while the trainer steps; docs/gpus.md)",
    )
    offload: bool = flag(False, "Miles: both --offload-train and --offload-rollout")
    offload_train: bool | None = flag(
        None,
        "Miles: the trainer's parameters, gradients and optimizer state go to host memory "
        "while colocated engines generate (default: on with --colocate)",
    )
    offload_rollout: bool | None = flag(
        None,
        "Miles: the engines release their KV cache and weights while a colocated trainer "
        "trains (default: on with --colocate)",
    )

    sglang_mem_fraction_static: float | None = flag(
        None,
        "the share of a GPU for an engine's weights and static KV cache (its "
        "--mem-fraction-static; default 0.85 on a GPU of its own, 0.4 on the trainer's GPU)",
    )
    # Every other --sglang-X [value] on the command line, in order: SGLang server settings,
    # handed to `sglang.launch_server` as --X [value] as Miles does (launch/engines.py).
    sglang_server_args: list[str] = derived(
        [], "the --sglang-* server flags given, for the SGLang servers started here"
    )
    # SGLang's --dp-size, as Miles' args.sglang_dp_size: what --sglang-dp-size gave (1 without).
    sglang_dp_size: int = derived(
        1,
        "the --sglang-dp-size given (SGLang's --dp-size, passed to the SGLang servers started "
        "here); plugins read it as args.sglang_dp_size",
    )
    sglang_server_concurrency: int = flag(
        512,
        "accepted: Miles' in-flight requests per engine, which sizes GenerateState's semaphore "
        "(x engines) for plugins; millstream's own rollout is capped per worker by "
        "--rollout-max-concurrency",
    )
    sglang_router_ip: str | None = flag(None, "an existing router (alias of --router-url's host)")
    sglang_router_port: int | None = flag(None, "")
    engine_max_running_requests: int = flag(64, "continuous-batching bound of a local engine")
    update_weight_buffer_size: int = flag(512 * 1024**2, "bytes per weight-sync bucket")
    pause_mode: str = flag(
        "abort", "how engines pause for a sync", choices=("abort", "in_place", "retract")
    )
    weight_sync_timeout: float = flag(120.0, "seconds for each step of the weight sync")
    weight_sync_master_address: str | None = flag(
        None,
        "address engines reach the trainer at, for its weight-update rendezvous and its "
        "Coordinator (default: 127.0.0.1 when the router is on loopback, else this host's "
        "address)",
    )
    update_weight_transport: str = flag(
        AUTO,
        "how weights reach each engine: auto (by where the two live: the trainer's GPU -> "
        "tensor over CUDA IPC; this machine with a CPU side -> tensor over shared memory; "
        "else nccl, printed at start-up), nccl (an update group: NCCL between GPUs, gloo "
        "where a side is on a CPU; also spelled group or distributed), tensor "
        "(/update_weights_from_tensor with a shared handle), disk (safetensors in "
        "--update-weight-disk-dir). Held as the route's one name (common/weight_routes.py)",
        choices=SPELLINGS,
    )
    update_weight_disk_dir: str | None = flag(
        None,
        "with --update-weight-transport disk: a directory the trainer and every engine see "
        "(default: RUN_DIR/weight_updates)",
    )
    update_weight_mode: str = flag(
        "full", "Miles: full weights at every sync (delta is refused)", choices=("full", "delta")
    )
    weight_sync_format: str = flag(
        "flattened_bucket",
        "one broadcast per bucket (SGLang's load_format flattened_bucket), or per_tensor for "
        "SGLang releases without it",
        choices=("flattened_bucket", "per_tensor"),
    )

    def __post_init__(self) -> None:
        fraction = self.sglang_mem_fraction_static
        if fraction is not None and not 0 < fraction < 1:
            raise ConfigError(f"--sglang-mem-fraction-static must be in (0, 1) (got {fraction})")
        if self.rollout_num_engines <= 0:
            raise ConfigError(f"--rollout-num-engines must be > 0 (got {self.rollout_num_engines})")
        if self.rollout_num_gpus is not None and self.rollout_num_gpus < 0:
            raise ConfigError(f"--rollout-num-gpus must be >= 0 (got {self.rollout_num_gpus})")
        if self.rollout_num_gpus_per_engine <= 0:
            raise ConfigError(
                "--rollout-num-gpus-per-engine must be > 0 "
                f"(got {self.rollout_num_gpus_per_engine})"
            )
        if self.sglang_dp_size <= 0:
            raise ConfigError(f"--sglang-dp-size must be > 0 (got {self.sglang_dp_size})")
        try:  # the flag's one check; any spelling, held by the route's one name
            route = weight_routes.setting(self.update_weight_transport)
        except ValueError as err:
            raise ConfigError(str(err)) from None
        object.__setattr__(self, "update_weight_transport", route)
        if self.update_weight_buffer_size <= 0:
            raise ConfigError(
                f"--update-weight-buffer-size must be > 0 (got {self.update_weight_buffer_size})"
            )
