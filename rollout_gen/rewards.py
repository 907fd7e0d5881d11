"""Outcome rewards (SAAR.md §7) and DAPO overlong shaping."""
from __future__ import annotations

import json
import re

from rollout_gen.tasks import Task

BOXED = re.compile(r"\\boxed\{([^{}]*)\}")


def last_boxed(text: str, window: int = 100) -> str | None:
    """The last `\\boxed{...}` that appears in the final `window` characters of the response."""
    matches = list(BOXED.finditer(text[-window:]))
    return matches[-1].group(1).strip() if matches else None


def math_reward(response_text: str, ground_truth: str) -> float:
    answer = last_boxed(response_text)
    return 1.0 if answer is not None and answer == ground_truth.strip() else -1.0


CODE_BLOCK = re.compile(r"```(?:python)?\n(.*?)```", re.S)


def code_reward(response_text: str, ground_truth: str, sandbox) -> float:
    """Fraction of tests passed (each `{"input": stdin, "output": expected}`); −1 without a code block."""
    blocks = CODE_BLOCK.findall(response_text)
    if not blocks:
        return -1.0
    try:
        tests = json.loads(ground_truth)
    except json.JSONDecodeError:
        return -1.0
    if not tests:
        return -1.0
    program = blocks[-1]
    codes = [
        f"import sys, io\nsys.stdin = io.StringIO({t.get('input', '')!r})\n" + program for t in tests
    ]
    results = sandbox.run_many(codes)
    passed = sum(r.status == "success" and r.text.split("stdout: ", 1)[-1].strip() == str(t.get("output", "")).strip()
                 for r, t in zip(results, tests))
    return passed / len(tests)


def reward(task: Task, response_text: str, sandbox=None) -> float:
    if task.kind == "code":
        return code_reward(response_text, task.ground_truth, sandbox)
    return math_reward(response_text, task.ground_truth)


def overlong_penalty(response_tokens: int, max_tokens: int, buffer: int) -> float:
    """DAPO soft overlong punishment: 0 until max−buffer, then linear down to −1 at max."""
    start = max_tokens - buffer
    if buffer <= 0 or response_tokens <= start:
        return 0.0
    return -min(1.0, (response_tokens - start) / buffer)
