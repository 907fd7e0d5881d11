"""The domain data model: a raw trajectory with its attempt tree, and its purified variants.

Plain dataclasses with lossless conversion to and from Arrow rows (python dicts shaped like the
storage/ schemas). Log-probs are kept as float32-representable floats so a row survives Parquet.

Vocabulary (one name per concept, everywhere):
- attempt: one sampled assistant turn at a position (0 = original, 1..K = retries)
- position: an assistant turn that made a tool call; retries at it share one counter
- splice: replacing a failed turn's call (shallow) or whole turn (deep) by a retry's
- lived sequence: the token ids exactly as the model saw them when the rollout ended
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass, field, fields
from functools import cache
from typing import Any, Literal

import numpy as np

from storage.schemas import row_key  # noqa: F401 - a raw row's key (`Trajectory.key`), defined with its columns


ErrorClass = Literal["model", "infra"]
CallStatus = Literal["ok", "no_call", "bad_json", "unknown_tool", "unclosed"]
PositionOutcome = Literal[
    "success",  # attempt 0 succeeded
    "recovered",  # a retry succeeded
    "exhausted",  # K retries failed; last spliced attempt + error + note stay
    "gave_up",  # a retry had no tool call: no purification here, SAAR off afterwards
    "not_retried",  # failed but SAAR was off (gate, cap, earlier give-up) or no retries left to try
    "infra",  # the executor could not run the code; never purified
    "truncated",  # a limit was hit before the retry could be sampled
]


def fingerprint(ids: list[int] | np.ndarray) -> str:
    """Identity of a context: the attempt's sampled log-probs are valid only after exactly it."""
    arr = np.asarray(ids, dtype=np.int32)
    return hashlib.blake2b(arr.tobytes(), digest_size=12).hexdigest()


@dataclass
class ToolResult:
    status: Literal["success", "failure"]
    text: str  # the tool-response text the model is shown (already formatted and truncated)
    error_label: str | None = None  # docs/saar.md label, None on success
    error_class: ErrorClass | None = None
    exit_code: int | None = None
    duration_s: float = 0.0
    timed_out: bool = False

    @property
    def failed(self) -> bool:
        return self.status == "failure"


@dataclass
class Attempt:
    attempt_idx: int
    turn_ids: list[int]  # the whole assistant turn as sampled, stop token included
    logprobs: list[float]  # sampled log-probs, one per turn id
    call_start: int  # index in turn_ids where the call segment starts; -1 when not found
    call_status: CallStatus
    context_len: int  # length of the context the turn was sampled after
    context_fingerprint: str  # fingerprint() of that context
    code: str | None = None
    result: ToolResult | None = None  # None when no call was executed
    feedback_ids: list[int] = field(default_factory=list)  # the tool-response turn after it (mask 0)
    finish_reason: str = "stop"

    @property
    def has_call(self) -> bool:
        return self.call_status != "no_call"

    @property
    def failed(self) -> bool:
        return self.result is not None and self.result.failed


@dataclass
class Position:
    position_idx: int
    attempts: list[Attempt]
    outcome: PositionOutcome


@dataclass
class TrajectoryStats:
    turns: int = 0
    tool_calls: int = 0
    first_attempt_failures: int = 0  # positions whose attempt 0 failed (the tool-error rate)
    model_failures: int = 0
    infra_failures: int = 0
    retries: int = 0
    recovered: int = 0
    exhausted: int = 0
    gave_up: int = 0
    live_shallow: int = 0
    live_deep: int = 0
    response_tokens: int = 0
    generated_tokens: int = 0  # every sampled token, including attempts no longer in the lived sequence


@dataclass
class Trajectory:
    """One sampled trajectory (a raw shard row): identity, task, SAAR settings, tokens, outcome."""

    run_id: str
    iteration: int
    prompt_id: str
    sample_idx: int
    policy_version: str
    seed: int
    task_source: str
    question: str
    ground_truth: str
    saar_gate: bool  # the coin: was SAAR active for this trajectory
    gate_p: float
    live_mode: str
    gamma_live: float
    max_retries: int
    prompt_ids: list[int]
    lived_ids: list[int] | None  # prompt excluded: the response as the model lived it (None: not read)
    lived_mask: list[int] | None
    lived_logprobs: list[float] | None
    positions: list[Position]
    final_turn: Attempt | None  # the last assistant turn when it made no call
    final_answer: str | None
    reward: float
    finish_reason: str
    stats: TrajectoryStats = field(default_factory=TrajectoryStats)
    reward_reason: str = ""  # why the scorer did not give full marks, when it says (code tasks)

    @property
    def key(self) -> str:
        return row_key(self.run_id, self.iteration, self.prompt_id, self.sample_idx)


