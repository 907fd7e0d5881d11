"""One trajectory as the page shows it: the raw attempt tree as a timeline, and every purified variant of the
row aligned with it at token level (flows/viewer/align.py), tokens coloured by their log-probs.

Token HTML is built here as strings, not in the template: a 16k-token row has tens of thousands of token
spans, which a template loop renders several times slower. Every piece of text passes through html.escape
(model output is untrusted); the template receives it as Markup.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from html import escape
from typing import Any, Literal

from markupsafe import Markup

from flows.report_tables import partition_key, partition_label
from flows.viewer.align import Segment, Span, align, segments, splice_preference
from flows.viewer.tokens import TokenText

Colour = Literal["delta", "behaviour", "old", "none"]
COLOURS: dict[str, str] = {
    "delta": "Δ = recomputed (old) − behaviour log-prob of each trained token: red where the trained context makes "
    "the token less likely than when it was sampled, blue where more",
    "behaviour": "behaviour log-prob (as sampled): the less likely the sampled token was, the darker",
    "old": "old log-prob (recomputed in the trained context): the less likely, the darker",
    "none": "no colour",
}
ORIGINS = {0: "not sampled", 1: "in place", 2: "shallow splice", 3: "deep splice", 4: "moved"}


@dataclass
class AttemptView:
    label: str
    attempt_idx: int
    status: str
    error_label: str | None
    error_class: str | None
    call_status: str
    exit_code: int | None
    timed_out: bool
    finish_reason: str
    code: str | None
    tool_text: str | None
    turn_html: Markup
    feedback_html: Markup
    splices: list[str] = field(default_factory=list)  # "saar γ=0.5: shallow, similarity 0.83 to the failed call"


@dataclass
class PositionView:
    position_idx: int
    outcome: str
    attempts: list[AttemptView]


@dataclass
class VariantView:
    label: str
    key: str
    reward: float
    advantage: float
    tokens: int
    trained: int
    splices: list[str]
    recompute_from: int
    tokens_forwarded: int
    has_behaviour: bool
    body: Markup


def _seg_html(tt: TokenText, seg: Segment) -> str:
    return f'<span class="seg {seg.kind}">{escape("".join(tt.pieces(list(seg.ids))))}</span>'


def _splice_notes(purified: list[dict[str, Any]]) -> dict[tuple[int, int], list[str]]:
    """(position, retry attempt) -> what each variant's splice of that retry was."""
    notes: dict[tuple[int, int], list[str]] = {}
    for row in purified:
        name = partition_label(row)
        for s in row["splices"] or []:
            sim = s.get("similarity")
            sim_text = (
                ""
                if sim is None or (isinstance(sim, float) and math.isnan(sim))
                else f", similarity {sim:.3f} to the call it replaced"
            )
            ratio = s.get("log_is_ratio")
            is_text = "" if ratio is None or math.isnan(ratio) else f", importance ratio {math.exp(ratio):.3g}"
            notes.setdefault((s["position_idx"], s["attempt_idx"]), []).append(
                f"{name}: {s['kind']} splice{sim_text}{is_text}"
            )
    return notes


def timeline(
    tt: TokenText, raw: dict[str, Any], segs: list[Segment], purified: list[dict[str, Any]]
) -> tuple[list[PositionView], Markup | None]:
    notes = _splice_notes(purified)
    by_attempt: dict[tuple[int, int], list[Segment]] = {}
    for s in segs:
        by_attempt.setdefault((s.position_idx, s.attempt_idx), []).append(s)
    positions = []
    for p in raw["positions"] or []:
        views = []
        for a in p["attempts"] or []:
            result = a.get("result") or {}
            mine = by_attempt.get((p["position_idx"], a["attempt_idx"]), [])
            turn = Markup("".join(_seg_html(tt, s) for s in mine if s.kind != "tool"))
            tool = Markup("".join(_seg_html(tt, s) for s in mine if s.kind == "tool"))
            views.append(
                AttemptView(
                    label="attempt 0" if a["attempt_idx"] == 0 else f"retry {a['attempt_idx']}",
                    attempt_idx=a["attempt_idx"],
                    status=result.get("status") or "no call run",
                    error_label=result.get("error_label"),
                    error_class=result.get("error_class"),
                    call_status=a["call_status"],
                    exit_code=result.get("exit_code"),
                    timed_out=bool(result.get("timed_out")),
                    finish_reason=a.get("finish_reason") or "",
                    code=a.get("code"),
                    tool_text=result.get("text"),
                    turn_html=turn,
                    feedback_html=tool,
                    splices=notes.get((p["position_idx"], a["attempt_idx"]), []),
                )
            )
        positions.append(PositionView(p["position_idx"], p["outcome"], views))
    final = [s for s in segs if s.position_idx < 0]
    return positions, (Markup("".join(_seg_html(tt, s) for s in final)) if final else None)


