"""SAAR purification as pure functions on raw trajectories (docs/saar.md).

`purify(raw, gamma, mode, decode)` (`tau=` for saar_is) rebuilds one training sequence from the attempt tree in
the raw row, whatever live mode produced it:

- `saar`: at every position, retries are spliced over the failed turn (shallow if the call
  segments' similarity ≥ γ, else deep); failed attempts and their error feedback disappear.
  A retry without a call leaves the position unpurified (failed turn, error, answer all stay);
  after K failed retries the last spliced attempt stays with its error and the note. Either
  ends SAAR for the rest of the trajectory. Infrastructure failures are never purified.
- `raw`: every attempt and every error kept: the no-purification baseline.
- `void_turn`: the raw sequence with its loss zeroed if any turn has neither a complete call nor
  a final answer (SimpleTIR's filter).
- `saar_correct`: `saar` on a row whose reward is positive, `raw` on every other row (see
  `sequence_rule`).
- `mask_failed`: the raw sequence; in a recovered-and-correct row every failed-call turn gets loss
  mask 0 (its error feedback already has it), so the row reinforces its working path without being
  rewritten, and failing rows keep the negative signal on their failed calls.
- `roc`: the raw sequence; GRPO-RoC's down-sampling happens per prompt group (purifier/roc.py).
- `saar_is`: Open-CLEANER's Plan B, decided offline. At each rollback, the retry's importance ratio
  IS = π(retry | context without the failed turn) / π_b(retry | context it was sampled in) is scored
  (`score`, the recompute model); IS ≥ τ replaces the whole failed turn (deep), IS < τ appends: the
  failed turn, its error and the retry all stay, where they were sampled (pipeline.splice.decide_by_ratio, the
  live loop's rule too). Positions are decided in order, each scored in the context the earlier decisions built.

Each emitted token remembers which attempt sampled it: its sampled log-prob is its behaviour log-prob,
and it is also its old log-prob only if the purified sequence before it equals the context it was sampled
under (fingerprint in the raw row); `token_origin` says which (pipeline.trajectory.TokenOrigin).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Callable, Generic, NamedTuple, TypeVar

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from pipeline.similarity import DEFAULT_MEASURE, Measure
from pipeline.splice import TurnPiece, decide, decide_by_ratio, piece_from_attempt, splice
from pipeline.trajectory import Attempt, PurifiedTrajectory, Splice, TokenOrigin, Trajectory, fingerprint
from pipeline.answers import last_boxed
from pipeline.kinds import failed_call, trajectory_kind
from pipeline.modes import IS_MODES, MODES, Mode, Variant

# score(context ids, turn ids) -> log π(each turn id | context and the turn ids before it), under the
# temperature the rollout sampled with (saar_is; purifier/recompute.py provides it)
Scorer = Callable[[list[int], list[int]], list[float]]
_SPLICED_ORIGIN = {"shallow": TokenOrigin.SHALLOW, "deep": TokenOrigin.DEEP}

# Purification rebuilds every sequence from the attempt tree: it never needs the lived sequence,
# which is about half of a raw row's values, so the stage does not read it.
LIVED_COLUMNS = ("lived_ids", "lived_mask", "lived_logprobs")


class PurifyError(ValueError):
    """A raw row that cannot be purified (goes to the dead-letter output with this reason)."""


@dataclass
class _Builder:
    prompt: list[int]
    attempts: dict[tuple[int, int], Attempt]  # (position, attempt_idx) -> attempt
    ids: list[int] = field(default_factory=list)
    mask: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    valid: list[int] = field(default_factory=list)
    behaviour: list[float] = field(default_factory=list)
    origin: list[int] = field(default_factory=list)
    # the last turn's tokens moved by a splice, per attempt they were sampled in (each splice's own moved_tokens)
    moved: dict[int, int] = field(default_factory=dict)

    def feedback(self, ids: list[int]) -> None:
        self.ids += ids
        self.mask += [0] * len(ids)
        self.logprobs += [0.0] * len(ids)
        self.valid += [1] * len(ids)
        self.behaviour += [0.0] * len(ids)
        self.origin += [TokenOrigin.NOT_SAMPLED] * len(ids)

    def turn(self, piece: TurnPiece, position: int, spliced: dict[int, str] | None = None) -> int:
        """Append an assistant turn; returns the response index of its first invalid token (or -1).
        `spliced`: attempt_idx → kind of the splice that moved that attempt's tokens here."""
        first_invalid = -1
        at_piece = 0
        self.moved = {}
        for attempt_idx, j0, j1 in piece.sources:
            n = j1 - j0
            at = len(self.ids)
            ok = self._context_matches(self.attempts[position, attempt_idx], j0)
            sampled = piece.logprobs[at_piece : at_piece + n]
            self.ids += piece.ids[at_piece : at_piece + n]
            self.mask += [1] * n
            self.logprobs += sampled if ok else [0.0] * n
            self.valid += [int(ok)] * n
            self.behaviour += sampled
            kind = (spliced or {}).get(attempt_idx)
            origin = TokenOrigin.IN_PLACE if ok else _SPLICED_ORIGIN[kind] if kind else TokenOrigin.MOVED
            self.origin += [origin] * n
            if origin in (TokenOrigin.SHALLOW, TokenOrigin.DEEP):
                self.moved[attempt_idx] = self.moved.get(attempt_idx, 0) + n
            if not ok and first_invalid < 0:
                first_invalid = at
            at_piece += n
        return first_invalid

    def _context_matches(self, attempt: Attempt, j0: int) -> bool:
        start = len(self.prompt) + len(self.ids) - j0
        if start != attempt.context_len:
            return False
        if j0 and self.ids[len(self.ids) - j0 :] != attempt.turn_ids[:j0]:
            return False
        return fingerprint(self.prompt + self.ids[: len(self.ids) - j0]) == attempt.context_fingerprint


