"""Replay statistics: what a γ (and a similarity measure), or saar_is's τ, does to one iteration's raw
trajectories, computed from the stored attempt trees (nothing is regenerated; τ scores rollbacks with the
policy that sampled them). `cleaner replay` prints them;
`cleaner replay --sweep` adds the similarity histogram, a PNG and example pairs around each γ.
"""

from __future__ import annotations

import bisect
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from rapidfuzz.distance import Indel

from pipeline.similarity import REFERENCE_MEASURE, Measure
from pipeline.trajectory import Trajectory, fingerprint
from purifier.saar import Scorer, purify

Decode = Callable[[list[int]], str]


@dataclass
class ReplayStats:
    gamma: float
    positions: int = 0  # positions with at least one spliced retry
    shallow: int = 0
    deep: int = 0
    tokens_removed: int = 0
    tokens_recomputed: int = 0
    differ_from_live: int = 0  # splices whose shallow/deep decision differs from the one lived (γ_live, live measure)
    differ_from_reference: int = 0  # ... differs from the reference measure's (difflib on the segment) at this γ


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


def replay_stats(
    raws: list[Trajectory],
    gamma: float,
    decode: Decode,
    measure: Measure,
    live: Measure,
    reference: Measure = REFERENCE_MEASURE,
) -> ReplayStats:
    s = ReplayStats(gamma=gamma)
    for raw in with_retries(raws):
        ours = purify(raw, gamma, "saar", decode, measure)
        lived = {
            (x.position_idx, x.attempt_idx): x.kind for x in purify(raw, raw.gamma_live, "saar", decode, live).splices
        }
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


@dataclass
class ISStats:
    """What a τ does to an iteration under saar_is (Plan B): rollbacks decided, replaced, appended, and how
    many decisions differ from those at the reference τ."""

    tau: float
    rollbacks: int
    replaced: int
    appended: int
    tokens_removed: int
    differ_from_reference: int


def replay_is(
    raws: list[Trajectory], taus: list[float], decode: Decode, score: Scorer, reference_tau: float = 0.5
) -> tuple[list[ISStats], list[float]]:
    """saar_is at each τ on the stored attempt trees, in memory, and the log importance ratio of every rollback
    scored. Decisions depend on earlier ones only through their contexts, so a memo of (context, turn) scores
    makes a τ grid cost about one τ's scoring."""
    memo: dict[tuple[str, tuple[int, ...]], list[float]] = {}
    # A retry is named by its attempt, not its turn ids: a policy that repeats its code samples the very same ids
    # in two retries, which ids alone would count as one rollback. purify() hands the scorer each attempt's own
    # turn_ids list, so the list object names the attempt.
    attempt_of = {
        id(a.turn_ids): (r.key, q.position_idx, a.attempt_idx, sum(a.logprobs))
        for r in raws
        for q in r.positions
        for a in q.attempts
    }
    ratios: dict[tuple[str, str, int, int], float] = {}

    def decisions(raw: Trajectory, tau: float) -> tuple[dict[tuple[int, int], bool], int]:
        seen: list[tuple[int, int]] = []

        def counting(context: list[int], turn: list[int]) -> list[float]:
            key, position, attempt, sampled = attempt_of[id(turn)]
            context_id = fingerprint(context)
            if (context_id, tuple(turn)) not in memo:
                memo[context_id, tuple(turn)] = score(context, turn)
            scores = memo[context_id, tuple(turn)]
            ratios[context_id, key, position, attempt] = sum(scores) - sampled
            seen.append((position, attempt))
            return scores

        p = purify(raw, 0.0, "saar_is", decode, score=counting, tau=tau)
        replaced = {(x.position_idx, x.attempt_idx) for x in p.splices}
        return {a: a in replaced for a in seen}, sum(x.tokens_removed for x in p.splices)

    rows = with_retries(raws)
    reference = {r.key: decisions(r, reference_tau)[0] for r in rows}
    out = []
    for tau in taus:
        st = ISStats(tau, 0, 0, 0, 0, 0)
        for r in rows:
            got, removed = decisions(r, tau)
            st.rollbacks += len(got)
            st.replaced += sum(got.values())
            st.tokens_removed += removed
            st.differ_from_reference += sum(reference[r.key].get(k) != v for k, v in got.items())
        st.appended = st.rollbacks - st.replaced
        out.append(st)
    return out, sorted(ratios.values())


def sweep_taus() -> list[float]:
    """τ from 0.1 to 2 (a ratio: below 1 tolerates a retry the clean context finds less likely)."""
    return [0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 1.0, 1.25, 1.5, 2.0]


IS_EDGES = (0.0, 1e-4, 1e-2, 0.1, 0.2, 0.3, 0.5, 0.7, 1.0, 1.5, 2.0, 4.0, math.inf)


def log_histogram_lines(log_ratios: list[float], taus: list[float], width: int = 40) -> list[str]:
    """A terminal histogram of importance ratios (log ratios given) in bins fine where τ is chosen, coarse in
    the tails, with the τ values that fall in each bin marked."""
    counts = [0] * (len(IS_EDGES) - 1)
    for v in log_ratios:
        counts[min(len(counts) - 1, max(0, bisect.bisect_right(IS_EDGES, math.exp(v)) - 1))] += 1
    bins = list(zip(IS_EDGES, IS_EDGES[1:]))
    return _bars(
        counts,
        [f"IS {lo:>6g}–{hi:<6g}" for lo, hi in bins],
        [[t for t in taus if lo <= t < hi] for lo, hi in bins],
        "τ",
        width,
    )


