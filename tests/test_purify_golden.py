"""Golden tests of the pure SAAR core on raw trajectories built through the real tokenizer (the
committed policy's) by the real agent loop and sandbox, with scripted turns (see doubles.py)."""

from __future__ import annotations

import copy
import math

import pytest

from pipeline.chat import RETRY_NOTE
from pipeline.config import RolloutConfig, SaarConfig
from pipeline.splice import decide, piece_from_attempt
from purifier.saar import PurifyError, purify
from rollout_gen.agent import AgentLoop, RolloutIdentity
from rollout_gen.tasks import Task
from tests.doubles import ANSWER, ScriptedEngineDouble, call

TASK = Task("g1", "world", "What is 6 * 7?", "42")
FIX = call("print(6 * 7)", reasoning="Fixing the typo now.")
LONG_REWRITE = call(
    "first_factor = 6\nsecond_factor = 7\nproduct_value = first_factor * second_factor\nprint(product_value)",
    reasoning="A different approach.",
)


def raw(chat, sandbox, turns, task=TASK, **saar):
    cfg = RolloutConfig(samples_per_prompt=1, saar=SaarConfig(**saar))
    engine = ScriptedEngineDouble(
        chat, lambda text, n: turns[n] if n < len(turns) else ANSWER.format(task.ground_truth)
    )
    return AgentLoop(engine, sandbox, chat, cfg).run([task], RolloutIdentity("g", 0, "v"))[0]


def check_invariants(t, p, chat):
    assert p.prompt_ids == t.prompt_ids
    assert len(p.response_ids) == len(p.loss_mask) == len(p.old_logprobs) == len(p.logprob_valid)
    # mask 1 exactly on generated tokens: every mask-0 run is a whole tool-response turn
    runs, cur = [], []
    for tok, m in zip(p.response_ids, p.loss_mask):
        if m == 0:
            cur.append(tok)
        elif cur:
            runs.append(cur)
            cur = []
    if cur:
        runs.append(cur)
    for r in runs:
        text = chat.decode(r)
        assert text.startswith("\n<|im_start|>user\n<tool_response>") and text.endswith("<|im_start|>assistant\n")


def sim(chat, t, a, b):
    pa, pb = (
        piece_from_attempt(x.attempt_idx, x.turn_ids, x.logprobs, x.call_start)
        for x in (t.positions[0].attempts[a], t.positions[0].attempts[b])
    )
    return decide(pa, pb, 0.5, chat.decode).similarity


def below(similarity: float) -> float:
    """The two-decimal γ at or just below a similarity (a γ someone would write, not the float itself)."""
    return math.floor(similarity * 100) / 100


def test_shallow_keeps_failed_reasoning_and_takes_the_retry_call(chat, sandbox):
    t = raw(chat, sandbox, [call("prnt(6 * 7)", reasoning="Let me compute the product."), FIX])
    p = purify(t, 0.5, "saar", chat.decode)
    (s,) = p.splices
    assert s.kind == "shallow" and not s.split_failed and s.similarity >= 0.5
    text = chat.decode(p.response_ids)
    assert text.startswith("Let me compute the product.\n<tool_call>") and "Fixing the typo" not in text
    assert "prnt" not in text and "NameError" not in text and "Tool call success" in text
    failed = t.positions[0].attempts[0]
    assert p.response_ids[: failed.call_start] == failed.turn_ids[: failed.call_start]  # byte-identical prefix
    assert all(p.logprob_valid[: failed.call_start])  # its context is unchanged: sampled log-probs kept
    assert not any(p.logprob_valid[failed.call_start : s.first_recomputed + 1])
    assert s.tokens_removed > 0
    check_invariants(t, p, chat)


def test_deep_takes_the_whole_retry_turn(chat, sandbox):
    t = raw(chat, sandbox, [call("prnt(6 * 7)", reasoning="Let me compute the product."), FIX])
    p = purify(t, 1.01, "saar", chat.decode)
    assert p.splices[0].kind == "deep"
    assert chat.decode(p.response_ids).startswith("Fixing the typo now.")
    check_invariants(t, p, chat)


def test_decision_flips_between_the_gammas_around_the_similarity(chat, sandbox):
    # γ = the similarity exactly is covered by tests/test_similarity.py on pairs built to hit γ
    t = raw(chat, sandbox, [call("prnt(6 * 7)"), FIX])
    s = sim(chat, t, 0, 1)
    assert purify(t, below(s), "saar", chat.decode).splices[0].kind == "shallow"
    assert purify(t, below(s) + 0.01, "saar", chat.decode).splices[0].kind == "deep"


def test_split_failure_falls_back_to_deep(chat, sandbox):
    t = raw(chat, sandbox, [call("prnt(6 * 7)"), FIX])
    t.positions[0].attempts[0].call_start = -1  # no boundary on token ids for the failed turn
    p = purify(t, 0.0, "saar", chat.decode)
    assert p.splices[0].kind == "deep" and p.splices[0].split_failed