# ---- raw-row validation ---------------------------------------------------------------------------------------
# The structural rules a raw row keeps to be purified, declared once and evaluated two ways: per row by
# `validate_raw` (purify(), whose dead letter names the rule broken) and column-wise over a whole table by
# `all_hold` (purifier/unspliced.py's fast path, which leaves a row breaking any of them to purify()). A rule is
# one expression over the facts below written with `== < >= & |` only, so it evaluates alike on a row's Python
# values and on numpy columns of them; the facts are read beside each other from a row and from a table.


class RowFacts(NamedTuple):
    lived: Any  # len(lived_ids), -1 when not recorded
    lived_mask: Any  # len(lived_mask), -1 when not recorded
    lived_logprobs: Any  # len(lived_logprobs), -1 when not recorded


class PositionFacts(NamedTuple):
    attempts: Any  # how many attempts it holds


class AttemptFacts(NamedTuple):
    turn: Any  # len(turn_ids), -1 when not recorded
    logprobs: Any  # len(logprobs), -1 when not recorded
    call_start: Any  # -2 when not recorded
    context: Any  # context_len and context_fingerprint both recorded
    no_call: Any  # call_status is "no_call"
    result: Any  # a tool result recorded
    truncated: Any  # its position was cut by a limit


F = TypeVar("F", RowFacts, PositionFacts, AttemptFacts)


@dataclass(frozen=True)
class Rule(Generic[F]):
    holds: Callable[[F], Any]  # True where the facts are sound (a bool, or a numpy bool array over columns)
    problem: Callable[[F], str]  # what a dead letter says of one row that breaks it


ROW_RULES: tuple[Rule[RowFacts], ...] = (
    Rule(
        lambda f: (f.lived < 0) | ((f.lived_mask == f.lived) & (f.lived_logprobs == f.lived)),
        lambda f: "lived_mask/lived_logprobs length differs from lived_ids",
    ),
)
POSITION_RULES: tuple[Rule[PositionFacts], ...] = (Rule(lambda f: f.attempts >= 1, lambda f: "no attempts"),)
ATTEMPT_RULES: tuple[Rule[AttemptFacts], ...] = (
    Rule(lambda f: f.turn >= 0, lambda f: "no turn_ids"),
    Rule(lambda f: f.logprobs == f.turn, lambda f: f"logprobs length {f.logprobs} != turn_ids length {f.turn}"),
    Rule(
        lambda f: (f.call_start == -1) | ((f.call_start >= 0) & (f.call_start < f.turn)),
        lambda f: f"call_start {f.call_start} out of range 0..{f.turn - 1}",
    ),
    Rule(lambda f: f.context, lambda f: "missing context_len/context_fingerprint"),
    Rule(lambda f: f.no_call | f.result | f.truncated, lambda f: "a call without a tool result"),
)


