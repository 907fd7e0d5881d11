"""The agent loop's SAAR rules and malformed-turn handling, driven by scripted turns (see doubles.py)
through the real sandbox and the real tokenizer of the committed policy."""

from __future__ import annotations

import pytest

from pipeline.chat import RETRY_NOTE
from pipeline.config import RolloutConfig, SaarConfig
from purifier.saar import purify
from rollout_gen.agent import AgentLoop, RolloutIdentity
from rollout_gen.tasks import Task
from tests.doubles import ANSWER, ScriptedEngineDouble, call

TASK = Task("t1", "world", "What is 6 * 7?", "42")


def run(chat, sandbox, turns, **saar) -> "Trajectory":  # noqa: F821
    script = (lambda text, n: turns[n] if n < len(turns) else ANSWER.format(42)) if isinstance(turns, list) else turns
    cfg = RolloutConfig(samples_per_prompt=1, saar=SaarConfig(**saar))
    engine = ScriptedEngineDouble(chat, script)
    return AgentLoop(engine, sandbox, chat, cfg).run([TASK], RolloutIdentity("r", 0, "v"))[0]


def test_recovered_position_is_spliced_live(chat, sandbox):
    t = run(chat, sandbox, [call("prnt(6 * 7)"), call("print(6 * 7)"), ANSWER.format(42)])
    (pos,) = t.positions
    assert pos.outcome == "recovered" and [a.failed for a in pos.attempts] == [True, False]
    assert pos.attempts[0].result.error_label == "NameError"
    assert t.reward == 1.0 and t.final_answer == "42"
    text = chat.decode(t.lived_ids)
    assert "prnt" not in text and "NameError" not in text  # the failed call and its error are gone
    assert t.stats.live_shallow == 1 and t.stats.recovered == 1 and t.stats.first_attempt_failures == 1
    # the lived sequence is what purification rebuilds from the attempt tree at γ_live
    assert purify(t, t.gamma_live, "saar", chat.decode).response_ids == t.lived_ids


def test_raw_live_mode_keeps_errors(chat, sandbox):
    t = run(chat, sandbox, [call("prnt(6 * 7)"), call("print(6 * 7)"), ANSWER.format(42)], live_mode="raw")
    text = chat.decode(t.lived_ids)
    assert "prnt" in text and "NameError" in text
    assert purify(t, 0.5, "raw", chat.decode).response_ids == t.lived_ids


def test_retry_without_call_ends_saar(chat, sandbox):
    t = run(chat, sandbox, [call("prnt(1)"), "I give up. \\boxed{0}", call("print(1)")])
    (pos,) = t.positions
    assert pos.outcome == "gave_up" and not pos.attempts[-1].has_call
    assert t.final_turn is None and t.finish_reason == "stop" and t.stats.gave_up == 1
    text = chat.decode(t.lived_ids)
    assert "prnt(1)" in text and "NameError" in text and "I give up" in text


def test_k_exhausted_keeps_last_attempt_error_and_note(chat, sandbox):
    t = run(
        chat,
        sandbox,
        [call("prnt(1)"), call("prnt(2)"), call("prnt(3)"), call("prnt(4)"), call("print(5)"), ANSWER.format(5)],
        max_retries=3,
    )
    first = t.positions[0]
    assert first.outcome == "exhausted" and len(first.attempts) == 4
    note = "\n\n" + RETRY_NOTE.format(n=3)  # K retries were made (reference: _handle_max_retry_exceeded)
    assert note in chat.decode(first.attempts[-1].feedback_ids)
    # SAAR is off afterwards: the next failure is not retried
    assert t.stats.exhausted == 1
    assert all(len(p.attempts) == 1 for p in t.positions[1:])


def test_turn_limit_during_retry_restores_and_stops(chat, sandbox):
    cfg_turns = [call("prnt(1)"), call("prnt(2)"), call("prnt(3)")]
    cfg = RolloutConfig(samples_per_prompt=1, max_turns=2)
    engine = ScriptedEngineDouble(chat, lambda text, n: cfg_turns[n])
    t = AgentLoop(engine, sandbox, chat, cfg).run([TASK], RolloutIdentity("r", 0, "v"))[0]
    # the retry would be turn 2, the limit: the state before it is restored (failed turn, no error shown)
    assert t.finish_reason == "max_turns" and t.positions[0].outcome == "truncated"
    assert chat.decode(t.lived_ids).endswith("</tool_call><|im_end|>")
    assert purify(t, t.gamma_live, "saar", chat.decode).response_ids == t.lived_ids


def test_gate_off_leaves_errors_as_lived(chat, sandbox):
    t = run(chat, sandbox, [call("prnt(1)"), call("print(42)"), ANSWER.format(42)], gate_p=0.0)
    assert not t.saar_gate
    assert [p.outcome for p in t.positions] == ["not_retried", "success"]
    assert "NameError" in chat.decode(t.lived_ids)