def test_retry_without_call_leaves_the_position_unpurified(chat, sandbox):
    t = raw(chat, sandbox, [call("prnt(6 * 7)"), "I cannot fix it. \\boxed{0}"])
    p = purify(t, 0.5, "saar", chat.decode)
    text = chat.decode(p.response_ids)
    assert p.splices == [] and "prnt" in text and "NameError" in text and "I cannot fix it" in text
    check_invariants(t, p, chat)


def test_k_exhausted_keeps_last_spliced_attempt_error_and_note(chat, sandbox):
    t = raw(chat, sandbox, [call("prnt(1)"), call("prnt(2)"), call("prnt(3)"), call("prnt(4)"), call("prnt(5)")])
    p = purify(t, 0.5, "saar", chat.decode)
    assert len([s for s in p.splices if s.position_idx == 0]) == 3
    text = chat.decode(p.response_ids)
    assert "prnt(4)" in text and "prnt(1)" not in text and "\n\n" + RETRY_NOTE.format(n=3) in text
    assert text.count("reason: NameError") == 2 and "prnt(5)" in text  # SAAR is off after it: not retried


def test_two_retries_alternating_shallow_then_deep(chat, sandbox):
    # retry 1 is a near-copy (still failing), retry 2 a long rewrite: at γ = sim(failed, retry 1) the
    # first splice is shallow and the second, less similar, is deep.
    t = raw(chat, sandbox, [call("prnt(6 * 7)"), call("print(6 * 7", reasoning="Try again."), LONG_REWRITE])
    gamma = below(sim(chat, t, 0, 1))
    p = purify(t, gamma, "saar", chat.decode)
    assert [s.kind for s in p.splices] == ["shallow", "deep"]
    assert p.splices[1].similarity < gamma <= p.splices[0].similarity
    text = chat.decode(p.response_ids)
    assert text.startswith("A different approach.") and "SyntaxError" not in text and "NameError" not in text
    check_invariants(t, p, chat)


def test_two_positions_in_one_trajectory(chat, sandbox):
    task = Task("g2", "world", "Compute 6 * 7. Then add that result to 8.", "50")
    t = raw(
        chat,
        sandbox,
        [call("prnt(6 * 7)"), call("print(6 * 7)"), call("print(42 + 8"), call("print(42 + 8)"), ANSWER.format(50)],
        task=task,
    )
    assert [p.outcome for p in t.positions] == ["recovered", "recovered"]
    p = purify(t, 0.5, "saar", chat.decode)
    assert [s.position_idx for s in p.splices] == [0, 1]
    text = chat.decode(p.response_ids)
    assert "Error" not in text and text.count("Tool call success") == 2 and p.reward == 1.0
    check_invariants(t, p, chat)


def test_gate_off_is_left_as_lived(chat, sandbox):
    t = raw(chat, sandbox, [call("prnt(6 * 7)"), FIX], gate_p=0.0)
    p = purify(t, 0.5, "saar", chat.decode)
    assert p.splices == [] and p.response_ids == t.lived_ids and p.loss_mask == t.lived_mask


def test_infra_errors_are_never_purified(chat, sandbox):
    t = raw(chat, sandbox, [call("prnt(6 * 7)"), FIX], gate_p=0.0)
    t = copy.deepcopy(t)
    t.saar_gate = True
    pos = t.positions[0]
    pos.outcome, pos.attempts[0].result.error_class = "infra", "infra"
    p = purify(t, 0.5, "saar", chat.decode)
    assert p.splices == [] and p.response_ids == t.lived_ids


def test_raw_and_void_turn_modes(chat, sandbox):
    t = raw(chat, sandbox, [call("prnt(6 * 7)"), FIX])
    r = purify(t, 0.5, "raw", chat.decode)
    assert "prnt" in chat.decode(r.response_ids) and r.gamma == 0.0 and r.splices == []
    assert sum(r.loss_mask) > 0 and purify(t, 0.5, "void_turn", chat.decode).loss_mask == r.loss_mask
    void = raw(chat, sandbox, ['<tool_call>\n{"name": "code_interpreter", "arguments": {"code": "print(1)"}}', FIX])
    assert sum(purify(void, 0.5, "void_turn", chat.decode).loss_mask) == 0


def test_same_input_same_output(chat, sandbox):
    t = raw(chat, sandbox, [call("prnt(6 * 7)"), FIX])
    assert purify(t, 0.5, "saar", chat.decode) == purify(copy.deepcopy(t), 0.5, "saar", chat.decode)


def test_bad_rows_raise_purify_errors(chat, sandbox):
    t = raw(chat, sandbox, [call("prnt(6 * 7)"), FIX])
    bad = copy.deepcopy(t)
    bad.positions[0].attempts[1].call_start = 10_000
    with pytest.raises(PurifyError, match="position 0 attempt 1: call_start 10000 out of range"):
        purify(bad, 0.5, "saar", chat.decode)
    bad = copy.deepcopy(t)
    bad.positions[0].attempts[0].logprobs = bad.positions[0].attempts[0].logprobs[:-1]
    with pytest.raises(PurifyError, match="logprobs length"):
        purify(bad, 0.5, "saar", chat.decode)
