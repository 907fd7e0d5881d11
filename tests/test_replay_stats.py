"""`replay_stats` (purifier/replay.py): what a γ does to stored raw trajectories, checked on rows whose
answers are known without recomputing them: at γ=0 every splice is shallow, above 1 every one is
deep, at the lived γ with the lived measure nothing differs from what was lived; rows without retries
or with SAAR off are not counted. Raw rows come from the real agent loop and sandbox with scripted
turns (tests/doubles.py) and the committed policy's tokenizer."""

from __future__ import annotations

import copy

import pytest

from pipeline.config import RolloutConfig, SaarConfig
from pipeline.similarity import DEFAULT_MEASURE, REFERENCE_MEASURE
from purifier.replay import replay_stats
from purifier.saar import purify
from rollout_gen.agent import AgentLoop, RolloutIdentity
from rollout_gen.tasks import Task
from tests.doubles import ANSWER, ScriptedEngineDouble, call

TASK = Task("g1", "world", "What is 6 * 7?", "42")
NEAR_COPY = [call("prnt(6 * 7)", reasoning="Let me compute."), call("print(6 * 7)", reasoning="Fixing the typo.")]
REWRITE = [
    call("prnt(6 * 7)", reasoning="Let me compute."),
    call(
        "import math\nfactors = [6, 7]\naccumulated_product = math.prod(factors)\n"
        "assert accumulated_product > 0\nprint(accumulated_product)",
        reasoning="A different approach with the math module.",
    ),
]
FIRST_TRY = [call("print(6 * 7)")]
GAMMA_LIVE = 0.7


def _raw(chat, sandbox, turns):
    cfg = RolloutConfig(samples_per_prompt=1, saar=SaarConfig(gamma_live=GAMMA_LIVE))
    engine = ScriptedEngineDouble(chat, lambda text, n: turns[n] if n < len(turns) else ANSWER.format(42))
    return AgentLoop(engine, sandbox, chat, cfg).run([TASK], RolloutIdentity("g", 0, "v"))[0]


@pytest.fixture(scope="module")
def raws(chat, sandbox):
    near, rewrite, first = (_raw(chat, sandbox, t) for t in (NEAR_COPY, REWRITE, FIRST_TRY))
    gated_off = copy.deepcopy(near)
    gated_off.saar_gate = False
    return near, rewrite, first, gated_off


def test_replay_stats_counts_known_decisions(chat, raws):
    near, rewrite, first, gated_off = raws
    live = DEFAULT_MEASURE  # the measure the rows were lived with (rollout.saar.similarity's default)
    assert [len(p.attempts) for p in near.positions][:1] == [2] and len(first.positions[0].attempts) == 1
    sims = [s.similarity for t in (near, rewrite) for s in purify(t, 0.5, "saar", chat.decode, live).splices]
    assert sims[0] > GAMMA_LIVE > sims[1]  # the near-copy fix was lived shallow, the rewrite deep

    everything = [near, rewrite, first, gated_off]
    low = replay_stats(everything, 0.0, chat.decode, live, live)
    assert (low.positions, low.shallow, low.deep) == (2, 2, 0)
    assert low.differ_from_live == 1  # the rewrite was lived deep
    assert low.differ_from_reference == 0  # at γ=0 every measure says shallow
    assert low.tokens_removed > 0 and low.tokens_recomputed > 0

    high = replay_stats(everything, 1.01, chat.decode, live, live)
    assert (high.positions, high.shallow, high.deep) == (2, 0, 2)
    assert (high.differ_from_live, high.differ_from_reference) == (1, 0)  # the near copy was lived shallow

    lived = replay_stats(everything, GAMMA_LIVE, chat.decode, live, live)
    assert (lived.shallow, lived.deep, lived.differ_from_live) == (1, 1, 0)

    # the rows that cannot change add nothing
    only = replay_stats([near, rewrite], 0.5, chat.decode, live, live)
    assert only == replay_stats([near, rewrite, first, gated_off], 0.5, chat.decode, live, live)
    empty = replay_stats([first, gated_off], 0.5, chat.decode, live, live)
    assert (empty.positions, empty.shallow, empty.deep, empty.tokens_removed, empty.tokens_recomputed) == (
        0,
        0,
        0,
        0,
        0,
    )


def test_reference_measure_differences_are_counted(chat, raws):
    """The rewrite's similarity is 0.61 under rapidfuzz and 0.57 under difflib (the reference): at γ
    between them the two measures decide differently for it, and alike for the near copy (0.995)."""
    near, rewrite, *_ = raws
    (ours,) = (x.similarity for x in purify(rewrite, 0.5, "saar", chat.decode, DEFAULT_MEASURE).splices)
    (ref,) = (x.similarity for x in purify(rewrite, 0.5, "saar", chat.decode, REFERENCE_MEASURE).splices)
    assert ref < 0.59 < ours
    s = replay_stats([near, rewrite], 0.59, chat.decode, DEFAULT_MEASURE, DEFAULT_MEASURE)
    assert (s.shallow, s.deep, s.differ_from_reference) == (2, 0, 1)
    assert replay_stats([near], 0.59, chat.decode, DEFAULT_MEASURE, DEFAULT_MEASURE).differ_from_reference == 0


def test_example_pairs_start_shortly_before_the_first_difference():
    from purifier.replay import diff_window

    prefix = '<tool_call>\n{"name": "python", "arguments": {"code": "'
    old, new = diff_window(prefix + 'a = 3\nprint(a * 14)"}}\n</tool_call>', prefix + 'print(6 * 7)"}}\n</tool_call>')
    assert old.startswith("…") and new.startswith("…") and "a = 3⏎print(a * 14)" in old and "print(6 * 7)" in new
    assert old[:10] == new[:10] and len(old) <= 70 and len(new) <= 70
    long = diff_window(prefix + "x = 1\n" * 40, prefix + "y = 1\n" * 40)
    assert all(len(s) == 70 and s.endswith("…") for s in long) and "x = 1" in long[0] and "y = 1" in long[1]
    assert diff_window("print(1)", "print(1)") == ("print(1)", "print(1)")  # no difference: from the start