@dataclass
class Splice:
    position_idx: int
    attempt_idx: int  # the retry spliced in
    kind: Literal["shallow", "deep"]
    similarity: float
    tokens_removed: int  # failed turns + error feedback dropped by this splice
    first_recomputed: int  # index in the purified response of the first token needing recompute
    split_failed: bool = False
    # The splice's own retry tokens that stayed in the row (purifier.saar.moved_range: sampled after the failed
    # call, trained without it; 0 when a later retry's call replaced them) and log π(them | purified context) −
    # log π_b(them | sampled context), summed: the log importance ratio of Open-CLEANER's Plan B (NaN until
    # recomputed).
    moved_tokens: int = 0
    log_is_ratio: float | None = math.nan  # None: none of its retry's tokens stayed, so there is no ratio


class TokenOrigin:
    """Where a purified response token was sampled (the purified row's `token_origin`, one per token)."""

    NOT_SAMPLED = 0  # a tool response or other template text: never sampled, never trained
    IN_PLACE = 1  # sampled after exactly the context it has in this row: its behaviour log-prob is its old one
    SHALLOW = 2  # a retry's call moved over a failed call's (shallow splice): sampled after the error
    DEEP = 3  # a retry turn moved over a failed turn (deep splice, or saar_is's replace)
    MOVED = 4  # sampled in another context and not spliced itself: a later turn of a row purified otherwise than lived
    NAMES = {0: "not_sampled", 1: "in_place", 2: "shallow", 3: "deep", 4: "moved"}


@dataclass
class PurifiedTrajectory:
    """A purified shard row: all training needs, plus where it came from."""

    run_id: str
    iteration: int
    prompt_id: str
    sample_idx: int
    mode: str
    gamma: float  # SAAR's γ of a splicing mode's row, 0.0 in every other row
    raw_key: str
    prompt_ids: list[int]
    response_ids: list[int]
    loss_mask: list[int]
    old_logprobs: list[float]  # per response token; valid where loss_mask == 1
    logprob_valid: list[int]  # 1 = sampled under exactly this context, 0 = needs/was recomputed
    reward: float
    advantage: float
    splices: list[Splice]
    recompute_from: int  # first response index forwarded by the recompute (-1 = none needed)
    tokens_forwarded: int
    gate: bool
    behaviour_logprobs: list[float] = field(default_factory=list)  # per response token: as sampled (0: not sampled)
    token_origin: list[int] = field(default_factory=list)  # per response token: a TokenOrigin value
    is_threshold: float | None = None  # τ of an importance-ratio mode's row (saar_is), None in every other row


# ---- Arrow row conversion -------------------------------------------------------------------


@cache
def _names(cls: type) -> tuple[str, ...]:
    # dataclasses.fields() is slow per call and these run once per row: cache the names per class.
    return tuple(f.name for f in fields(cls))


def _flat(obj: Any) -> dict[str, Any]:
    # dataclasses.asdict deep-copies every list; rows are written once, so a shallow view suffices.
    return {n: getattr(obj, n) for n in _names(type(obj))}


def attempt_to_row(a: Attempt) -> dict[str, Any]:
    row = _flat(a)
    row["result"] = None if a.result is None else _flat(a.result)
    return row


def attempt_from_row(row: dict[str, Any]) -> Attempt:
    result = row.get("result")
    return Attempt(**{**row, "result": None if result is None else ToolResult(**result)})


def trajectory_to_row(t: Trajectory) -> dict[str, Any]:
    row = _flat(t)
    row["positions"] = [
        {"position_idx": p.position_idx, "outcome": p.outcome, "attempts": [attempt_to_row(a) for a in p.attempts]}
        for p in t.positions
    ]
    row["final_turn"] = None if t.final_turn is None else attempt_to_row(t.final_turn)
    row["stats"] = _flat(t.stats)
    return row


def trajectory_from_row(row: dict[str, Any]) -> Trajectory:
    data = {n: row.get(n) for n in _names(Trajectory)}  # lived_* may be left unread (None)
    data["positions"] = [
        Position(
            position_idx=p["position_idx"],
            attempts=[attempt_from_row(a) for a in p["attempts"]],
            outcome=p["outcome"],
        )
        for p in data["positions"]
    ]
    data["final_turn"] = None if data["final_turn"] is None else attempt_from_row(data["final_turn"])
    data["stats"] = TrajectoryStats(**data["stats"])
    data["reward_reason"] = data["reward_reason"] or ""  # NULL in raw rows of schema v1
    return Trajectory(**data)


def purified_to_row(p: PurifiedTrajectory) -> dict[str, Any]:
    row = _flat(p)
    row["splices"] = [_flat(s) for s in p.splices]
    return row


def purified_from_row(row: dict[str, Any]) -> PurifiedTrajectory:
    data = {n: row[n] for n in _names(PurifiedTrajectory)}
    data["splices"] = [Splice(**s) for s in data["splices"]]
    return PurifiedTrajectory(**data)
