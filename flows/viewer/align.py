"""A purified response aligned with the raw attempt tree it was built from, at token level.

The raw row's attempt tree is cut into segments, in the order purification walks it: per position, per
attempt, the turn's reasoning (before the call marker), its call (marker to end of turn) and the tool
response after it; then the final turn. Every mode rebuilds its response from whole segments (a shallow
splice keeps the failed turn's reasoning and takes the retry's call, a deep one takes the retry's turn;
purifier/saar.py), so a purified response is the concatenation of some segments in tree order: each segment
is kept or removed. Several covers exist when a retry repeats tokens of the turn it replaces (a retry's reasoning
is often its failed turn's, token for token); ties go the way the row's recorded splices went (`splice_preference`:
a shallow splice keeps the failed turn's reasoning and the retry's call, a deep one the retry's turn), and
elsewhere against the segments of a failed attempt that has a retry after it.

Found by dynamic programming over (segment, response offset) — linear in the segments times the offsets
reachable, a few milliseconds at 16k tokens. A response that is no such cover (a mode that inserts text) is
aligned with difflib instead, and what it added shows as inserted spans.
"""

from __future__ import annotations

import difflib
from itertools import accumulate
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Literal

SegmentKind = Literal["reasoning", "call", "turn", "tool", "final"]


@dataclass(frozen=True)
class Segment:
    position_idx: int  # -1 for the final turn
    attempt_idx: int
    kind: SegmentKind
    ids: tuple[int, ...]
    logprobs: tuple[float, ...]  # sampled log-probs (tool responses: none sampled, zeros)
    failed_before_retry: bool  # its attempt's call failed and a retry follows at its position

    @property
    def label(self) -> str:
        where = (
            "final turn"
            if self.position_idx < 0
            else (
                f"position {self.position_idx} · "
                + ("attempt 0" if self.attempt_idx == 0 else f"retry {self.attempt_idx}")
            )
        )
        return f"{where} · " + ("tool response" if self.kind == "tool" else self.kind)


@dataclass(frozen=True)
class Span:
    status: Literal["kept", "removed", "inserted"]
    segment: Segment | None  # None for inserted spans
    start: int  # response offsets [start, end) of kept and inserted spans; start == end for removed
    end: int
    seg_lo: int = 0  # the segment's tokens [seg_lo, seg_hi) it covers (all of them, but in difflib's alignment)
    seg_hi: int = -1

    @property
    def seg_ids(self) -> tuple[int, ...]:
        return () if self.segment is None else self.segment.ids[self.seg_lo : self.seg_hi if self.seg_hi >= 0 else None]


def segments(raw: dict[str, Any]) -> list[Segment]:
    """The raw row's attempt tree (an Arrow row as a dict) as segments, in tree order."""
    out: list[Segment] = []
    for p in raw["positions"] or []:
        attempts = p["attempts"] or []
        for k, a in enumerate(attempts):
            ids, lps, cut = a["turn_ids"] or [], a["logprobs"] or [], a["call_start"]
            result = a.get("result") or {}
            failed = result.get("status") == "failure" and k < len(attempts) - 1
            pieces = (
                [("reasoning", 0, cut), ("call", cut, len(ids))]
                if cut is not None and cut >= 0
                else [("turn", 0, len(ids))]
            )
            for kind, lo, hi in pieces:
                if hi > lo:
                    out.append(
                        Segment(p["position_idx"], a["attempt_idx"], kind, tuple(ids[lo:hi]), tuple(lps[lo:hi]), failed)
                    )
            if a["feedback_ids"]:
                out.append(
                    Segment(
                        p["position_idx"],
                        a["attempt_idx"],
                        "tool",
                        tuple(a["feedback_ids"]),
                        (0.0,) * len(a["feedback_ids"]),
                        failed,
                    )
                )
    final = raw.get("final_turn")
    if final and final["turn_ids"]:
        out.append(
            Segment(-1, final["attempt_idx"], "final", tuple(final["turn_ids"]), tuple(final["logprobs"] or ()), False)
        )
    return out


