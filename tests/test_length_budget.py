"""The length budget as docs/saar.md states it (and the reference's agent loop keeps it): the lived sequence never
passes rollout.max_response_tokens. A tool response that would reach the limit is not shown and the trajectory ends
(finish reason `length`); purification rebuilds exactly what was lived. Real sandbox, real tokenizer; the scripted
engine stands in for the policy only to choose the turns."""

from __future__ import annotations

import pytest

from pipeline.config import RolloutConfig, SaarConfig
from purifier.saar import purify
from rollout_gen.agent import AgentLoop, RolloutIdentity
from rollout_gen.tasks import Task
from tests.doubles import ANSWER, ScriptedEngineDouble, call

TASK = Task("t1", "world", "What is 6 * 7?", "42")
LONG = 'print("x" * 300)'  # a tool response of about a hundred tokens


def run(chat, sandbox, turns, max_response_tokens, **saar):
    cfg = RolloutConfig(samples_per_prompt=1, max_response_tokens=max_response_tokens, saar=SaarConfig(**saar))
    engine = ScriptedEngineDouble(chat, lambda text, n: turns[n] if n < len(turns) else ANSWER.format(42))
    return AgentLoop(engine, sandbox, chat, cfg).run([TASK], RolloutIdentity("r", 0, "v"))[0]


def sizes(chat, sandbox, turns, **saar) -> list[int]:
    """Lengths of the pieces of the lived sequence when nothing limits it: turn, feedback, turn, …"""
    t = run(chat, sandbox, turns, 4096, **saar)
    out = []
    for p in t.positions:
        for a in p.attempts:
            out += [len(a.turn_ids), len(a.feedback_ids)]
    return out


@pytest.mark.parametrize("live_mode", ["purified", "raw"])
def test_a_tool_response_that_would_reach_the_limit_is_not_shown(chat, sandbox, live_mode):
    turns = [call("print(6 * 7)"), call(LONG), ANSWER.format(42)]
    turn0, fb0, turn1, fb1 = sizes(chat, sandbox, turns, live_mode=live_mode)
    limit = turn0 + fb0 + turn1 + fb1  # the second response would end exactly at the limit
    t = run(chat, sandbox, turns, limit, live_mode=live_mode)
    assert len(t.lived_ids) <= limit
    assert len(t.lived_ids) == turn0 + fb0 + turn1 and t.finish_reason == "length"
    second = t.positions[1].attempts[0]
    assert second.feedback_ids == [] and "xxxx" in second.result.text  # the output is kept on the attempt
    mode = "saar" if live_mode == "purified" else "raw"
    assert purify(t, t.gamma_live, mode, chat.decode).response_ids == t.lived_ids


def test_a_failed_call_whose_error_would_stay_and_does_not_fit_is_cut_not_retried(chat, sandbox):
    """Lived raw, the error stays before the retry: it must fit. (Lived purified, a retry replaces the failed turn
    and its error, which is then only the retry's context and is not length-checked: tests/test_saar_fidelity.py.)"""
    bad = 'print("y" * 300); prnt(1)'
    turns = [call(bad), call("print(42)"), ANSWER.format(42)]
    turn0, fb0, *_ = sizes(chat, sandbox, turns, live_mode="raw")
    t = run(chat, sandbox, turns, turn0 + fb0, live_mode="raw")
    (pos,) = t.positions
    assert len(pos.attempts) == 1 and pos.outcome == "truncated" and t.finish_reason == "length"
    assert len(t.lived_ids) == turn0 <= turn0 + fb0
    assert purify(t, t.gamma_live, "raw", chat.decode).response_ids == t.lived_ids


def test_an_exhausted_position_s_note_that_does_not_fit_ends_the_trajectory(chat, sandbox):
    turns = [call("prnt(1)"), call("prnt(2)"), call("prnt(3)"), call("prnt(4)"), ANSWER.format(42)]
    free = run(chat, sandbox, turns, 4096, max_retries=3)
    assert free.positions[0].outcome == "exhausted" and free.final_turn is not None
    limit = len(free.lived_ids) - len(free.final_turn.turn_ids) - 1  # the last error, with the note, does not fit
    t = run(chat, sandbox, turns, limit, max_retries=3)
    (pos,) = t.positions
    assert pos.outcome == "exhausted" and t.finish_reason == "length" and len(t.lived_ids) <= limit
    assert pos.attempts[-1].feedback_ids == []
    assert purify(t, t.gamma_live, "saar", chat.decode).response_ids == t.lived_ids


def test_a_retry_lived_raw_takes_only_the_room_left(chat, sandbox):
    """With live_mode=raw a retry follows the failed turn and its error: it may not use the failed turn's room."""
    turns = [call("prnt(6 * 7)"), call("print(6 * 7) " + "#" * 400), ANSWER.format(42)]
    turn0, fb0, *_ = sizes(chat, sandbox, turns, live_mode="raw")
    limit = turn0 + fb0 + 20
    t = run(chat, sandbox, turns, limit, live_mode="raw")
    assert len(t.lived_ids) <= limit, (len(t.lived_ids), limit)
