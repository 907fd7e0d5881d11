"""The SAAR splice (SAAR.md §5) on token ids: one primitive shared by the live rollout (γ_live)
and offline purification (any γ).

A turn is split at its call boundary: `prefix` = reasoning before the `<tool_call>` marker,
`call` = marker to end of turn. similarity(failed call, retry call) ≥ γ → SHALLOW (keep the failed
turn's reasoning byte-identical, take the retry's call); otherwise, or when either split fails,
DEEP (take the whole retry turn).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Literal

from rapidfuzz import fuzz


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


def similarity(a: str, b: str) -> float:
    """rapidfuzz Indel normalized similarity: difflib's ratio without its autojunk distortion."""
    return fuzz.ratio(a, b) / 100.0


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


def difflib_similarity(a: str, b: str) -> float:
    """The reference implementation's measure (difflib ratio, default autojunk): for agreement reports."""
    import difflib

    return difflib.SequenceMatcher(None, a, b).ratio()


def decide(failed: TurnPiece, retry: TurnPiece, gamma: float, decode: Callable[[list[int]], str],
           measure: Callable[[str, str], float] = similarity) -> SpliceDecision:
    split_failed = failed.call_start < 0 or retry.call_start < 0
    if split_failed:
        sim = measure(decode(list(failed.ids)), decode(list(retry.ids)))
        return SpliceDecision("deep", sim, True)
    sim = measure(decode(list(failed.ids[failed.call_start:])), decode(list(retry.ids[retry.call_start:])))
    return SpliceDecision("shallow" if sim >= gamma else "deep", sim, False)


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
