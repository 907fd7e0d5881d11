"""The asynchronous agent loop and the continuously batching CPU engine (issue 17), on the real tiny
policy and the real sandbox: KV kept across turns, log-probs against an unpadded forward, the cache
cap and its release, the deterministic schedule, and trajectories that do not wait for each other."""

from __future__ import annotations

import random
import threading
import time

import pytest
import torch

from pipeline.config import DEFAULT_POLICY, EngineTuning, RolloutConfig, load_config
from pipeline.trajectory import trajectory_to_row
from rollout_gen.agent import AgentLoop, RolloutIdentity
from pipeline.engines.base import Request, SamplingParams
from rollout_gen.engines.cpu import CPUEngine
from rollout_gen.engines.kv_store import least_forwards
from rollout_gen.sandbox import SandboxPool
from pipeline.chat import load_chat
from rollout_gen.tasks import Task
from rollout_gen.world.tasks import eval_tasks
from tests.doubles import ANSWER, ScriptedEngineDouble, call


def _drain(engine: CPUEngine, requests: list[Request]) -> dict:
    engine.add(requests)
    out = {}
    while engine.busy():
        out.update((r.key, g) for r, g in engine.step())
    return out


def _full_forward_error(model, context: list[int], gen) -> float:
    with torch.no_grad():
        logits = model(torch.tensor([context + gen.output_ids])).logits[0].float()
    logp = logits - torch.logsumexp(logits, -1, keepdim=True)
    return max(
        abs(logp[len(context) + i - 1, t].item() - lp) for i, (t, lp) in enumerate(zip(gen.output_ids, gen.logprobs))
    )


def test_turns_reuse_kept_kv_and_logprobs_equal_an_unpadded_forward():
    engine = CPUEngine(DEFAULT_POLICY)
    rng = random.Random(0)
    prompt = [rng.randrange(5, 1000) for _ in range(30)]
    params = SamplingParams(24, 1.0, 1.0, ())
    ctx = {k: prompt + [rng.randrange(5, 1000) for _ in range(3 + 4 * k)] for k in range(3)}
    got = _drain(engine, [Request(k, tuple(c), params, seed=k, shared_prefix=len(prompt)) for k, c in ctx.items()])
    # the prompt is forwarded once for the three rows, then each row's own tokens
    assert engine.prefill_tokens == len(prompt) + sum(len(c) - len(prompt) for c in ctx.values())
    worst = max(_full_forward_error(engine.model, ctx[k], got[k]) for k in ctx)
    # turn 2: rows 0 and 1 append a tool response; row 2 rewrites its last turn (a SAAR splice),
    # so only what follows the common prefix is forwarded again
    tool = [rng.randrange(5, 1000) for _ in range(7)]
    turn2 = {
        0: ctx[0] + got[0].output_ids + tool,
        1: ctx[1] + got[1].output_ids + tool,
        2: ctx[2] + got[2].output_ids[:5] + tool,
    }
    before = engine.prefill_tokens
    got2 = _drain(
        engine, [Request(k, tuple(c), params, seed=10 + k, shared_prefix=len(prompt)) for k, c in turn2.items()]
    )
    # the last sampled token of a turn was never forwarded; everything before it was
    assert engine.prefill_tokens - before == (1 + 7) + (1 + 7) + 7
    worst = max([worst] + [_full_forward_error(engine.model, turn2[k], got2[k]) for k in turn2])
    assert worst <= 1e-5
    assert len(engine.kept) == 3
    for k in turn2:
        engine.release(k)
    assert len(engine.kept) == 0 and engine.kept.tokens == 0


