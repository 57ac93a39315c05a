"""A reward worker's scoring in process: the `Rewarder` and `GroupScorer` a reward worker
builds from its config, over the given groups, closed afterwards.

    scored, stats = score_groups(cfg, group_a, group_b)
"""

from __future__ import annotations

import asyncio
from typing import Any

from millstream.common.config import RunConfig
from millstream.common.types import SampleGroup
from millstream.reward.rewarder import Rewarder
from millstream.reward.scorer import GroupScorer


def score_groups(cfg: RunConfig, *groups: SampleGroup) -> tuple[list[Any], Any]:
    """Each group's scoring result, in order, and the scorer's stats."""

    async def go() -> tuple[list[Any], Any]:
        rewarder = Rewarder(cfg)
        scorer = GroupScorer(cfg, rewarder)
        try:
            return [await scorer.score(g) for g in groups], scorer.stats
        finally:
            await rewarder.aclose()

    return asyncio.run(go())
