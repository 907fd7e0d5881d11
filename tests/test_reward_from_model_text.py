"""The reward and the answer are read from what the policy wrote, never from a tool response: a program that prints
`\\boxed{…}` (or a code block) into the lived sequence does not score it. Real agent loop, real sandbox, real
tokenizer; the scripted engine stands in for the policy to choose the turns."""

from __future__ import annotations

from pipeline.config import RolloutConfig
from rollout_gen.agent import AgentLoop, RolloutIdentity
from rollout_gen.tasks import Task
from tests.doubles import ScriptedEngineDouble, call

TASK = Task("t1", "world", "What is 6 * 7?", "42")


def run(chat, sandbox, turns):
    engine = ScriptedEngineDouble(chat, lambda text, n: turns[min(n, len(turns) - 1)])
    return AgentLoop(engine, sandbox, chat, RolloutConfig(samples_per_prompt=1)).run(
        [TASK], RolloutIdentity("r", 0, "v")
    )[0]


def test_a_boxed_answer_printed_by_the_tool_does_not_score(chat, sandbox):
    # the program builds the box, so only its output holds `\boxed{42}`, not the policy's text
    t = run(chat, sandbox, [call('print(chr(92) + "boxed{" + str(6 * 7) + "}")'), "Done."])
    assert "\\boxed{42}" in chat.decode(t.lived_ids)  # the tool's output is in the lived sequence …
    assert t.final_answer is None and t.reward == -1.0  # … but the policy never answered


def test_the_policy_s_own_answer_still_scores(chat, sandbox):
    t = run(chat, sandbox, [call("print(6 * 7)"), "The answer is \\boxed{42}."])
    assert t.final_answer == "42" and t.reward == 1.0