def _length(values: list | None) -> int:
    return -1 if values is None else len(values)


def _lengths(lists: pa.Array) -> np.ndarray:
    return pc.list_value_length(lists).fill_null(-1).to_numpy()


def _flags(values: pa.Array) -> np.ndarray:
    return values.to_numpy(zero_copy_only=False).astype(bool)


def row_facts(raw: Trajectory) -> RowFacts:
    return RowFacts(_length(raw.lived_ids), _length(raw.lived_mask), _length(raw.lived_logprobs))


def row_facts_columns(table: pa.Table) -> RowFacts:
    return RowFacts(*(_lengths(table[name].combine_chunks()) for name in ("lived_ids", "lived_mask", "lived_logprobs")))


def attempt_facts(a: Attempt, outcome: str) -> AttemptFacts:
    return AttemptFacts(
        turn=_length(a.turn_ids),
        logprobs=_length(a.logprobs),
        call_start=-2 if a.call_start is None else a.call_start,
        context=a.context_len is not None and a.context_fingerprint is not None,
        no_call=a.call_status == "no_call",
        result=a.result is not None,
        truncated=outcome == "truncated",
    )


def attempt_facts_columns(attempts: pa.StructArray, outcome: np.ndarray) -> AttemptFacts:
    """The facts of a column of attempts; `outcome`: each one's position outcome."""
    return AttemptFacts(
        turn=_lengths(attempts.field("turn_ids")),
        logprobs=_lengths(attempts.field("logprobs")),
        call_start=attempts.field("call_start").fill_null(-2).to_numpy(zero_copy_only=False),
        context=_flags(attempts.field("context_len").is_valid())
        & _flags(attempts.field("context_fingerprint").is_valid()),
        no_call=_flags(pc.equal(attempts.field("call_status"), "no_call").fill_null(False)),
        result=_flags(attempts.field("result").is_valid()),
        truncated=outcome == "truncated",
    )


def all_hold(rules: tuple[Rule[F], ...], facts: F) -> np.ndarray:
    """Column-wise: True where every rule holds."""
    return np.logical_and.reduce([np.asarray(rule.holds(facts), dtype=bool) for rule in rules])


def _check(rules: tuple[Rule[F], ...], facts: F, where: str = "") -> None:
    for rule in rules:
        if not rule.holds(facts):
            raise PurifyError(where + rule.problem(facts))


def validate_raw(raw: Trajectory) -> None:
    """Structural checks on a raw row (ROW_RULES, POSITION_RULES, ATTEMPT_RULES); raises PurifyError naming the
    field."""
    _check(ROW_RULES, row_facts(raw))
    for p in raw.positions:
        _check(POSITION_RULES, PositionFacts(len(p.attempts)), f"position {p.position_idx}: ")
        for a in p.attempts:
            _check(ATTEMPT_RULES, attempt_facts(a, p.outcome), f"position {p.position_idx} attempt {a.attempt_idx}: ")


def _is_void(a: Attempt, decode: Callable[[list[int]], str]) -> bool:
    if a.call_status in ("unclosed", "bad_json"):
        return True
    return a.call_status == "no_call" and last_boxed(decode(a.turn_ids), window=10**9) is None


def sequence_rule(raw: Trajectory, mode: str) -> str:
    """How a mode rebuilds one row: "saar" (splice retries over failed turns; saar_is decides each by its
    importance ratio) or "raw" (every attempt as sampled; void_turn and mask_failed then change its loss
    mask, roc selects whole rows per group).

    `saar_correct` splices only rows whose reward is positive, i.e. correct: correctness is a property
    of the row alone, so a row's purification does not move when the other rows of its group change
    (an "above the group mean" rule would, and in a group whose rows are all wrong it would still
    purify the least wrong ones), and it is the paper's motivation: purify the trajectories whose
    outcome the update reinforces, so a recovered-and-correct row stops rewarding its failed call,
    while a failing row keeps its failed call under the negative advantage it earned.

    No mode changes a reward, and GRPO advantages depend only on a group's rewards, so advantages
    computed before or after purification are the same numbers; the group stage computes them after,
    on the rows each mode keeps (only `roc` keeps fewer)."""
    return "saar" if mode in ("saar", "saar_is") or (mode == "saar_correct" and raw.reward > 0) else "raw"