def test_rows_leaving_mid_batch_and_joining_late_keep_exact_logprobs():
    """Rows leave in another order than they joined (a hole in the middle of the batch is filled by a
    later row) and new rows join a running batch: every row's log-probs still equal its own forward."""
    engine = CPUEngine(DEFAULT_POLICY)
    rng = random.Random(3)
    ctx = {k: [rng.randrange(5, 1000) for _ in range(5 + 3 * k)] for k in range(6)}
    budget = {0: 20, 1: 3, 2: 12, 3: 5, 4: 16, 5: 7}  # 1 and 3 leave first, from the middle
    engine.add([Request(k, tuple(ctx[k]), SamplingParams(budget[k], 1.0, 1.0, ()), seed=k) for k in range(4)])
    got: dict = {}
    for step in range(40):
        if step == 4:  # two more join while the first ones are decoding and leaving
            engine.add([Request(k, tuple(ctx[k]), SamplingParams(budget[k], 1.0, 1.0, ()), seed=k) for k in (4, 5)])
        got.update((r.key, g) for r, g in engine.step())
        if not engine.busy():
            break
    assert sorted(got) == list(range(6)) and all(len(got[k].output_ids) == budget[k] for k in got)
    assert max(_full_forward_error(engine.model, ctx[k], got[k]) for k in got) <= 1e-5


def test_rows_joining_a_running_batch_go_into_spare_rows_without_copying_it():
    """Rows with contexts no wider than the batch are written into the batch's spare rows (the running
    rows' KV is not copied), also after a row has left and taken the widest columns with it; every
    row's log-probs still equal its own forward."""
    engine = CPUEngine(DEFAULT_POLICY)
    rng = random.Random(4)
    ctx = {k: [rng.randrange(5, 1000) for _ in range(n)] for k, n in enumerate((30, 40, 25, 8, 12))}
    budget = {0: 20, 1: 3, 2: 20, 3: 9, 4: 6}  # 1, the widest, leaves first: its columns are cut off
    params = {k: SamplingParams(budget[k], 1.0, 1.0, ()) for k in budget}
    engine.add([Request(k, tuple(ctx[k]), params[k], seed=k) for k in range(3)])
    got: dict = {}
    for _ in range(5):
        got.update((r.key, g) for r, g in engine.step())
    assert 1 in got and len(engine._rows) == 2
    buffer = engine._cache.layers[0]._k
    engine.add([Request(k, tuple(ctx[k]), params[k], seed=k) for k in (3, 4)])
    got.update((r.key, g) for r, g in engine.step())
    assert engine._cache.layers[0]._k is buffer and len(engine._rows) == 4  # joined in place
    while engine.busy():
        got.update((r.key, g) for r, g in engine.step())
    assert sorted(got) == list(range(5)) and all(len(got[k].output_ids) == budget[k] for k in got)
    assert max(_full_forward_error(engine.model, ctx[k], got[k]) for k in got) <= 1e-5


def test_a_row_wider_than_the_batch_joins_in_place_through_the_spare_columns_on_the_left():
    engine = CPUEngine(DEFAULT_POLICY)
    rng = random.Random(5)
    ctx = {k: [rng.randrange(5, 1000) for _ in range(n)] for k, n in enumerate((10, 14, 30))}
    params = {k: SamplingParams(b, 1.0, 1.0, ()) for k, b in enumerate((12, 12, 6))}
    engine.add([Request(k, tuple(ctx[k]), params[k], seed=k) for k in (0, 1)])
    got: dict = {}
    for _ in range(3):
        got.update((r.key, g) for r, g in engine.step())
    buffer, width = engine._cache.layers[0]._k, engine._mask.shape[1]
    engine.add([Request(2, tuple(ctx[2]), params[2], seed=2)])
    got.update((r.key, g) for r, g in engine.step())
    assert engine._cache.layers[0]._k is buffer and engine._mask.shape[1] > width  # widened, not rebuilt
    while engine.busy():
        got.update((r.key, g) for r, g in engine.step())
    assert sorted(got) == [0, 1, 2]
    assert max(_full_forward_error(engine.model, ctx[k], got[k]) for k in got) <= 1e-5


