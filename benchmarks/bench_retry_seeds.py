"""Retries sampled on their own: consecutive retries that repeat the attempt before them, and the rollout's wall time,
with every generation seeded by (turn, attempt) vs the earlier seeding by turn alone (the baseline, in the same run).

The earlier rule hashed only the count of kept turns, which a retry does not advance: a position's retries and the
turn after them shared one seed, so a failed retry tended to be sampled again. The baseline reproduces that rule by
swapping the loop's seed function; everything else (engine, sandbox, tasks, policy) is the same real rollout.
"""

from __future__ import annotations

import time
from collections import Counter
from contextlib import contextmanager

from benchmarks.common import BenchResult, Row
from pipeline.config import DEFAULT_POLICY, load_config
from rollout_gen import agent
from rollout_gen.agent import AgentLoop, RolloutIdentity, unit_hash
from rollout_gen.stage import iteration_tasks, make_engine
from rollout_gen.sandbox import SandboxPool
from pipeline.chat import load_chat

TASKS, SAMPLES, SEEDS = 64, 4, (1, 2)


def _turn_only_seed(run_seed: int, lv) -> int:
    return int(unit_hash("sample", run_seed, lv.task.prompt_id, lv.sample_idx, lv.turns) * 2**62)


@contextmanager
def _seeding(fn):
    saved = agent.generation_seed
    agent.generation_seed = fn
    try:
        yield
    finally:
        agent.generation_seed = saved


def _rollout(seed: int) -> tuple[list, float]:
    cfg = load_config(
        None, [f"rollout.tasks_per_iteration={TASKS}", f"rollout.samples_per_prompt={SAMPLES}", f"rollout.seed={seed}"]
    )
    chat = load_chat(DEFAULT_POLICY)
    engine = make_engine(cfg, DEFAULT_POLICY, chat)
    try:
        with SandboxPool(cfg.rollout.sandbox) as sandbox:
            t0 = time.perf_counter()
            out = AgentLoop(engine, sandbox, chat, cfg.rollout).run(
                iteration_tasks(cfg, 0), RolloutIdentity("bench", 0, "v", seed)
            )
            return out, time.perf_counter() - t0
    finally:
        engine.close()


def _repeats(trajectories) -> tuple[Counter, Counter, int]:
    """Per retry index k ≥ 1: retries, and those whose code equals attempt k−1's; and exhausted positions."""
    n, same, exhausted = Counter(), Counter(), 0
    for t in trajectories:
        for p in t.positions:
            exhausted += p.outcome == "exhausted"
            for prev, a in zip(p.attempts, p.attempts[1:]):
                n[a.attempt_idx] += 1
                same[a.attempt_idx] += a.code == prev.code
    return n, same, exhausted


def run() -> BenchResult:
    measured = {}
    for name, fn in (("per-attempt", agent.generation_seed), ("turn only", _turn_only_seed)):
        n, same, exhausted, wall, rows = Counter(), Counter(), 0, 0.0, 0
        for seed in SEEDS:
            with _seeding(fn):
                out, seconds = _rollout(seed)
            a, b, e = _repeats(out)
            n, same, exhausted, wall, rows = n + a, same + b, exhausted + e, wall + seconds, rows + len(out)
        measured[name] = (n, same, exhausted, wall, rows)
    new, old = measured["per-attempt"], measured["turn only"]

    def share(m, first: bool) -> float:
        n, same = m[0], m[1]
        keys = [k for k in n if (k == 1) == first]
        return sum(same[k] for k in keys) / max(1, sum(n[k] for k in keys))

    rows = [
        Row(
            "first retries repeating the failed call's code",
            share(new, True),
            share(old, True),
            "fraction",
            higher_is_better=False,
        ),
        Row(
            "second and later retries repeating the attempt before them",
            share(new, False),
            share(old, False),
            "fraction",
            higher_is_better=False,
            target="as rare as among first retries (≤ 2× their share + 0.02)",
            passed=share(new, False) <= 2 * share(new, True) + 0.02,
        ),
        Row(
            "exhausted positions per trajectory",
            new[2] / new[4],
            old[2] / old[4],
            "per trajectory",
            higher_is_better=False,
        ),
        Row(
            "rollout wall time",
            new[3],
            old[3],
            "s",
            higher_is_better=False,
            target="≤ 1.10× (the seed is free)",
            passed=new[3] <= 1.10 * old[3],
        ),
    ]
    detail = {name: {k: f"{m[1][k]}/{m[0][k]}" for k in sorted(m[0])} for name, m in measured.items()}
    notes = [
        f"the committed tiny policy on the world, {TASKS} tasks × {SAMPLES} samples at rollout.seed "
        f"{', '.join(map(str, SEEDS))}; baseline: the same rollouts seeded by turn alone (the rule before "
        "2026-11-27). Retries repeating the attempt before them, by retry index: " + str(detail),
        "one seed hash is about 2 µs of a generation's milliseconds; the wall-time row is one run each on a "
        "shared 2-core machine, so it carries the machine's noise",
    ]
    return BenchResult(
        "retry_seeds",
        "Every retry sampled on its own: repeats and exhausted positions with per-attempt "
        "seeds vs turn-only seeds (same run).",
        rows,
        notes,
    )
