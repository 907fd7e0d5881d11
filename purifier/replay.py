"""Replay statistics: what a γ (and a similarity measure) does to one iteration's raw trajectories,
computed from the stored attempt trees only (nothing is regenerated). `cleaner replay` prints them;
`cleaner replay --sweep` adds the similarity histogram, a PNG and example pairs around each γ.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from pipeline.similarity import REFERENCE_MEASURE, Measure
from pipeline.trajectory import Trajectory
from purifier.saar import purify

Decode = Callable[[list[int]], str]


@dataclass
class ReplayStats:
    gamma: float
    positions: int  # positions with at least one spliced retry
    shallow: int
    deep: int
    tokens_removed: int
    tokens_recomputed: int
    differ_from_live: int  # splices whose shallow/deep decision differs from the one lived (γ_live, live measure)
    differ_from_reference: int  # ... differs from the reference measure's (difflib on the segment) at this γ


@dataclass(frozen=True)
class Candidate:
    """One failed-call/retry pair as lived: the calls compared and their similarity under a measure."""

    key: str
    position_idx: int
    attempt_idx: int
    old_call: str
    new_call: str
    similarity: float


def with_retries(raws: list[Trajectory]) -> list[Trajectory]:
    """Rows where γ can change anything (SAAR on, some position retried)."""
    return [r for r in raws if r.saar_gate and any(len(p.attempts) > 1 for p in r.positions)]


def replay_stats(raws: list[Trajectory], gamma: float, decode: Decode, measure: Measure,
                 live: Measure, reference: Measure = REFERENCE_MEASURE) -> ReplayStats:
    s = ReplayStats(gamma, 0, 0, 0, 0, 0, 0, 0)
    for raw in with_retries(raws):
        ours = purify(raw, gamma, "saar", decode, measure)
        lived = {(x.position_idx, x.attempt_idx): x.kind for x in purify(raw, raw.gamma_live, "saar", decode, live).splices}
        ref = {(x.position_idx, x.attempt_idx): x.kind for x in purify(raw, gamma, "saar", decode, reference).splices}
        s.positions += len({x.position_idx for x in ours.splices})
        for x in ours.splices:
            s.shallow += x.kind == "shallow"
            s.deep += x.kind == "deep"
            s.tokens_removed += x.tokens_removed
            s.differ_from_live += lived.get((x.position_idx, x.attempt_idx)) != x.kind
            s.differ_from_reference += ref.get((x.position_idx, x.attempt_idx)) != x.kind
        s.tokens_recomputed += sum(1 for m, v in zip(ours.loss_mask, ours.logprob_valid) if m and not v)
    return s


def candidates(raws: list[Trajectory], decode: Decode, measure: Measure, live: Measure) -> list[Candidate]:
    """The pairs compared when the iteration is purified as it was lived (the chain of splices at
    γ_live), each with its similarity under `measure`."""
    out = []
    for raw in with_retries(raws):
        for x in purify(raw, raw.gamma_live, "saar", decode, live).splices:
            pos = raw.positions[x.position_idx]
            old = _current_call(raw, x.position_idx, x.attempt_idx, decode)
            new_turn = pos.attempts[x.attempt_idx]
            new = decode(new_turn.turn_ids[max(new_turn.call_start, 0):])
            out.append(Candidate(raw.key, x.position_idx, x.attempt_idx, old, new, measure(old, new)))
    return out


def _current_call(raw: Trajectory, position: int, attempt: int, decode: Decode) -> str:
    """The call segment a retry was compared against: that of the previous attempt as spliced so far
    (a shallow splice keeps the old reasoning but always takes the retry's call, so it is the call of
    the previous attempt)."""
    prev = raw.positions[position].attempts[attempt - 1]
    return decode(prev.turn_ids[max(prev.call_start, 0):])


def sweep_gammas(start: float = 0.0, stop: float = 1.0, step: float = 0.05) -> list[float]:
    n = int(round((stop - start) / step))
    return [round(start + i * step, 10) for i in range(n + 1)]


def histogram_lines(values: list[float], gammas: list[float], bins: int = 20, width: int = 40) -> list[str]:
    """A terminal histogram of similarities in [0, 1], with the γ values that cut each bin marked."""
    counts = [0] * bins
    for v in values:
        counts[min(bins - 1, int(v * bins))] += 1
    top = max(counts) or 1
    lines = []
    for i, c in enumerate(counts):
        lo, hi = i / bins, (i + 1) / bins
        cuts = [g for g in gammas if lo <= g < hi or (i == bins - 1 and g == 1.0)]
        mark = f"  ← γ={', '.join(f'{g:g}' for g in cuts)}" if cuts else ""
        lines.append(f"{lo:4.2f}–{hi:4.2f} │{'█' * round(width * c / top):<{width}}│ {c:4d}{mark}")
    return lines


def examples_around(cands: list[Candidate], gamma: float, k: int = 1) -> list[tuple[str, Candidate]]:
    """The k pairs just below and just at/above γ: what a person judges the threshold by."""
    below = sorted((c for c in cands if c.similarity < gamma), key=lambda c: -c.similarity)[:k]
    above = sorted((c for c in cands if c.similarity >= gamma), key=lambda c: c.similarity)[:k]
    return [("deep", c) for c in below] + [("shallow", c) for c in above]


def plot(path: Path, cands: list[Candidate], stats: list[ReplayStats], gamma_live: float, title: str) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    ax1.hist([c.similarity for c in cands], bins=20, range=(0, 1), color="#4c72b0")
    ax1.axvline(gamma_live, color="k", linestyle="--", label=f"γ_live={gamma_live:g}")
    ax1.set_xlabel("similarity of failed call vs retry"), ax1.set_ylabel("splice candidates"), ax1.legend()
    ax1.set_title("similarity distribution")
    g = [s.gamma for s in stats]
    ax2.plot(g, [s.shallow for s in stats], label="shallow")
    ax2.plot(g, [s.deep for s in stats], label="deep")
    ax2.plot(g, [s.differ_from_live for s in stats], label="≠ lived decision")
    ax2.plot(g, [s.differ_from_reference for s in stats], label="≠ reference measure")
    ax2.set_xlabel("γ"), ax2.set_ylabel("splices"), ax2.legend(), ax2.set_title("decisions per γ")
    fig.suptitle(title)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