def _bars(counts: list[int], labels: list[str], cuts: list[list[float]], symbol: str, width: int) -> list[str]:
    """One histogram line per bin: its label, a bar scaled to the largest count, the count, the cuts it holds."""
    top = max(counts) or 1
    return [
        f"{label}│{'█' * round(width * c / top):<{width}}│ {c:4d}"
        + (f"  ← {symbol}={', '.join(f'{t:g}' for t in cut)}" if cut else "")
        for label, c, cut in zip(labels, counts, cuts)
    ]


def candidates(raws: list[Trajectory], decode: Decode, measure: Measure, live: Measure) -> list[Candidate]:
    """The pairs compared when the iteration is purified as it was lived (the chain of splices at
    γ_live), each with its similarity under `measure`."""
    out = []
    for raw in with_retries(raws):
        for x in purify(raw, raw.gamma_live, "saar", decode, live).splices:
            attempts = raw.positions[x.position_idx].attempts
            # compared against the call as spliced so far: a shallow splice keeps the old reasoning but always
            # takes the retry's call, so it is the previous attempt's call
            old, new = (
                decode(a.turn_ids[max(a.call_start, 0) :]) for a in attempts[x.attempt_idx - 1 : x.attempt_idx + 1]
            )
            out.append(Candidate(raw.key, x.position_idx, x.attempt_idx, old, new, measure(old, new)))
    return out


def sweep_gammas(start: float = 0.0, stop: float = 1.0, step: float = 0.05) -> list[float]:
    n = int(round((stop - start) / step))
    return [round(start + i * step, 10) for i in range(n + 1)]


def histogram_lines(values: list[float], gammas: list[float], bins: int = 20, width: int = 40) -> list[str]:
    """A terminal histogram of similarities in [0, 1], with the γ values that cut each bin marked."""
    counts = [0] * bins
    for v in values:
        counts[min(bins - 1, int(v * bins))] += 1
    edges = [(i / bins, (i + 1) / bins) for i in range(bins)]
    return _bars(
        counts,
        [f"{lo:4.2f}–{hi:4.2f} " for lo, hi in edges],
        [[g for g in gammas if lo <= g < hi or (hi == 1.0 and g == 1.0)] for lo, hi in edges],
        "γ",
        width,
    )


def diff_window(old: str, new: str, width: int = 70, context: int = 12) -> tuple[str, str]:
    """An example pair as two lines of at most `width` characters, both starting `context` characters before
    the first difference (rapidfuzz's Indel opcodes): calls share a long JSON prefix (`<tool_call>{"name":
    "python", "arguments": {"code": "`), and a head cut of each would show only that."""
    old, new = old.replace("\n", "⏎"), new.replace("\n", "⏎")
    first = next((op for op in Indel.opcodes(old, new) if op.tag != "equal"), None)
    start = 0 if first is None else max(0, first.src_start - context)  # = dest_start: all before it is shared
    return _window(old, start, width), _window(new, start, width)


def _window(text: str, start: int, width: int) -> str:
    head = "…" if start else ""
    rest = text[start:]
    room = width - len(head)
    return head + (rest if len(rest) <= room else rest[: room - 1] + "…")


def examples_around(cands: list[Candidate], gamma: float, k: int = 1) -> list[tuple[str, Candidate]]:
    """The k pairs just below and just at/above γ: what a person judges the threshold by."""
    below = sorted((c for c in cands if c.similarity < gamma), key=lambda c: -c.similarity)[:k]
    above = sorted((c for c in cands if c.similarity >= gamma), key=lambda c: c.similarity)[:k]
    return [("deep", c) for c in below] + [("shallow", c) for c in above]


def plot(path: Path, cands: list[Candidate], stats: list[ReplayStats], gamma_live: float | None, title: str) -> Path:
    """`replay_figure` written as a PNG at `path`."""
    import matplotlib.pyplot as plt

    fig = replay_figure(cands, stats, gamma_live, title)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def replay_figure(cands: list[Candidate], stats: list[ReplayStats], gamma_live: float | None, title: str):
    """The similarity histogram with γ_live and the decisions per γ (`gamma_live` None: the run lived no γ, or did
    not record one, so neither its line nor the "≠ lived" curve is drawn)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    ax1.hist([c.similarity for c in cands], bins=20, range=(0, 1), color="#4c72b0")
    if gamma_live is not None:
        ax1.axvline(gamma_live, color="k", linestyle="--", label=f"γ_live={gamma_live:g}")
        ax1.legend()
    ax1.set_xlabel("similarity of failed call vs retry"), ax1.set_ylabel("splice candidates")
    ax1.set_title("similarity distribution")
    g = [s.gamma for s in stats]
    # curves often coincide (below γ_live every deep splice is one the rollout decided otherwise): each has its own
    # line style and marker so that none hides another
    curves = [("shallow", [s.shallow for s in stats], "-", "o"), ("deep", [s.deep for s in stats], "--", "s")]
    if gamma_live is not None:
        curves.append(("≠ lived decision", [s.differ_from_live for s in stats], ":", "^"))
    curves.append(("≠ reference measure", [s.differ_from_reference for s in stats], "-.", "x"))
    for label, ys, style, marker in curves:
        ax2.plot(g, ys, linestyle=style, marker=marker, markersize=4, label=label)
    ax2.set_xlabel("γ"), ax2.set_ylabel("splices"), ax2.legend(), ax2.set_title("decisions per γ")
    fig.suptitle(title)
    fig.tight_layout()
    return fig