def test_cache_cap_evicts_and_results_do_not_change():
    rng = random.Random(1)
    params = SamplingParams(16, 1.0, 1.0, ())
    ctx = {k: [rng.randrange(5, 1000) for _ in range(20 + k)] for k in range(4)}

    def two_turns(engine: CPUEngine) -> list[list[int]]:
        first = _drain(engine, [Request(k, tuple(c), params, seed=k) for k, c in ctx.items()])
        nxt = {k: ctx[k] + first[k].output_ids + [11, 12] for k in ctx}
        second = _drain(engine, [Request(k, tuple(c), params, seed=9 + k) for k, c in nxt.items()])
        return [first[k].output_ids + second[k].output_ids for k in ctx]

    roomy, tight = CPUEngine(DEFAULT_POLICY), CPUEngine(DEFAULT_POLICY, kv_cache_tokens=80)
    assert two_turns(tight) == two_turns(roomy)
    assert tight.kept.evicted > 0 and tight.kept.tokens <= 80  # bounded: the oldest went first
    assert roomy.kept.evicted == 0 and tight.prefill_tokens > roomy.prefill_tokens


def test_kv_reuse_forwards_no_more_than_any_prefix_cache_could_on_a_saar_rollout():
    """Over a real multi-turn rollout with live SAAR splices, the engine forwards exactly the
    workload's floor (`least_forwards`: each token of a context once per distinct prefix), up to the
    rare token an older retry's branch shares beyond the last turn's (the engine keeps only the last)."""
    cfg = load_config(None, ["rollout.samples_per_prompt=4", "rollout.saar.live_mode=purified"])
    engine = CPUEngine(DEFAULT_POLICY)
    engine.turn_log = []
    with SandboxPool(cfg.rollout.sandbox) as pool:
        trajs = AgentLoop(engine, pool, load_chat(DEFAULT_POLICY), cfg.rollout).run(
            eval_tasks(cfg.world)[:8], RolloutIdentity("f", 0, "v")
        )
    assert sum(t.stats.retries for t in trajs) > 0 and sum(t.stats.turns for t in trajs) > len(trajs)
    forwarded = engine.prefill_tokens - engine.first_prefill_tokens + engine.decode_tokens
    floor = least_forwards(engine.turn_log)
    assert floor <= forwarded <= floor * 1.01
    firsts = {k: len(c) for k, c, _ in reversed(engine.turn_log)}  # each key's first context
    re_prefill = sum(len(c) + len(o) - 1 for _, c, o in engine.turn_log) - sum(firsts.values())
    assert floor < 0.75 * re_prefill  # what re-prefilling every turn's whole context would forward


def test_least_forwards_counts_new_prefixes_only():
    a = [
        (1, [1, 2, 3], [4, 5, 9]),  # first prefill excluded; outputs 4, 5 forwarded (9 never)
        (1, [1, 2, 3, 4, 5, 9, 7, 7], [8]),  # 9, 7, 7 are new
        (1, [1, 2, 3, 6], [8, 8]),  # a splice back to [1, 2, 3]: 6 is new, then one output
        (1, [1, 2, 3, 6], [0]),
    ]  # nothing new: one token still forwarded for its logits
    assert least_forwards(a) == 2 + 3 + (1 + 1) + 1


def _untimed(value):
    """A raw row without the sandbox's measured wall time per call (`duration_s`), the one field
    that is a measurement of the machine, not a result of the rollout."""
    if isinstance(value, dict):
        return {k: _untimed(v) for k, v in value.items() if k != "duration_s"}
    return [_untimed(v) for v in value] if isinstance(value, list) else value


def _rows(cfg: RolloutConfig, tasks, sandbox, engine=None) -> tuple[list[dict], CPUEngine]:
    chat = load_chat(DEFAULT_POLICY)
    engine = engine or CPUEngine(DEFAULT_POLICY)
    trajs = AgentLoop(engine, sandbox, chat, cfg).run(tasks, RolloutIdentity("a", 0, "v"))
    return [_untimed(trajectory_to_row(t)) for t in trajs], engine


