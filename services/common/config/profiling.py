"""Profiling flags, spelled as in Miles (Megatron's PROFILING_ARGS plus Miles' --profile-target).

Rollouts are counted from 0, as the backend's `rollout_id` (the metrics log's iteration N is
rollout N-1). The profiled rollouts are [--profile-step-start, --profile-step-end), as Miles'
torch.profiler schedule (wait start-1, warmup 1, active end-start) makes them.

--use-pytorch-profiler writes one Chrome trace per target and rollout in that window (see
millstream/trainer/observe/profiler.py). --memory-snapshot-path records the CUDA caching
allocator's history over the same window and dumps it there, for https://pytorch.org/memory_viz; it needs
a CUDA GPU, and preflight refuses it on a machine without one (CPU allocations are in the
traces: they are recorded with profile_memory, as Miles records them). Unlike Megatron, where
--record-memory-history turns recording on and the path has a default, giving the path is
what turns it on here.
"""

from __future__ import annotations

from dataclasses import dataclass

from .errors import ConfigError
from .schema import flag

PROFILE_TARGETS = ("train_overall", "train_actor", "train_log_probs")
MEMORY_SNAPSHOT_NEEDS_CUDA = (
    "--memory-snapshot-path needs a CUDA GPU: it records the CUDA caching allocator's history "
    "(torch.cuda.memory._record_memory_history) and torch sees no GPU here; on CPU, "
    "--use-pytorch-profiler's traces carry the CPU allocations (profile_memory)"
)


@dataclass(frozen=True)
class ProfilingConfig:
    use_pytorch_profiler: bool = flag(
        False,
        "write torch.profiler Chrome traces (Perfetto, TensorBoard) of the rollouts in "
        "[--profile-step-start, --profile-step-end), under --tensorboard-dir, else RUN_DIR/profile",
    )
    profile_step_start: int = flag(10, "first profiled rollout (0-based rollout id)")
    profile_step_end: int = flag(12, "the rollout profiling stops before (exclusive)")
    profile_target: list[str] = flag(
        ["train_overall"],
        "what to trace, one file each: train_overall (the whole train step), train_actor (the "
        "optimizer steps), train_log_probs (the no-grad forwards before them)",
        choices=PROFILE_TARGETS,
    )
    memory_snapshot_path: str | None = flag(
        None,
        "record CUDA memory history over the profiled rollouts and dump it to this pickle "
        "(pytorch.org/memory_viz); needs a CUDA GPU",
    )

    @property
    def enabled(self) -> bool:
        """Anything to record: traces or a memory snapshot."""
        return self.use_pytorch_profiler or bool(self.memory_snapshot_path)

    def __post_init__(self) -> None:
        unknown = [t for t in self.profile_target if t not in PROFILE_TARGETS]
        if unknown or not self.profile_target:
            raise ConfigError(
                f"--profile-target {' '.join(self.profile_target) or '(none)'}: choose from "
                f"{', '.join(PROFILE_TARGETS)}"
            )
        if self.memory_snapshot_path is not None and not self.memory_snapshot_path.strip():
            raise ConfigError("--memory-snapshot-path is empty: give the file to dump to")
        if not self.enabled:
            return  # Miles ignores the window without a profiler; so do we
        if self.profile_step_start < 0:
            raise ConfigError(f"--profile-step-start must be >= 0 (got {self.profile_step_start})")
        if self.profile_step_end <= self.profile_step_start:
            raise ConfigError(
                f"--profile-step-end ({self.profile_step_end}) must be greater than "
                f"--profile-step-start ({self.profile_step_start}): the profiled rollouts are "
                "[start, end), this window is empty"
            )
