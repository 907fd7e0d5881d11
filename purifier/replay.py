"""Replay statistics: what a γ does to one iteration's raw trajectories (printed by `cleaner replay`)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from pipeline.splice import difflib_similarity
from pipeline.trajectory import Trajectory
from purifier.saar import purify


@dataclass
class ReplayStats:
    gamma: float
    positions: int  # positions with at least one spliced retry
    shallow: int
    deep: int
    tokens_removed: int
    tokens_recomputed: int
    differ_from_live: int  # splices whose shallow/deep decision differs from the decision at γ_live
    differ_from_difflib: int  # ... differs from the decision with difflib's ratio (the reference)


def replay_stats(raws: list[Trajectory], gamma: float, decode: Callable[[list[int]], str]) -> ReplayStats:
    s = ReplayStats(gamma, 0, 0, 0, 0, 0, 0, 0)
    for raw in raws:
        ours = purify(raw, gamma, "saar", decode)
        live = {(x.position_idx, x.attempt_idx): x.kind for x in purify(raw, raw.gamma_live, "saar", decode).splices}
        ref = {(x.position_idx, x.attempt_idx): x.kind
               for x in purify(raw, gamma, "saar", decode, measure=difflib_similarity).splices}
        s.positions += len({x.position_idx for x in ours.splices})
        for x in ours.splices:
            s.shallow += x.kind == "shallow"
            s.deep += x.kind == "deep"
            s.tokens_removed += x.tokens_removed
            s.differ_from_live += live.get((x.position_idx, x.attempt_idx)) != x.kind
            s.differ_from_difflib += ref.get((x.position_idx, x.attempt_idx)) != x.kind
        s.tokens_recomputed += sum(1 for m, v in zip(ours.loss_mask, ours.logprob_valid) if m and not v)
    return s
