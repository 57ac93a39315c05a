"""The weight routes' names: one per route, from the flag to what an engine advertises.

    nccl     an update group (torch.distributed): one broadcast per bucket, NCCL between GPUs,
             gloo where a side is on a CPU. Miles' name and Miles' default. Also spelled
             `group` (the update group) and `distributed` (SGLang's
             /update_weights_from_distributed; what millstream's engine advertises)
    tensor   /update_weights_from_tensor with a handle to each bucket's bytes: CUDA IPC or
             shared memory (millstream's handle), or SGLang's own format
    disk     safetensors files in a directory both sides see, and /update_weights_from_disk
    auto     (the flag only) a route per engine, by where the two live (trainer/weights/routes/
             choose.py), printed with why

Where each name is read: `--update-weight-transport` (config/sglang.py takes any spelling
and holds the canonical name: `setting`, the one check of the flag), an engine's
`weight_transports` in its /get_server_info (`advertised`), and the trainer's route per engine
(trainer/weights/routes/), printed at start-up by the same names.

Why `nccl` and not `group`: a Miles plugin reads `args.update_weight_transport` (compat/miles
`make_args`, from the config) and compares it with Miles' values (`nccl`, `disk`), so the value
the config holds must be Miles' spelling.
"""

from __future__ import annotations

from collections.abc import Iterable

AUTO, NCCL, TENSOR, DISK = "auto", "nccl", "tensor", "disk"
ROUTES = (NCCL, TENSOR, DISK)
ALIASES = {"group": NCCL, "distributed": NCCL}  # other spellings of a route -> its name
SPELLINGS = (AUTO, *ROUTES, *ALIASES)  # what --update-weight-transport accepts


def canonical(name: str) -> str | None:
    """The route `name` means (None: no route's)."""
    return name if name in ROUTES else ALIASES.get(name)


def setting(value: str) -> str:
    """--update-weight-transport's value as the config holds it: `auto` or a route's name;
    ValueError naming the spellings for anything else."""
    route = AUTO if value == AUTO else canonical(value)
    if route is None:
        raise ValueError(
            f"--update-weight-transport {value!r}: one of {', '.join(SPELLINGS)} "
            f"({', '.join(f'{a} = {r}' for a, r in ALIASES.items())})"
        )
    return route


def advertised(names: Iterable[str]) -> frozenset[str]:
    """The routes an engine's `weight_transports` names (a name no route has is ignored: an
    engine newer than this trainer)."""
    return frozenset(r for r in map(canonical, names) if r is not None)
