"""SAAR purification as pure functions on raw trajectories (docs/saar.md).

`purify(raw, gamma, mode, decode)` rebuilds one training sequence from the attempt tree in the raw
row, whatever live mode produced it:

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
  failed turn, its error and the retry all stay, where they were sampled. Positions are decided in
  order, each scored in the context the earlier decisions built.

Each emitted token remembers which attempt sampled it: its sampled log-prob is its behaviour log-prob,
and it is also its old log-prob only if the purified sequence before it equals the context it was sampled
under (fingerprint in the raw row); `token_origin` says which (pipeline.trajectory.TokenOrigin).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable

from pipeline.similarity import DEFAULT_MEASURE, Measure
from pipeline.splice import TurnPiece, decide, piece_from_attempt, splice
from pipeline.trajectory import Attempt, PurifiedTrajectory, Splice, TokenOrigin, Trajectory, fingerprint
from pipeline.answers import last_boxed
from pipeline.kinds import failed_call, trajectory_kind
from pipeline.modes import IS_MODES, MODES, partition_gamma

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
        for attempt_idx, j0, j1 in piece.sources:
            n = j1 - j0
            at = len(self.ids)
            ok = self._context_matches(self.attempts[position, attempt_idx], j0)
            sampled = piece.logprobs[at_piece: at_piece + n]
            self.ids += piece.ids[at_piece: at_piece + n]
            self.mask += [1] * n
            self.logprobs += sampled if ok else [0.0] * n
            self.valid += [int(ok)] * n
            self.behaviour += sampled
            kind = (spliced or {}).get(attempt_idx)
            origin = TokenOrigin.IN_PLACE if ok else _SPLICED_ORIGIN[kind] if kind else TokenOrigin.MOVED
            self.origin += [origin] * n
            if not ok and first_invalid < 0:
                first_invalid = at
            at_piece += n
        return first_invalid

    def _context_matches(self, attempt: Attempt, j0: int) -> bool:
        start = len(self.prompt) + len(self.ids) - j0
        if start != attempt.context_len:
            return False
        if j0 and self.ids[len(self.ids) - j0:] != attempt.turn_ids[:j0]:
            return False
        return fingerprint(self.prompt + self.ids[: len(self.ids) - j0]) == attempt.context_fingerprint


def validate_raw(raw: Trajectory) -> None:
    """Structural checks on a raw row; raises PurifyError naming the field."""
    if raw.lived_ids is not None and (len(raw.lived_mask) != len(raw.lived_ids)
                                      or len(raw.lived_logprobs) != len(raw.lived_ids)):
        raise PurifyError("lived_mask/lived_logprobs length differs from lived_ids")
    for p in raw.positions:
        if not p.attempts:
            raise PurifyError(f"position {p.position_idx}: no attempts")
        for a in p.attempts:
            where = f"position {p.position_idx} attempt {a.attempt_idx}"
            if len(a.logprobs) != len(a.turn_ids):
                raise PurifyError(f"{where}: logprobs length {len(a.logprobs)} != turn_ids length {len(a.turn_ids)}")
            if not (a.call_start == -1 or 0 <= a.call_start < len(a.turn_ids)):
                raise PurifyError(f"{where}: call_start {a.call_start} out of range 0..{len(a.turn_ids) - 1}")
            if a.context_len is None or a.context_fingerprint is None:
                raise PurifyError(f"{where}: missing context_len/context_fingerprint")
            if a.has_call and a.result is None and p.outcome != "truncated":
                raise PurifyError(f"{where}: a call without a tool result")


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


def purify(raw: Trajectory, gamma: float, mode: str, decode: Callable[[list[int]], str],
           measure: Measure = DEFAULT_MEASURE, score: Scorer | None = None) -> PurifiedTrajectory:
    """One raw row purified under `mode`; `gamma` is γ for the splicing modes and τ for `saar_is`, which
    also needs `score`."""
    if mode not in MODES:
        raise PurifyError(f"unknown mode {mode!r}; expected one of {MODES}")
    if mode == "saar_is" and score is None:
        raise ValueError("mode saar_is scores each rollback: pass score= (a recompute backend's score)")
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
            if mode == "saar_is":  # Plan B: the ratio decides replace (deep) or append
                log_is = sum(score(b.prompt + b.ids, r.turn_ids)) - sum(r.logprobs)
                if not log_is >= math.log(gamma):  # append: the failed turn and its error stay
                    b.turn(current, p.position_idx, spliced)
                    b.feedback(previous.feedback_ids)
                else:
                    removed = len(current.ids) + len(previous.feedback_ids)
                    for s in splices:  # a retry that replaced before and is replaced now: none of its tokens stay
                        if s.position_idx == p.position_idx and s.attempt_idx == previous.attempt_idx:
                            s.moved_tokens = 0
                    splices.append(Splice(p.position_idx, r.attempt_idx, "deep", math.nan, removed, -1, False,
                                          len(r.turn_ids), log_is))
                    spliced[r.attempt_idx] = "deep"
                current, previous = whole(r), r
                continue
            decision = decide(current, whole(r), gamma, decode, measure)
            new = splice(current, whole(r), decision)
            removed = len(current.ids) + len(previous.feedback_ids) + len(r.turn_ids) - len(new.ids)
            splices.append(Splice(p.position_idx, r.attempt_idx, decision.kind, decision.similarity, removed, -1,
                                  decision.split_failed))
            spliced[r.attempt_idx] = decision.kind
            current, previous = new, r
        start = len(b.ids)
        first_invalid = b.turn(current, p.position_idx, spliced)
        moved = sum(1 for o in b.origin[start:] if o in (TokenOrigin.SHALLOW, TokenOrigin.DEEP))
        for s in splices:
            if s.position_idx == p.position_idx:
                s.first_recomputed = first_invalid if first_invalid >= 0 else start
                if mode != "saar_is":  # a saar_is splice moves its whole retry, scored when decided
                    s.moved_tokens = moved
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
        run_id=raw.run_id, iteration=raw.iteration, prompt_id=raw.prompt_id, sample_idx=raw.sample_idx,
        mode=mode, gamma=partition_gamma(mode, gamma), raw_key=raw.key, prompt_ids=list(raw.prompt_ids), response_ids=b.ids,
        loss_mask=loss_mask, old_logprobs=b.logprobs, logprob_valid=b.valid, reward=raw.reward, advantage=math.nan,
        splices=splices, recompute_from=invalid[0] if invalid else -1, tokens_forwarded=0, gate=raw.saar_gate,
        behaviour_logprobs=b.behaviour, token_origin=b.origin,
        is_threshold=float(gamma) if mode in IS_MODES else None,
    )


def moved_range(t: PurifiedTrajectory, s: Splice) -> range:
    """Response indices of a splice's moved retry tokens: the first `moved_tokens` spliced ones from
    `first_recomputed` on (a position's spliced tokens are contiguous: the tail of its final turn)."""
    spliced = (TokenOrigin.SHALLOW, TokenOrigin.DEEP)
    at = next((i for i in range(max(s.first_recomputed, 0), len(t.token_origin)) if t.token_origin[i] in spliced),
              len(t.token_origin))
    return range(at, at + s.moved_tokens)


def with_splice_ratios(t: PurifiedTrajectory) -> PurifiedTrajectory:
    """Each splice's log importance ratio from the row's recomputed old log-probs (the target policy in the
    purified context) and its behaviour log-probs; splices already scored (saar_is) keep theirs."""
    for s in t.splices:
        if s.moved_tokens and s.log_is_ratio is not None and math.isnan(s.log_is_ratio):
            idx = moved_range(t, s)
            s.log_is_ratio = float(sum(t.old_logprobs[i] - t.behaviour_logprobs[i] for i in idx))
    return t
