"""The SAAR splice (docs/saar.md) on token ids, and the two rules that decide a rollback: each one shared by the
live rollout and offline purification.

A turn is split at its call boundary: `prefix` = reasoning before the `<tool_call>` marker,
`call` = marker to end of turn. similarity(failed call, retry call) ≥ γ → SHALLOW (keep the failed
turn's reasoning byte-identical, take the retry's call); otherwise, or when either split fails,
DEEP (take the whole retry turn). The measure (rapidfuzz or difflib, on the call segment or on the
code only) is pipeline/similarity.py's `Measure`. `decide` is that rule (γ_live live, any γ offline).

Open-CLEANER's Plan B decides by importance ratio instead (`decide_by_ratio`: live under
rollout.saar.rollback=importance, offline in purify mode saar_is): the retry replaces the failed turn when
π(retry | context without the failed turn) / π_b(retry | as sampled) ≥ τ, else it follows the failed turn and
its error where it was sampled.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Literal, Sequence

from pipeline.similarity import DEFAULT_MEASURE, Measure


@dataclass(frozen=True)
class TurnPiece:
    """A (possibly already spliced) assistant turn with where each token was sampled."""

    ids: tuple[int, ...]
    logprobs: tuple[float, ...]
    call_start: int  # -1 when the turn has no call boundary on token ids
    # where the tokens were sampled, as runs in order: (attempt_idx, start, end) of that attempt's turn
    sources: tuple[tuple[int, int, int], ...]


@dataclass(frozen=True)
class SpliceDecision:
    kind: Literal["shallow", "deep"]
    similarity: float
    split_failed: bool


def piece_from_attempt(attempt_idx: int, ids: list[int], logprobs: list[float], call_start: int) -> TurnPiece:
    return TurnPiece(tuple(ids), tuple(logprobs), call_start, ((attempt_idx, 0, len(ids)),))


def _cut_sources(sources: tuple[tuple[int, int, int], ...], lo: int, hi: int) -> tuple[tuple[int, int, int], ...]:
    """The runs covering piece positions [lo, hi)."""
    out, at = [], 0
    for a, s, e in sources:
        n = e - s
        a_lo, a_hi = max(lo, at), min(hi, at + n)
        if a_lo < a_hi:
            out.append((a, s + a_lo - at, s + a_hi - at))
        at += n
    return tuple(out)


def decide(
    failed: TurnPiece,
    retry: TurnPiece,
    gamma: float,
    decode: Callable[[list[int]], str],
    measure: Measure = DEFAULT_MEASURE,
) -> SpliceDecision:
    """Shallow iff similarity ≥ γ, compared exactly (see pipeline/similarity.py); deep if a split fails."""
    if failed.call_start < 0 or retry.call_start < 0:
        sim = measure.ratio(decode(list(failed.ids)), decode(list(retry.ids)))
        return SpliceDecision("deep", sim.value, True)
    sim = measure.ratio(decode(list(failed.ids[failed.call_start :])), decode(list(retry.ids[retry.call_start :])))
    return SpliceDecision("shallow" if sim.at_least(gamma) else "deep", sim.value, False)


def splice(failed: TurnPiece, retry: TurnPiece, decision: SpliceDecision) -> TurnPiece:
    if decision.kind == "deep":
        return retry
    cut, rcut = failed.call_start, retry.call_start
    return TurnPiece(
        ids=failed.ids[:cut] + retry.ids[rcut:],
        logprobs=failed.logprobs[:cut] + retry.logprobs[rcut:],
        call_start=cut,
        sources=_cut_sources(failed.sources, 0, cut) + _cut_sources(retry.sources, rcut, len(retry.ids)),
    )


@dataclass(frozen=True)
class RatioDecision:
    kind: Literal["replace", "append"]
    log_ratio: float  # log π(retry | context without the failed turn) − log π_b(retry | as sampled)


def log_importance_ratio(target: Sequence[float], behaviour: Sequence[float]) -> float:
    """log of a retry's importance ratio from its log-probs: `target` in the context without the failed turn (the
    scoring model's), `behaviour` as sampled."""
    return sum(target) - sum(behaviour)


def decide_by_ratio(target: Sequence[float], behaviour: Sequence[float], tau: float) -> RatioDecision:
    """Replace iff the retry's importance ratio is ≥ τ, compared in log space; a NaN ratio appends."""
    log_ratio = log_importance_ratio(target, behaviour)
    return RatioDecision("replace" if log_ratio >= math.log(tau) else "append", log_ratio)