def _token_style(colour: Colour, mask: int, origin: int, behaviour: float | None, old: float | None) -> str:
    if colour == "none" or not mask or origin == 0:
        return ""
    if colour == "delta":
        if behaviour is None or old is None:
            return ""
        d = old - behaviour
        if abs(d) < 0.05:
            return ""
        alpha = min(1.0, abs(d) / 2) * 0.7
        return f"background:rgba(220,40,40,{alpha:.2f})" if d < 0 else f"background:rgba(40,90,220,{alpha:.2f})"
    value = behaviour if colour == "behaviour" else old
    if value is None:
        return ""
    alpha = (1 - math.exp(min(0.0, value))) * 0.7
    return f"background:rgba(230,140,0,{alpha:.2f})" if alpha >= 0.02 else ""


def _tokens_html(tt: TokenText, row: dict[str, Any], start: int, end: int, colour: Colour) -> str:
    mask, origin = row["loss_mask"], row.get("token_origin") or []
    behaviour, old = row.get("behaviour_logprobs"), row["old_logprobs"]
    out = []
    for i, piece in enumerate(tt.pieces(row["response_ids"][start:end]), start):
        m, o = mask[i], (origin[i] if i < len(origin) else 1)
        b = behaviour[i] if behaviour else None
        style = _token_style(colour, m, o, b, old[i])
        title = (
            f"#{i} {ORIGINS.get(o, o)} · mask {m}"
            + (f" · behaviour {b:.3f}" if b is not None else "")
            + f" · old {old[i]:.3f}"
        )
        out.append(
            f'<span class="t m{m}" title="{title}"'
            + (f' style="{style}"' if style else "")
            + f">{escape(piece)}</span>"
        )
    return "".join(out)


def _span_html(tt: TokenText, row: dict[str, Any], span: Span, colour: Colour) -> str:
    seg = span.segment
    label = escape(seg.label) if seg is not None else "inserted (not in the raw attempt tree)"
    if span.status == "removed":
        ids = list(span.seg_ids)
        return (
            f'<details class="span removed"><summary>removed: {label} ({len(ids)} tokens)</summary>'
            f'<div class="struck">{escape("".join(tt.pieces(ids)))}</div></details>'
        )
    return (
        f'<div class="span {span.status}"><span class="seglabel">{label}</span>'
        f"{_tokens_html(tt, row, span.start, span.end, colour)}</div>"
    )


def variants(tt: TokenText, segs: list[Segment], purified: list[dict[str, Any]], colour: Colour) -> list[VariantView]:
    out = []
    for row in purified:
        spans = align(segs, list(row["response_ids"]), splice_preference(row["splices"] or []))
        body = "".join(_span_html(tt, row, s, colour) for s in spans)
        splices = [f"position {s['position_idx']} retry {s['attempt_idx']}: {s['kind']}" for s in row["splices"] or []]
        out.append(
            VariantView(
                label=partition_label(row),
                key=partition_key(row),
                reward=row["reward"],
                advantage=row["advantage"],
                tokens=len(row["response_ids"]),
                trained=sum(row["loss_mask"]),
                splices=splices,
                recompute_from=row["recompute_from"],
                tokens_forwarded=row["tokens_forwarded"],
                has_behaviour=row.get("behaviour_logprobs") is not None,
                body=Markup(body),
            )
        )
    return out


def build(
    tt: TokenText, raw: dict[str, Any], purified: list[dict[str, Any]], colour: Colour
) -> tuple[list[PositionView], Markup | None, list[VariantView]]:
    segs = segments(raw)
    positions, final = timeline(tt, raw, segs, purified)
    return positions, final, variants(tt, segs, purified, colour)
