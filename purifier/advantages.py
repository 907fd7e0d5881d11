"""Group stage: GRPO advantages per prompt group and DAPO dynamic filtering (pure functions)."""

from __future__ import annotations

import math

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


def group_plan(samples: list[tuple[int, float]], estimator: str, dynamic_filter: bool) -> list[tuple[int, float]]:
    """(position in the input, advantage) per (sample_idx, reward), in sample order; [] when filtered."""
    order = sorted(range(len(samples)), key=lambda k: samples[k][0])
    rewards = [samples[k][1] for k in order]
    if dynamic_filter and max(rewards) == min(rewards):
        return []  # no learning signal: every sample got the same reward
    return list(zip(order, group_advantages(rewards, estimator)))