class JitterSandboxDouble:
    """TEST DOUBLE: the real pool, each call held back by a random 0–40 ms, so tool results come back
    in another order and at other engine steps than they would by themselves."""

    def __init__(self, pool: SandboxPool, seed: int) -> None:
        self.pool, self.rng = pool, random.Random(seed)

    def run_many(self, codes):
        time.sleep(self.rng.uniform(0.0, 0.04))
        return self.pool.run_many(codes)


@pytest.fixture(scope="module")
def world():
    cfg = load_config(None, ["rollout.samples_per_prompt=4"])
    return cfg, eval_tasks(cfg.world)[:6]


def test_deterministic_schedule_gives_the_same_raw_rows_twice_and_frees_the_cache(world):
    cfg, tasks = world
    with SandboxPool(cfg.rollout.sandbox) as pool:
        a, engine = _rows(cfg.rollout, tasks, pool)
        b, _ = _rows(cfg.rollout, tasks, JitterSandboxDouble(pool, seed=5))
    assert a == b  # bit-identical rows (log-probs included) whatever the tool timing
    assert engine.kept.tokens == 0 and len(engine.kept) == 0 and not engine.busy()  # freed as trajectories end
    assert sum(len(r["positions"]) for r in a) > 6  # real tool turns happened


def test_live_importance_rollbacks_are_scored_together_and_reruns_stay_bit_identical():
    """rollout.saar.rollback=importance: a rollback is scored only when its retry's result is back, so the engine
    scores the rollbacks of several steps in one forward (fewer forwards than rollbacks), and the schedule stays a
    function of the trajectories: a rerun with tool results at other times gives the same rows, bit for bit."""
    cfg = load_config(
        None,
        [
            "rollout.samples_per_prompt=4",
            "rollout.seed=3",
            "rollout.saar.rollback=importance",
            "rollout.saar.is_threshold=0.5",
        ],
    )
    tasks = eval_tasks(cfg.world)[:16]
    batches: list[int] = []

    class CountingEngine(CPUEngine):
        def score_turns(self, requests):
            batches.append(len(requests))
            return super().score_turns(requests)

    with SandboxPool(cfg.rollout.sandbox) as pool:
        a, engine = _rows(cfg.rollout, tasks, pool, CountingEngine(DEFAULT_POLICY))
        first = list(batches)
        b, _ = _rows(cfg.rollout, tasks, JitterSandboxDouble(pool, seed=7))
    rollbacks = sum(r["stats"]["retries"] for r in a)
    assert 0 < len(first) < sum(first) <= rollbacks
    assert a == b
    assert engine.kept.tokens == 0 and len(engine.kept) == 0  # branches are freed with their trajectories


def test_free_schedule_rows_match_up_to_float_drift(world):
    cfg, tasks = world
    free = cfg.rollout.model_copy(update={"engine_tuning": EngineTuning(deterministic=False)})
    with SandboxPool(cfg.rollout.sandbox) as pool:
        a, _ = _rows(cfg.rollout, tasks, pool)
        b, _ = _rows(free, tasks, JitterSandboxDouble(pool, seed=6))
    assert [r["lived_ids"] for r in a] == [r["lived_ids"] for r in b]
    assert max(abs(x - y) for r, s in zip(a, b) for x, y in zip(r["lived_logprobs"], s["lived_logprobs"])) <= 1e-4


class _HeldSandbox:
    """TEST DOUBLE: the real pool, holding back the calls that contain `marker` until `release` is set: a
    slow tool call whose end the test decides, instead of a sleep whose length the machine's load decides."""

    def __init__(self, pool, marker: str, release: threading.Event) -> None:
        self.pool, self.marker, self.release = pool, marker, release
        self.held = 0

    def run_many(self, codes):
        if any(self.marker in c for c in codes):
            self.held += 1
            assert self.release.wait(timeout=60), "the held call was never released"
        return self.pool.run_many(codes)