def purify(
    raw: Trajectory,
    gamma: float,
    mode: Mode,
    decode: Callable[[list[int]], str],
    measure: Measure = DEFAULT_MEASURE,
    score: Scorer | None = None,
    *,
    tau: float | None = None,
) -> PurifiedTrajectory:
    """One raw row purified under `mode`. `gamma`: SAAR's similarity threshold γ of the splicing modes (the others
    do not read it); `tau`: the importance-ratio threshold τ that `saar_is` decides by, with `score`."""
    if mode not in MODES:
        raise PurifyError(f"unknown mode {mode!r}; expected one of {MODES}")
    if mode in IS_MODES and (score is None or tau is None):
        raise ValueError(
            f"mode {mode} scores each rollback against τ: pass score= (a recompute backend's score) and tau="
        )
    variant = Variant.of(mode, tau if mode in IS_MODES else gamma, measure)
    validate_raw(raw)
    attempts = {(p.position_idx, a.attempt_idx): a for p in raw.positions for a in p.attempts}
    if raw.final_turn is not None:
        attempts[len(raw.positions), 0] = raw.final_turn
    b = _Builder(list(raw.prompt_ids), attempts)
    splices: list[Splice] = []
    saar_on = sequence_rule(raw, mode) == "saar" and raw.saar_gate
    masking = mode == "mask_failed" and raw.reward > 0 and trajectory_kind(raw) == "recovered"
    void = False

    def whole(a: Attempt) -> TurnPiece:
        return piece_from_attempt(a.attempt_idx, a.turn_ids, a.logprobs, a.call_start)

    for p in raw.positions:
        if mode == "void_turn":
            void |= any(_is_void(a, decode) for a in p.attempts)
        retries = p.attempts[1:]
        # A position cut by a limit while a retry was due was restored to the state before that
        # retry: its last attempt's error feedback is not in the sequence, in any mode.
        last_feedback = [] if p.outcome == "truncated" else p.attempts[-1].feedback_ids
        # Retries follow model errors only; an infrastructure failure is never purified (a position
        # whose *retry* hit an infra error is spliced as lived, and keeps that error's feedback).
        infra_first = p.attempts[0].result is not None and p.attempts[0].result.error_class == "infra"
        if not saar_on or not retries or infra_first:
            for i, a in enumerate(p.attempts):  # kept exactly as sampled, every error included
                start = len(b.ids)
                b.turn(whole(a), p.position_idx)
                if masking and failed_call(a):  # kept in the sequence, out of the loss
                    b.mask[start:] = [0] * (len(b.ids) - start)
                b.feedback(a.feedback_ids if i < len(p.attempts) - 1 else last_feedback)
            continue
        current = whole(p.attempts[0])
        previous = p.attempts[0]
        gave_up = None
        spliced: dict[int, str] = {}
        for r in retries:
            if not r.has_call:
                gave_up = r
                break
            if mode in IS_MODES:  # Plan B: the ratio decides replace (deep) or append
                by_ratio = decide_by_ratio(score(b.prompt + b.ids, r.turn_ids), r.logprobs, tau)
                if by_ratio.kind == "append":  # the failed turn and its error stay
                    b.turn(current, p.position_idx, spliced)
                    b.feedback(previous.feedback_ids)
                else:
                    removed = len(current.ids) + len(previous.feedback_ids)
                    for s in splices:  # a retry that replaced before and is replaced now: none of its tokens stay
                        if s.position_idx == p.position_idx and s.attempt_idx == previous.attempt_idx:
                            s.moved_tokens = 0
                    splices.append(
                        Splice(
                            position_idx=p.position_idx,
                            attempt_idx=r.attempt_idx,
                            kind="deep",
                            similarity=math.nan,
                            tokens_removed=removed,
                            first_recomputed=-1,
                            moved_tokens=len(r.turn_ids),
                            log_is_ratio=by_ratio.log_ratio,
                        )
                    )
                    spliced[r.attempt_idx] = "deep"
                current, previous = whole(r), r
                continue
            decision = decide(current, whole(r), gamma, decode, measure)
            new = splice(current, whole(r), decision)
            removed = len(current.ids) + len(previous.feedback_ids) + len(r.turn_ids) - len(new.ids)
            splices.append(
                Splice(
                    position_idx=p.position_idx,
                    attempt_idx=r.attempt_idx,
                    kind=decision.kind,
                    similarity=decision.similarity,
                    tokens_removed=removed,
                    first_recomputed=-1,
                    split_failed=decision.split_failed,
                )
            )
            spliced[r.attempt_idx] = decision.kind
            current, previous = new, r
        start = len(b.ids)
        first_invalid = b.turn(current, p.position_idx, spliced)
        for s in splices:
            if s.position_idx == p.position_idx:
                s.first_recomputed = first_invalid if first_invalid >= 0 else start
                if mode not in IS_MODES:  # a saar_is splice moves its whole retry, scored when decided
                    # its own retry's tokens that stayed: none when a later retry's call replaced them
                    s.moved_tokens = b.moved.get(s.attempt_idx, 0)
        b.feedback(last_feedback if previous is p.attempts[-1] else previous.feedback_ids)
        if gave_up is not None:  # no purification beyond what was spliced before the give-up
            b.turn(whole(gave_up), p.position_idx)
            saar_on = False
        elif p.outcome == "exhausted":
            saar_on = False
    if raw.final_turn is not None:
        void |= mode == "void_turn" and _is_void(raw.final_turn, decode)
        b.turn(whole(raw.final_turn), len(raw.positions))
    loss_mask = [0] * len(b.mask) if (mode == "void_turn" and void) else b.mask
    invalid = [i for i, (m, v) in enumerate(zip(loss_mask, b.valid)) if m == 1 and v == 0]
    return PurifiedTrajectory(
        run_id=raw.run_id,
        iteration=raw.iteration,
        prompt_id=raw.prompt_id,
        sample_idx=raw.sample_idx,
        mode=mode,
        gamma=variant.gamma,
        raw_key=raw.key,
        prompt_ids=list(raw.prompt_ids),
        response_ids=b.ids,
        loss_mask=loss_mask,
        old_logprobs=b.logprobs,
        logprob_valid=b.valid,
        reward=raw.reward,
        advantage=math.nan,
        splices=splices,
        recompute_from=invalid[0] if invalid else -1,
        tokens_forwarded=0,
        gate=raw.saar_gate,
        behaviour_logprobs=b.behaviour,
        token_origin=b.origin,
        is_threshold=variant.tau,
    )


