"""The multi-turn agent loop on token ids, with SAAR's online retries (docs/saar.md).

Every trajectory is its own coroutine (rollout_gen/scheduler.py): it asks for its next turn, has a
retry scored and runs its tool calls when it needs them, against a continuously batching engine that
keeps its KV cache between turns. The rules (`_check_limits`, `_on_turn`, `_importance_rollback`,
`_on_result`) are plain functions of one trajectory's state, applied in that order with per-turn seeds.
The running sequence is kept as token ids: sampled tokens are appended as sampled (mask 1), tool
turns are tokenized alone and appended (mask 0); nothing is ever re-rendered and re-tokenized.
Every attempt is recorded with the fingerprint of the context it was sampled under, so the
purifier can rebuild any variant offline.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from typing import Callable, Hashable

from pipeline.chat import RETRY_NOTE, ChatFormat, format_tool_response
from pipeline.similarity import Measure
from pipeline.config import RolloutConfig
from pipeline.splice import TurnPiece, decide, decide_by_ratio, piece_from_attempt, splice
from pipeline.trajectory import Attempt, Position, ToolResult, Trajectory, TrajectoryStats, fingerprint
from pipeline.engines.base import Engine, Generation, Request, SamplingParams, ScoreRequest
from rollout_gen.rewards import overlong_penalty, reward_outcome
from pipeline.answers import last_boxed
from rollout_gen.scheduler import Progress, Scheduler
from rollout_gen.tasks import Task


def unit_hash(*parts: object) -> float:
    """A reproducible number in [0, 1) from ids: the SAAR gate coin and sampling seeds."""
    digest = hashlib.blake2b("/".join(map(str, parts)).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big") / 2**64


# What a raw shard's manifest records as its rows' seeding. Shards without it were sampled with one seed for a
# position's retries and the turn after them (docs/saar.md, "Seeds").
SEEDING = "per-attempt"


def generation_seed(run_seed: int, lv: "_Live") -> int:
    """The seed of the generation `lv` asks for next: a pure function of (run seed, prompt, sample, turn, attempt).

    A retry does not advance `lv.turns` (it replaces the turn), so the attempt index is what tells a position's
    retries apart from each other and from the next ordinary turn; without it they all drew the same noise and a
    failed retry tended to be sampled again (docs/saar.md, "Seeds")."""
    attempt = len(lv.open_pos.attempts) if lv.retry_pending and lv.open_pos is not None else 0
    return int(unit_hash("sample", run_seed, lv.task.prompt_id, lv.sample_idx, lv.turns, attempt) * 2**62)


def model_text(chat: ChatFormat, ids: list[int], mask: list[int]) -> str:
    """What the policy wrote in a lived sequence: its sampled tokens (mask 1), tool responses left out, special tokens
    skipped (as verl's reward managers decode a response: the `<|im_end|>` that ends a turn would take 10 of the
    answer window's 100 characters). Rewards and answers are read from it, so a program's output (a printed
    `\\boxed{…}` or code block) never decides them."""
    return chat.decode([i for i, m in zip(ids, mask) if m], skip_special=True)


# Draws(run seed, samples) -> one (sample index, seed) per sample of a task: what its SAAR gate coin and its
# generation seeds hash. A training group draws samples 0..k-1 of the run's seed; an evaluation with k samples
# draws sample 0 of k runs at seeds s, s+1, … (so avg@k is the mean of k one-sample evaluations).
Draws = Callable[[int, int], list[tuple[int, int]]]


def group_draws(run_seed: int, samples: int) -> list[tuple[int, int]]:
    return [(s, run_seed) for s in range(samples)]


def one_sample_runs(run_seed: int, samples: int) -> list[tuple[int, int]]:
    return [(0, run_seed + s) for s in range(samples)]


@dataclass
class RolloutIdentity:
    run_id: str
    iteration: int
    policy_version: str
    seed: int = 0


@dataclass
class _Live:
    """Mutable state of one trajectory while it is being rolled out."""

    task: Task
    sample_idx: int
    seed: int
    gate: bool
    prompt: list[int]
    ids: list[int] = field(default_factory=list)
    mask: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    positions: list[Position] = field(default_factory=list)
    final_turn: Attempt | None = None
    saar_on: bool = True
    # A retry replaces a turn, it does not add one (reference: the rollback checkpoint restores
    # assistant_turns and user_turns): `turns` counts kept assistant turns, `tool_turns` closed
    # positions; `executions` counts every tool run, retries included, for the safety cap.
    turns: int = 0
    tool_turns: int = 0
    executions: int = 0
    open_pos: Position | None = None
    open_start: int = 0  # where the open position's (current, maybe spliced) turn starts in `ids`
    current: TurnPiece | None = None
    retry_pending: bool = False
    unscored: tuple[Attempt, TurnPiece] | None = None  # a retry whose importance ratio decides where it goes
    done: bool = False
    finish_reason: str = ""
    engine_key: Hashable | None = None  # names this trajectory's cached KV in the engine (async loop)
    stats: TrajectoryStats = field(default_factory=TrajectoryStats)

    def append(self, ids: list[int] | tuple[int, ...], trained: bool, logprobs=None) -> None:
        self.ids.extend(ids)
        self.mask.extend([int(trained)] * len(ids))
        self.logprobs.extend(logprobs if logprobs is not None else [0.0] * len(ids))

    def finish(self, reason: str) -> None:
        self.done, self.finish_reason = True, reason
        self.open_pos, self.current, self.retry_pending, self.unscored = None, None, False, None


class AgentLoop:
    def __init__(self, engine: Engine, sandbox, chat: ChatFormat, cfg: RolloutConfig) -> None:
        self.engine, self.sandbox, self.chat, self.cfg = engine, sandbox, chat, cfg
        self.saar = cfg.saar
        self.measure = Measure(cfg.saar.similarity, cfg.saar.similarity_on)

    # ---- one round ------------------------------------------------------------------------
    def _check_limits(self, lv: _Live) -> None:
        if lv.retry_pending and lv.open_pos is not None:
            # The retry would be turn `turns + 1`; the reference generates it, finds the turn limit
            # reached, and restores the state before the retry (the failed turn, without its error
            # feedback). The length check is skipped while regenerating: the retry replaces the turn.
            if lv.turns + 1 >= self.cfg.max_turns:
                lv.open_pos.outcome = "truncated"
                cut = len(lv.ids) - len(lv.open_pos.attempts[-1].feedback_ids)  # the feedback came last
                del lv.ids[cut:], lv.mask[cut:], lv.logprobs[cut:]
                lv.finish("max_turns")
            return
        if lv.turns >= self.cfg.max_turns:
            lv.finish("max_turns")
        elif len(lv.ids) >= self.cfg.max_response_tokens:
            lv.finish("length")

    def _budget(self, lv: _Live) -> int:
        """Tokens the next turn may take. A retry replaces the open turn: it may use that turn's room,
        less the reasoning prefix a shallow splice would keep (so the lived sequence stays in budget); a
        retry that an importance-ratio rollback may append after it has only the room left."""
        replaces = self.saar.live_mode == "purified" and self.saar.rollback != "importance"
        if lv.retry_pending and lv.open_pos is not None and replaces:
            return self.cfg.max_response_tokens - lv.open_start - max(lv.current.call_start, 0)
        return self.cfg.max_response_tokens - len(lv.ids)

    def _on_turn(self, lv: _Live, gen: Generation) -> Attempt | None:
        """Record a sampled turn; return the attempt whose call must run, if any."""
        retry = lv.retry_pending and lv.open_pos is not None
        lv.turns += 0 if retry else 1
        context = lv.prompt + lv.ids
        call_start, parsed = self.chat.parse_turn(gen.output_ids, self.cfg.malformed_call)
        att = Attempt(
            attempt_idx=len(lv.open_pos.attempts) if retry else 0,
            turn_ids=list(gen.output_ids),
            logprobs=list(gen.logprobs),
            call_start=call_start,
            call_status=parsed.status,
            context_len=len(context),
            context_fingerprint=fingerprint(context),
            code=parsed.code,
            finish_reason=gen.finish_reason,
        )
        lv.stats.generated_tokens += len(att.turn_ids)
        if retry:
            pos = lv.open_pos
            pos.attempts.append(att)
            lv.stats.retries += 1
            lv.retry_pending = False
            if not att.has_call:  # the model answered or gave up: nothing is purified here
                pos.outcome = "gave_up"
                lv.stats.gave_up += 1
                lv.saar_on = False
                lv.append(att.turn_ids, True, att.logprobs)
                lv.finish(gen.finish_reason)
                return None
            piece = piece_from_attempt(att.attempt_idx, att.turn_ids, att.logprobs, call_start)
            if self.saar.live_mode == "purified" and self.saar.rollback == "importance":
                lv.unscored = (att, piece)  # scored (`score_request`) before its call runs
            elif self.saar.live_mode == "purified":
                decision = decide(lv.current, piece, self.saar.gamma_live, self.chat.decode, self.measure)
                lv.current = splice(lv.current, piece, decision)
                del lv.ids[lv.open_start :], lv.mask[lv.open_start :], lv.logprobs[lv.open_start :]
                lv.append(lv.current.ids, True, list(lv.current.logprobs))
                if decision.kind == "shallow":
                    lv.stats.live_shallow += 1
                else:
                    lv.stats.live_deep += 1
            else:
                lv.append(att.turn_ids, True, att.logprobs)
            return att
        if not att.has_call:
            lv.final_turn = att
            lv.append(att.turn_ids, True, att.logprobs)
            lv.finish(gen.finish_reason)
            return None
        pos = Position(position_idx=len(lv.positions), attempts=[att], outcome="success")
        lv.positions.append(pos)
        lv.open_pos, lv.open_start = pos, len(lv.ids)
        lv.current = piece_from_attempt(0, att.turn_ids, att.logprobs, call_start)
        lv.append(att.turn_ids, True, att.logprobs)
        # reference: a turn that reaches a limit ends the trajectory before its call runs
        limit = (
            "max_turns"
            if lv.turns >= self.cfg.max_turns
            else "max_tool_turns"
            if lv.tool_turns >= self.cfg.max_tool_turns
            else None
        )
        if limit:
            pos.outcome = "truncated"
            lv.finish(limit)
            return None
        return att

    def score_request(self, lv: _Live) -> ScoreRequest:
        """The unscored retry in the context without the open (failed) turn, to score with the engine's own weights."""
        att, _ = lv.unscored
        return ScoreRequest(
            lv.engine_key, tuple(lv.prompt + lv.ids[: lv.open_start]), tuple(att.turn_ids), self.cfg.temperature
        )

    def _importance_rollback(self, lv: _Live, scores: list[float]) -> None:
        """Plan B, live, given the retry's log-probs in the clean context (`score_request`): IS ≥ τ replaces the
        failed turn and its error, else the retry follows them where it was sampled: pipeline.splice's
        `decide_by_ratio`, which purify mode saar_is applies again to the stored tree (same scoring function)."""
        (att, piece), lv.unscored = lv.unscored, None
        if decide_by_ratio(scores, att.logprobs, self.saar.is_threshold).kind == "replace":  # the failed turn leaves
            del lv.ids[lv.open_start :], lv.mask[lv.open_start :], lv.logprobs[lv.open_start :]
            lv.stats.live_deep += 1
        else:  # append: the retry is a turn of its own after the failed one
            lv.open_start = len(lv.ids)
            lv.turns += 1
        lv.current = piece
        lv.append(att.turn_ids, True, att.logprobs)

    def _on_result(self, lv: _Live, att: Attempt, result: ToolResult) -> None:
        att.result = result
        pos = lv.open_pos
        first = len(pos.attempts) == 1
        retries = len(pos.attempts) - 1
        lv.executions += 1
        if lv.executions > self.saar.safety_cap:  # reference: total_rollbacks > 30 before the call is handled
            lv.saar_on = False
        text = result.text
        if result.failed:
            lv.stats.first_attempt_failures += int(first)
            if result.error_class == "infra":
                lv.stats.infra_failures += 1
            else:
                lv.stats.model_failures += 1
        close = True
        if not result.failed:
            pos.outcome = "success" if first else "recovered"
            lv.stats.recovered += int(not first)
        elif result.error_class == "infra":
            pos.outcome = "infra"  # never retried as if the model erred, never purified
        elif lv.gate and lv.saar_on and retries < self.saar.max_retries:
            lv.retry_pending, close = True, False
        elif (lv.gate and lv.saar_on) or retries > 0:
            # K retries used up, or SAAR turned off (safety cap) while retrying: the reference's
            # _handle_max_retry_exceeded, which notes the count of retries once there were two or more.
            if retries >= 2:
                text = f"{text}\n\n{RETRY_NOTE.format(n=retries)}"
            pos.outcome = "exhausted"
            lv.stats.exhausted += 1
            lv.saar_on = False
        else:
            pos.outcome = "not_retried"
        att.feedback_ids = self.chat.feedback_ids(text)
        # An error a retry replaces (live purified, rollback by similarity) is only the retry's context, as in the
        # reference's rollback: it is not length-checked. Any other tool response stays in the lived sequence, and
        # one that would reach the budget is not shown: the trajectory ends there (the reference's check before it
        # appends a tool response), so the lived sequence never passes max_response_tokens. Its result stays on
        # the attempt (att.result.text); a retry that was due becomes a position cut by a limit.
        replaced = not close and self.saar.live_mode == "purified" and self.saar.rollback != "importance"
        if not replaced and len(lv.ids) + len(att.feedback_ids) >= self.cfg.max_response_tokens:
            att.feedback_ids = []
            if not close:
                pos.outcome = "truncated"
            lv.finish("length")
            return
        lv.append(att.feedback_ids, False)
        if close:
            lv.tool_turns += 1
            lv.open_pos, lv.current = None, None

    def _agent_failure(self, att: Attempt) -> ToolResult:
        """A call that could not even be made (malformed, unknown tool): the model's failure."""
        _, parsed = self.chat.parse_turn(att.turn_ids, self.cfg.malformed_call)
        text = format_tool_response(
            False, reason=parsed.problem or att.call_status, limit=self.cfg.sandbox.response_chars
        )
        return ToolResult(status="failure", text=text, error_label="unknown_error", error_class="model")

    def _run_one(self, code: str) -> ToolResult:
        return self.sandbox.run_many([code])[0]

    def _turn(self, lv: _Live, gen: Generation) -> Attempt | None:
        """`_on_turn` on a generation cut to the turn's budget; a bad turn ends only its own trajectory."""
        budget = self._budget(lv)
        if len(gen.output_ids) > budget:
            gen = Generation(gen.output_ids[:budget], gen.logprobs[:budget], "length")
        try:
            return self._on_turn(lv, gen)
        except Exception as e:  # recorded on the trajectory, never the batch's end
            lv.finish(f"agent_error: {type(e).__name__}: {e}"[:300])
            return None

    @staticmethod
    def _seed(lv: _Live, identity: RolloutIdentity) -> int:
        return generation_seed(lv.seed, lv)

    # ---- the whole batch --------------------------------------------------------------------
    def run(
        self,
        tasks: list[Task],
        identity: RolloutIdentity,
        progress: Callable[[int, int, str], None] | None = None,
        samples: int | None = None,
        draws: Draws = group_draws,
    ) -> list[Trajectory]:
        """Task-major trajectories, `samples` per task (default rollout.samples_per_prompt): task i's sample s at
        i * samples + s, with sample_idx s, drawn as `draws` says."""
        per_task = samples or self.cfg.samples_per_prompt
        lives: list[_Live] = []
        for task in tasks:
            prompt = self.chat.prompt_ids(task.question)
            for index, seed in draws(identity.seed, per_task):
                coin = unit_hash("gate", identity.run_id, identity.iteration, task.prompt_id, index, seed)
                lv = _Live(task, index, seed, coin < self.saar.gate_p, prompt)
                if len(prompt) > self.cfg.max_prompt_tokens:
                    lv.finish("prompt_too_long")
                lives.append(lv)
        params = SamplingParams(
            self.cfg.max_turn_tokens, self.cfg.temperature, self.cfg.top_p, tuple(sorted(self.chat.stop_ids))
        )
        self._async(lives, params, identity, progress)
        out = [self._trajectory(lv, identity) for lv in lives]
        for i, t in enumerate(out):
            t.sample_idx = i % per_task
        return out

    def _async(
        self,
        lives: list[_Live],
        params: SamplingParams,
        identity: RolloutIdentity,
        progress: Callable[[int, int, str], None] | None,
    ) -> None:
        def report(p: Progress, elapsed: float) -> None:
            # a long turn's tokens count as they are sampled (a served engine returns a turn whole: its rate
            # moves when turns end, and says so)
            sampled = p.generated_tokens + (p.tokens_in_flight or 0)
            rate = f"{sampled / max(elapsed, 1e-9):.0f} tokens/s" + (
                "" if p.tokens_in_flight is not None else " (finished turns)"
            )
            progress(
                p.finished,
                len(lives),
                f"{p.active} active, {rate}, {p.tools_in_flight} tool calls in flight, {p.tools_queued} queued",
            )

        tuning = self.cfg.engine_tuning
        sched = Scheduler(
            self.engine,
            tuning.deterministic,
            tuning.tool_delay_steps,
            tuning.max_in_flight,
            tool_slots=self.cfg.sandbox.workers,
            tool_priority=tuning.tool_priority,
            on_progress=report if progress else None,
        )
        key = object()  # this run's trajectories: (key, i) names trajectory i's KV in the engine

        async def trajectory(i: int, lv: _Live) -> None:
            try:
                while not lv.done:
                    self._check_limits(lv)
                    if lv.done:
                        break
                    lv.engine_key = (key, i)
                    request = Request(
                        (key, i), tuple(lv.prompt + lv.ids), params, self._seed(lv, identity), len(lv.prompt)
                    )
                    att = self._turn(lv, await sched.generate(i, request))
                    # a rollback is decided once its retry's result is back: the call runs while it is scored
                    scoring = sched.ask_score(i, self.score_request(lv)) if lv.unscored is not None else None
                    if att is None:
                        continue
                    result = (
                        await sched.tool(i, self._run_one, att.code)
                        if att.call_status == "ok"
                        else self._agent_failure(att)
                    )
                    if scoring is not None:
                        try:
                            self._importance_rollback(lv, await sched.scored(scoring))
                        except Exception as e:  # as in `_turn`: this trajectory's end, not the batch's
                            lv.finish(f"agent_error: {type(e).__name__}: {e}"[:300])
                            continue
                    self._on_result(lv, att, result)
            finally:
                sched.release((key, i))  # its KV goes when the trajectory does

        sched.run([trajectory(i, lv) for i, lv in enumerate(lives)])

    def _trajectory(self, lv: _Live, identity: RolloutIdentity) -> Trajectory:
        text = model_text(self.chat, lv.ids, lv.mask)
        why = ""
        try:
            outcome = reward_outcome(lv.task, text, self.sandbox, self.cfg.answer_match)
            score, why = (
                outcome.value + overlong_penalty(len(lv.ids), self.cfg.max_response_tokens, self.cfg.overlong_buffer),
                outcome.reason[:300],
            )
        except Exception as e:  # a reward that cannot be computed is this trajectory's failure, not the batch's
            score = -1.0
            lv.finish_reason = f"reward_error: {type(e).__name__}: {e}"[:300]
        lv.stats.turns = lv.turns
        lv.stats.tool_calls = sum(a.has_call for p in lv.positions for a in p.attempts)
        lv.stats.response_tokens = len(lv.ids)
        return Trajectory(
            run_id=identity.run_id,
            iteration=identity.iteration,
            prompt_id=lv.task.prompt_id,
            sample_idx=lv.sample_idx,
            policy_version=identity.policy_version,
            seed=lv.seed,
            task_source=lv.task.source,
            question=lv.task.question,
            ground_truth=lv.task.ground_truth,
            saar_gate=lv.gate,
            gate_p=self.saar.gate_p,
            live_mode=self.saar.live_mode,
            gamma_live=self.saar.gamma_live,
            max_retries=self.saar.max_retries,
            prompt_ids=lv.prompt,
            lived_ids=lv.ids,
            lived_mask=lv.mask,
            lived_logprobs=lv.logprobs,
            positions=lv.positions,
            final_turn=lv.final_turn,
            final_answer=last_boxed(text),
            reward=score,
            finish_reason=lv.finish_reason,
            stats=lv.stats,
            reward_reason=why,
        )