def test_a_slow_tool_call_does_not_hold_other_trajectories(chat, sandbox):
    """Free schedule: the slow trajectory's call ends only when the quick trajectory asks for its last turn,
    so the rollout ends at all only if the quick one ran its four turns and three calls meanwhile."""
    slow = Task("slow", "world", "What is 1 + 1?", "2")
    quick = Task("quick", "world", "What is 2 + 2?", "4")
    order: list[str] = []
    lock = threading.Lock()
    release = threading.Event()

    def script(text: str, n: int) -> str:
        name = "slow" if "1 + 1" in text else "quick"
        with lock:
            order.append(f"{name}{n}")
        if name == "quick" and n == 3:
            release.set()
        if name == "slow":
            return call("print(2)  # slow") if n == 0 else ANSWER.format(2)
        return call(f"print({n})") if n < 3 else ANSWER.format(4)

    notes: list[str] = []
    for deterministic in (False, True):
        order.clear()
        release.clear()
        if deterministic:  # results rejoin at fixed steps: the quick one waits for the slow call by design
            release.set()
        held = _HeldSandbox(sandbox, "# slow", release)
        cfg = RolloutConfig(samples_per_prompt=1, engine_tuning=EngineTuning(deterministic=deterministic))
        out = AgentLoop(ScriptedEngineDouble(chat, script), held, chat, cfg).run(
            [slow, quick], RolloutIdentity("s", 0, "v"), progress=lambda d, t, note: notes.append(note)
        )
        assert [t.reward for t in out] == [1.0, 1.0] and held.held == 1
        if not deterministic:
            assert order.index("quick3") < order.index("slow1"), order
    assert any("tool calls in flight" in n and "tokens/s" in n and "active" in n for n in notes)


def test_race_sampler_draws_the_tokens_torch_multinomial_draws():
    """The engine samples a whole batch with one division and argmax; each row's tokens must stay those
    torch.multinomial gives for the same generator, or every committed run would sample differently."""
    from rollout_gen.engines.cpu import _race

    torch.manual_seed(0)
    logits = torch.cat([torch.randn(8, 1024) * s for s in (0.1, 1.0, 8.0)])  # flat to peaked rows
    logits[::5, :900] = float("-inf")  # rows with zero-probability tokens (top-p leaves such rows)
    probs = torch.softmax(logits, dim=-1)
    for draw in range(20):
        seeds = [1000 * draw + i for i in range(len(probs))]
        expected = [
            torch.multinomial(p, 1, generator=torch.Generator().manual_seed(s))[0].item() for p, s in zip(probs, seeds)
        ]
        assert _race(probs, [torch.Generator().manual_seed(s) for s in seeds]).tolist() == expected


def test_progress_counts_a_long_turns_tokens_while_it_is_generated(chat, sandbox):
    """The rollout's progress line counted a turn's tokens only when the turn ended: a user's 8k-token turns showed
    "0 tokens/s" for six minutes. The CPU engine now says how many tokens its running turns have sampled, and the
    rate counts them from the first report on."""
    import re

    notes: list[tuple[int, str]] = []
    cfg = RolloutConfig(samples_per_prompt=2, max_turn_tokens=64)
    engine = CPUEngine(DEFAULT_POLICY)
    AgentLoop(engine, sandbox, chat, cfg).run(
        [Task("t", "world", "What is 6 * 7?", "42")],
        RolloutIdentity("p", 0, "v"),
        progress=lambda d, t, note: notes.append((d, note)),
    )
    rates = [float(re.search(r"(\d+) tokens/s", n).group(1)) for _, n in notes if "tokens/s" in n]
    assert rates and rates[0] > 0, notes[:3]  # the first report comes before any turn has ended
    assert "(finished turns)" not in notes[0][1]
    assert engine.tokens_in_flight() == 0  # nothing left running
