"""Arithmetic tasks solved with the Python tool: the embedded default world."""

from __future__ import annotations

import itertools
import random
from typing import Iterator

from pipeline.config import WorldConfig
from rollout_gen.tasks import Task, stable_id

SINGLE_TEMPLATES = ["What is {e}?", "Compute {e}.", "Calculate the value of {e}.", "Evaluate {e}."]
TWO_STEP_TEMPLATES = [
    "First compute {e}, then {verb} the result {prep} {k}.",
    "Compute {e}. Then {verb} that result {prep} {k}.",
]
STEP_OPS = {"*": ("multiply", "by"), "+": ("add", "to"), "-": ("subtract", "from")}


def _number(rng: random.Random, cfg: WorldConfig) -> int:
    digits = rng.randint(cfg.digits_min, cfg.digits_max)
    return rng.randint(10 ** (digits - 1), 10**digits - 1)


def _expression(rng: random.Random, cfg: WorldConfig) -> str:
    n = rng.randint(cfg.operands_min, cfg.operands_max)
    parts = [str(_number(rng, cfg))]
    for _ in range(n - 1):
        parts += [rng.choice(cfg.ops), str(_number(rng, cfg))]
    return " ".join(parts)


def make_task(rng: random.Random, cfg: WorldConfig) -> Task:
    expr = _expression(rng, cfg)
    value = eval(expr, {"__builtins__": {}})  # our own generated arithmetic, never model output
    if rng.random() < cfg.two_step_fraction:
        op = rng.choice(list(STEP_OPS))
        verb, prep = STEP_OPS[op]
        k = _number(rng, cfg)
        question = rng.choice(TWO_STEP_TEMPLATES).format(e=expr, verb=verb, prep=prep, k=k)
        # "subtract the result from k" reads k - result; the others are commutative
        answer = k - value if op == "-" else (value * k if op == "*" else value + k)
    else:
        question = rng.choice(SINGLE_TEMPLATES).format(e=expr)
        answer = value
    return Task(stable_id("world", question), "world", question, str(answer))


def eval_tasks(cfg: WorldConfig) -> list[Task]:
    """The fixed held-out evaluation set (its own seed; training streams skip its questions)."""
    rng = random.Random(cfg.eval_seed)
    seen: dict[str, Task] = {}
    while len(seen) < cfg.eval_size:
        t = make_task(rng, cfg)
        seen.setdefault(t.question, t)
    return list(seen.values())


def task_stream(cfg: WorldConfig, seed: int) -> Iterator[Task]:
    """Training tasks for one seed, never one of the held-out questions."""
    held_out = {t.question for t in eval_tasks(cfg)}
    rng = random.Random(f"world-train-{seed}")
    while True:
        t = make_task(rng, cfg)
        if t.question not in held_out:
            yield t


def training_tasks(cfg: WorldConfig, n: int, seed: int) -> list[Task]:
    return list(itertools.islice(task_stream(cfg, seed), n))
