"""Outcome rewards (docs/saar.md) and DAPO overlong shaping.

Math (and GPQA letters): the last `\\boxed{` in the final 100 characters of the response, when it closes there, holds
the answer (pipeline/answers.py, as the CLEANER paper's scorer finds it), +1 when it matches the ground truth, else
−1. How it must match is `rollout.answer_match` (docs/eval.md, "Math answers"):

- `equivalent` (default): an answer that is the ground truth's string, or an integer equal to an integer ground
  truth, scores +1 at once; any other pair is decided by math-verify's equivalence check (`0.5` = `\\frac12` =
  `1/2`), run in a child process with a hard time limit (rollout_gen/math_verify_worker.py), so a pathological
  answer is a −1 with a logged warning, never a hang or an exception. A one-letter ground truth (A–J, GPQA) is
  matched against the box's letter, with or without `(...)` or `\\text{...}` around it.
- `exact`: the paper's own rule (verl's math_dapo with `strict_box_verify`): the box's text as written equals the
  ground truth's string.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from pipeline.answers import last_box, last_boxed
from rollout_gen import lcb
from rollout_gen.math_verify_worker import MathVerifier
from rollout_gen.tasks import Task

INTEGER = re.compile(r"-?\d+")
LETTER = re.compile(r"[A-J]")
LETTER_WRAPPERS = re.compile(r"\\(?:text|textbf|textrm|mathrm|mathbf)\s*\{([^{}]*)\}")
VERIFIER = MathVerifier()


def _letter(answer: str) -> str | None:
    while (unwrapped := LETTER_WRAPPERS.sub(r"\1", answer)) != answer:
        answer = unwrapped
    answer = answer.strip().rstrip(".").strip()
    if len(answer) >= 3 and answer[0] + answer[-1] in ("()", "[]"):
        answer = answer[1:-1].strip()
    return answer.upper() if LETTER.fullmatch(answer.upper()) else None


def _integer(digits: str) -> str:
    """An integer's canonical digits (no leading zeros, no sign on zero), without int()'s length limit."""
    sign, digits = ("-", digits[1:]) if digits.startswith("-") else ("", digits)
    digits = digits.lstrip("0")
    return sign + digits if digits else "0"


def answers_match(answer: str, ground_truth: str) -> bool:
    gold = ground_truth.strip()
    if answer == gold:
        return True
    if LETTER.fullmatch(gold):  # a multiple-choice letter: no algebra to do
        return _letter(answer) == gold
    if INTEGER.fullmatch(answer) and INTEGER.fullmatch(gold):
        return _integer(answer) == _integer(gold)  # what math-verify decides for two integers, without the round trip
    return VERIFIER.equal(gold, answer) is True


def math_reward(response_text: str, ground_truth: str, answer_match: str = "equivalent") -> float:
    if answer_match == "exact":
        return 1.0 if last_box(response_text) == ground_truth else -1.0
    answer = last_boxed(response_text)
    return 1.0 if answer is not None and answers_match(answer, ground_truth) else -1.0


@dataclass(frozen=True)
class RewardOutcome:
    """A reward and, when it is not full marks for a reason worth keeping, why (a code task's first failed
    test, tests that cannot be decoded, a program that flooded its output or tried to fork)."""

    value: float
    reason: str = ""


def code_reward(response_text: str, ground_truth: str, sandbox) -> float:
    """Share of the tests passed, each judged as LiveCodeBench's harness judges it (rollout_gen/lcb.py; the
    program runs in the sandbox, the comparison happens here); 1.0 is a problem LiveCodeBench counts as solved;
    −1 without a code block; 0 when the tests cannot be decoded."""
    return lcb.score(response_text, ground_truth, sandbox)


def reward_outcome(task: Task, response_text: str, sandbox=None, answer_match: str = "equivalent") -> RewardOutcome:
    """The reward with its reason. The reward is decided from the response text and, for code, from what the
    program printed or returned; the ground truth never reaches the sandbox (docs/sandbox.md). `answer_match`:
    rollout.answer_match, how a math or GPQA box must match."""
    if task.kind == "code":
        verdict = lcb.judge(response_text, task.ground_truth, sandbox)
        return RewardOutcome(verdict.score, verdict.reason)
    return RewardOutcome(math_reward(response_text, task.ground_truth, answer_match))


def reward(task: Task, response_text: str, sandbox=None, answer_match: str = "equivalent") -> float:
    return reward_outcome(task, response_text, sandbox, answer_match).value


def overlong_penalty(response_tokens: int, max_tokens: int, buffer: int) -> float:
    """DAPO soft overlong punishment: 0 until max−buffer, then linear down to −1 at max."""
    start = max_tokens - buffer
    if buffer <= 0 or response_tokens <= start:
        return 0.0
    return -min(1.0, (response_tokens - start) / buffer)