def moved_range(t: PurifiedTrajectory, s: Splice) -> range:
    """Response indices of a splicing mode's (saar, saar_correct) splice's moved retry tokens. A position's spliced
    tokens are contiguous (the tail of its final turn) and in attempt order (a fused turn keeps the earlier attempt's
    part before the retry's): from `first_recomputed` on, after the moved tokens of the position's earlier splices.
    Not for saar_is, whose replaced and appended turns interleave: its splices are scored when decided."""
    spliced = (TokenOrigin.SHALLOW, TokenOrigin.DEEP)
    at = next(
        (i for i in range(max(s.first_recomputed, 0), len(t.token_origin)) if t.token_origin[i] in spliced),
        len(t.token_origin),
    )
    at += sum(o.moved_tokens for o in t.splices if o.position_idx == s.position_idx and o.attempt_idx < s.attempt_idx)
    return range(at, at + s.moved_tokens)


def with_splice_ratios(t: PurifiedTrajectory) -> PurifiedTrajectory:
    """Each splice's log importance ratio from the row's recomputed old log-probs (the target policy in the
    purified context) and its behaviour log-probs; splices already scored (saar_is) keep theirs, and a splice none
    of whose retry's tokens stayed (a later call replaced them) has none (null)."""
    for s in t.splices:
        if s.log_is_ratio is not None and math.isnan(s.log_is_ratio):
            idx = moved_range(t, s)
            s.log_is_ratio = float(sum(t.old_logprobs[i] - t.behaviour_logprobs[i] for i in idx)) if idx else None
    return t