def default_preference(seg: Segment) -> bool:
    return not seg.failed_before_retry


def splice_preference(splices: Iterable[dict[str, Any]]) -> Callable[[Segment], bool]:
    """Which of two equal segments a purified row kept, from its splices: at a spliced position, the reasoning of
    the attempt that began the last deep splice (attempt 0 when all were shallow) and the last retry's call and
    tool response (purifier/saar.py builds the turn so)."""
    by_position: dict[int, list[dict[str, Any]]] = {}
    for s in splices:
        by_position.setdefault(s["position_idx"], []).append(s)
    keep: dict[int, tuple[int, int]] = {}  # position -> (reasoning source, last retry)
    for position, chain in by_position.items():
        chain.sort(key=lambda s: s["attempt_idx"])
        reasoning = 0
        for s in chain:
            if s["kind"] == "deep":
                reasoning = s["attempt_idx"]
        keep[position] = (reasoning, chain[-1]["attempt_idx"])

    def prefer(seg: Segment) -> bool:
        if seg.position_idx not in keep:
            return default_preference(seg)
        reasoning, last = keep[seg.position_idx]
        return seg.attempt_idx == (reasoning if seg.kind == "reasoning" else last)

    return prefer


def align(
    segs: list[Segment], response: list[int], prefer: Callable[[Segment], bool] = default_preference
) -> list[Span]:
    """Each segment kept or removed, in tree order, covering `response` exactly (or difflib's alignment); where
    both cover, `prefer(segment)` says keep."""
    n, total = len(segs), len(response)
    # reach[i]: the response offsets j from which segments i.. can cover response[j:] exactly
    reach: list[set[int]] = [set() for _ in range(n + 1)]
    reach[n] = {total}
    for i in range(n - 1, -1, -1):
        ids, size = segs[i].ids, len(segs[i].ids)
        reach[i] = set(reach[i + 1])  # removed
        for end in reach[i + 1]:  # kept: the segment ends where the rest begins
            start = end - size
            if start >= 0 and (not size or response[start] == ids[0]) and tuple(response[start:end]) == ids:
                reach[i].add(start)
    if 0 not in reach[0]:
        return _diff(segs, response)
    spans, j = [], 0
    for i, seg in enumerate(segs):
        size = len(seg.ids)
        keep = j + size in reach[i + 1] and tuple(response[j : j + size]) == seg.ids
        remove = j in reach[i + 1]
        if keep and (not remove or prefer(seg)):
            spans.append(Span("kept", seg, j, j + size))
            j += size
        else:
            spans.append(Span("removed", seg, j, j))
    return spans


def _diff(segs: list[Segment], response: list[int]) -> list[Span]:
    flat = [t for s in segs for t in s.ids]
    owner = [i for i, s in enumerate(segs) for _ in s.ids]
    first = list(accumulate((len(s.ids) for s in segs[:-1]), initial=0))  # each segment's first offset in `flat`
    matcher = difflib.SequenceMatcher(None, flat, response, autojunk=len(flat) > 20_000)
    spans: list[Span] = []
    for tag, a0, a1, b0, b1 in matcher.get_opcodes():
        if tag in ("equal", "delete", "replace"):
            at = a0
            while at < a1:  # one span per segment touched
                i = owner[at]
                stop = min(a1, first[i] + len(segs[i].ids))
                lo, hi = at - first[i], stop - first[i]
                if tag == "equal":
                    spans.append(Span("kept", segs[i], b0 + (at - a0), b0 + (stop - a0), lo, hi))
                else:
                    spans.append(Span("removed", segs[i], b0, b0, lo, hi))
                at = stop
        if tag in ("insert", "replace"):
            spans.append(Span("inserted", None, b0, b1))
    return spans
