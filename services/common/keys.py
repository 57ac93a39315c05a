"""Every Redis key name of a run, in one place. Keys are prefixed by the run id."""

from __future__ import annotations

from dataclasses import dataclass

STREAM_PROMPTS = "prompts"
STREAM_GENERATED = "generated"
STREAM_SCORED = "scored"
STREAM_DEAD = "dead"

GROUP_ROLLOUT = "rollout"
GROUP_REWARD = "reward"
GROUP_TRAINER = "trainer"


@dataclass(frozen=True)
class RunKeys:
    run_id: str

    def _key(self, name: str) -> str:
        return f"{self.run_id}:{name}"

    @property
    def prompts(self) -> str:
        return self._key(STREAM_PROMPTS)

    @property
    def generated(self) -> str:
        return self._key(STREAM_GENERATED)

    @property
    def scored(self) -> str:
        return self._key(STREAM_SCORED)

    @property
    def dead(self) -> str:
        return self._key(STREAM_DEAD)

    @property
    def config(self) -> str:
        return self._key("config")

    @property
    def version(self) -> str:
        """The trainer's policy version (weight syncs done), an integer."""
        return self._key("version")

    @property
    def engines(self) -> str:
        """The engines this run's trainers synced, a set of URLs: a trainer that starts looks
        at them again (a restarted router and trainer both forgot them)."""
        return self._key("engines")

    @property
    def update_group(self) -> str:
        """The run's current weight-update group, as its rank 0 wrote it down (JSON): a trainer
        that starts frees the SGLang servers an earlier one left blocked in its rendezvous."""
        return self._key("update_group")

    @property
    def lease(self) -> str:
        """The trainer's hold on the run (a hash: fence, holder; expires unless renewed):
        one trainer per run (trainer/lease.py)."""
        return self._key("lease")

    @property
    def fence(self) -> str:
        """The run's fencing number, an integer that grows with each new lease holder."""
        return self._key("fence")

    @property
    def coordinator(self) -> str:
        """host:port of the trainer's Coordinator gRPC service (for engines to JoinEngine)."""
        return self._key("coordinator")

    def heartbeat(self, kind: str, name: str) -> str:
        """A live worker's heartbeat key (expires when the worker stops beating)."""
        return self._key(f"workers:{kind}:{name}")
