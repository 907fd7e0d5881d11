"""Group stage: GRPO advantages per prompt group and DAPO dynamic filtering (pure functions)."""
from __future__ import annotations

import math
from dataclasses import replace

from pipeline.trajectory import PurifiedTrajectory

EPS = 1e-6


def group_advantages(rewards: list[float], estimator: str) -> list[float]:
    """`group_norm`: (r − mean)/(std + ε) (std unbiased=False, as OpenRLHF); `dr_grpo`: r − mean."""
    n = len(rewards)
    mean = sum(rewards) / n
    if estimator == "dr_grpo":
        return [r - mean for r in rewards]
    if estimator != "group_norm":
        raise ValueError(f"unknown advantage estimator {estimator!r}")
    std = math.sqrt(sum((r - mean) ** 2 for r in rewards) / n)
    return [(r - mean) / (std + EPS) for r in rewards]


def apply_group(group: list[PurifiedTrajectory], estimator: str, dynamic_filter: bool) -> list[PurifiedTrajectory]:
    """Advantages for one prompt group, ordered by sample; [] when the group is filtered out."""
    group = sorted(group, key=lambda t: t.sample_idx)
    rewards = [t.reward for t in group]
    if dynamic_filter and max(rewards) == min(rewards):
        return []  # no learning signal: every sample got the same reward
    return [replace(t, advantage=a) for t, a in zip(group, group_advantages(rewards, estimator))]
