"""Every generation is sampled with a seed of its own: a position's retries, and the turn after them, draw
independent noise (they shared one seed when the seed hashed only the count of kept turns, so a failed retry
tended to be sampled again until the retries ran out). Driven through the real agent loop, the real sandbox and
the committed policy's tokenizer; the scripted engine stands in for the policy only to force the failures."""

from __future__ import annotations

from pipeline.config import RolloutConfig, SaarConfig
from rollout_gen.agent import AgentLoop, RolloutIdentity, one_sample_runs
from rollout_gen.tasks import Task
from tests.doubles import ANSWER, ScriptedEngineDouble, call

TASK = Task("t1", "world", "What is 6 * 7?", "42")
# three failed attempts at position 0, a working one, an ordinary second call, the answer
TURNS = [call("prnt(1)"), call("prnt(2)"), call("prnt(3)"), call("print(6 * 7)"), call("print(42)"), ANSWER.format(42)]


class SeedRecordingEngineDouble(ScriptedEngineDouble):
    """TEST DOUBLE for a policy (scripted turns, see ScriptedEngineDouble) that records the seed of every request."""

    def __init__(self, chat, script) -> None:
        super().__init__(chat, script)
        self.seeds: list[int] = []

    def generate(self, contexts, params, seeds, shared_prefix=None):
        self.seeds.extend(seeds)
        return super().generate(contexts, params, seeds, shared_prefix)


def _engine(chat) -> SeedRecordingEngineDouble:
    return SeedRecordingEngineDouble(chat, lambda text, n: TURNS[n] if n < len(TURNS) else ANSWER.format(42))


def test_each_retry_and_the_next_turn_get_their_own_seed(chat, sandbox):
    engine = _engine(chat)
    cfg = RolloutConfig(samples_per_prompt=1, saar=SaarConfig(max_retries=3))
    t = AgentLoop(engine, sandbox, chat, cfg).run([TASK], RolloutIdentity("r", 0, "v", seed=5))[0]
    assert [len(p.attempts) for p in t.positions] == [4, 1]  # the script ran as meant: 3 retries, then a new call
    assert len(engine.seeds) == len(TURNS)
    assert len(set(engine.seeds)) == len(engine.seeds), engine.seeds


def test_seeds_stay_a_pure_function_of_the_run(chat, sandbox):
    """Reruns stay identical: the same run seed gives the same seeds, another run seed other ones."""

    def seeds(run_seed: int) -> list[int]:
        engine = _engine(chat)
        AgentLoop(engine, sandbox, chat, RolloutConfig(samples_per_prompt=1)).run(
            [TASK], RolloutIdentity("r", 0, "v", seed=run_seed)
        )
        return engine.seeds

    first = seeds(5)
    assert seeds(5) == first
    assert not set(seeds(6)) & set(first)


def test_eval_samples_retry_with_their_own_seeds(chat, sandbox):
    """`cleaner eval --samples k` seeds each sample as a one-sample run at its own seed: the same rule applies."""
    engine = _engine(chat)
    cfg = RolloutConfig(samples_per_prompt=1, saar=SaarConfig(max_retries=3))
    AgentLoop(engine, sandbox, chat, cfg).run([TASK], RolloutIdentity("eval", 0, "v", seed=5), None, 1, one_sample_runs)
    assert len(engine.seeds) == len(TURNS)
    assert len(set(engine.seeds)) == len(engine.seeds), engine.seeds