@pytest.mark.parametrize(
    "turn,status",
    [
        ('<tool_call>\n{"name": "code_interpreter", "arguments": [1, 2]}\n</tool_call>', "bad_json"),
        ('<tool_call>\n{"name": "web_search", "arguments": {"query": "x"}}\n</tool_call>', "unknown_tool"),
        ('<tool_call>\n{"name": "code_interpreter", "arguments": {"code": "print(1)"}}', "unclosed"),
    ],
)
def test_malformed_calls_are_agent_failures_and_retried(chat, sandbox, turn, status):
    # unclosed blocks are failed calls only under the legacy option (the default makes them no call)
    saar_cfg = {} if status != "unclosed" else {"malformed_call": "failure"}
    script = [turn, call("print(42)"), ANSWER.format(42)]
    cfg = RolloutConfig(samples_per_prompt=1, **saar_cfg)
    engine = ScriptedEngineDouble(chat, lambda text, n: script[n] if n < len(script) else ANSWER.format(42))
    t = AgentLoop(engine, sandbox, chat, cfg).run([TASK], RolloutIdentity("r", 0, "v"))[0]
    first = t.positions[0].attempts[0]
    assert first.call_status == status and first.failed and first.result.error_class == "model"
    assert t.positions[0].outcome == "recovered" and t.reward == 1.0


def test_empty_completion_is_a_final_answer(chat, sandbox):
    t = run(chat, sandbox, lambda text, n: None)
    assert t.positions == [] and t.final_turn is not None and t.reward == -1.0
    assert t.lived_ids == [chat.im_end_id]


def test_non_utf8_tool_output_is_recorded(chat, sandbox):
    t = run(chat, sandbox, [call("import sys\nsys.stdout.buffer.write(b'\\\\xff\\\\xfe 42')"), ANSWER.format(42)])
    assert t.positions[0].attempts[0].result.status == "success"
    assert "42" in t.positions[0].attempts[0].result.text


def test_safety_cap_turns_saar_off(chat, sandbox):
    t = run(chat, sandbox, lambda text, n: call("prnt(1)") if n < 6 else ANSWER.format(1), safety_cap=2, max_retries=3)
    # executions beyond the cap (the third on) find SAAR off: the retrying position ends exhausted,
    # later failures are not retried (reference: total_rollbacks > cap)
    assert [len(p.attempts) for p in t.positions] == [3, 1, 1, 1]
    assert [p.outcome for p in t.positions] == ["exhausted"] + ["not_retried"] * 3


class _ScoringDouble(ScriptedEngineDouble):
    """TEST DOUBLE: the scripted engine, scoring every retry token at log π = `logp`, so a test chooses which
    side of τ a retry's importance ratio falls on (the real engine's scoring: tests/test_off_policy.py)."""

    def __init__(self, chat, script, logp: float) -> None:
        super().__init__(chat, script)
        self.logp, self.scored = logp, []

    def score_turn(self, context, turn, temperature=1.0, key=None):
        self.scored.append((list(context), list(turn)))
        return [self.logp] * len(turn)


@pytest.mark.parametrize("logp, replaced", [(-0.1, True), (-5.0, False)], ids=["replace", "append"])
def test_importance_rollback_places_the_retry_by_the_engines_score(chat, sandbox, logp, replaced):
    """rollout.saar.rollback=importance on an engine without batched scoring: the scheduler scores the retry with
    the engine's score_turn in the context without the failed turn; IS ≥ τ replaces the failed turn and its
    error, else the retry follows them; purify mode saar_is at τ rebuilds the lived sequence."""
    turns = [call("prnt(6 * 7)"), call("print(6 * 7)"), ANSWER.format(42)]
    cfg = RolloutConfig(samples_per_prompt=1, saar=SaarConfig(rollback="importance", is_threshold=1.0))
    engine = _ScoringDouble(chat, lambda text, n: turns[n], logp)
    t = AgentLoop(engine, sandbox, chat, cfg).run([TASK], RolloutIdentity("r", 0, "v"))[0]
    retry = t.positions[0].attempts[1]
    assert engine.scored == [(chat.prompt_ids(TASK.question), retry.turn_ids)]  # one scoring, failed turn left out
    text = chat.decode(t.lived_ids)
    assert ("prnt" not in text and "NameError" not in text) == replaced and "print(6 * 7)" in text
    assert t.stats.live_deep == int(replaced) and t.reward == 1.0
    relived = purify(t, 0.0, "saar_is", chat.decode, score=lambda context, turn: [logp] * len(turn), tau=1.0)
    assert relived.response_ids == t.lived_ids
