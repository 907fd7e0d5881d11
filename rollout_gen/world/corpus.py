"""The SFT corpus of the tool-use world: transcripts whose tool responses come from really running
the code in the project's sandbox. About a third of first calls carry a realistic bug, followed by
the real failure response and a retry that is a near-copy fix (same reasoning: what SAAR splices
shallowly) or a rewrite with new reasoning (deep); retries sometimes fail again.
"""

from __future__ import annotations

import random
import re
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from pipeline.chat import IM_END, ChatFormat, render_tool_call, tool_response_turn
from rollout_gen.sandbox import SandboxPool
from rollout_gen.tasks import Task
from rollout_gen.world.tasks import STEP_OPS

FIRST_REASONING = [
    "I will compute {e} with Python.",
    "Let me evaluate the expression in Python.",
    "I'll use the tool to calculate {e}.",
    "Let me calculate this with code.",
]
REWRITE_REASONING = [
    "That failed. Let me write the computation differently.",
    "The code had an error, so I will rewrite it step by step.",
    "Let me try another way to compute {e}.",
]
STEP_REASONING = ["The first result is {x}. Now I {verb} it {prep} {k}.", "Now I use {x} for the second step."]
FINAL = ["The answer is \\boxed{{{v}}}.", "So the result is \\boxed{{{v}}}."]
BUGS = ["misspelled_print", "missing_paren", "undefined_name", "made_up_method"]


@dataclass
class Transcript:
    task: Task
    segments: list[tuple[str, bool]] = field(default_factory=list)  # (text, trained) after the prompt
    first_call_failed: int = 0
    retries: int = 0
    deep_retries: int = 0


def code_for(expr: str, style: int) -> str:
    if style == 0:
        return f"print({expr})"
    if style == 1:
        return f"result = {expr}\nprint(result)"
    names = iter("abcdefgh")
    lines = []

    def name_number(m: re.Match) -> str:
        n = next(names)
        lines.append(f"{n} = {m.group(0)}")
        return n

    body = re.sub(r"\d+", name_number, expr)
    return "\n".join(lines + [f"print({body})"])


def inject_bug(code: str, bug: str, rng: random.Random) -> str:
    if bug == "misspelled_print":
        return code.replace("print(", rng.choice(["prnt(", "pirnt(", "printt("]), 1)
    if bug == "missing_paren":
        return code[: code.rindex(")")] + code[code.rindex(")") + 1 :]
    if bug == "undefined_name":
        if "result" in code:
            return code.replace("print(result)", rng.choice(["print(reslt)", "print(res)", "print(answer)"]))
        return (
            code.replace("print(", "print(value + 0 * (", 1) + ")"
            if "=" not in code
            else code.replace("print(", "print(z + ", 1)
        )
    return (
        code.replace("print(", "print((", 1).replace(")", ").compute())", 1)
        if code.startswith("print(")
        else (code.replace("print(", "print(int.evaluate(", 1) + ")")
    )


def _turn(reasoning: str, code: str) -> str:
    return f"{reasoning}\n{render_tool_call(code)}{IM_END}"


def _stdout_value(text: str) -> str | None:
    m = re.search(r"stdout: (-?\d+)", text)
    return m.group(1) if m else None


def _position(
    rng: random.Random, pool: SandboxPool, t: Transcript, expr: str, reasoning: str, bug_rate: float, first: bool
) -> str | None:
    """Calls until one succeeds (or gives up); returns the printed value."""
    style = rng.randrange(3)
    bugged = rng.random() < bug_rate
    code = code_for(expr, style)
    attempt = inject_bug(code, rng.choice(BUGS), rng) if bugged else code
    for retry in range(4):
        t.segments.append((_turn(reasoning, attempt), True))
        result = pool.run(attempt)
        t.segments.append((tool_response_turn(result.text), False))
        if result.status == "success":
            return _stdout_value(result.text)
        if retry == 0 and first:
            t.first_call_failed = 1
        t.retries += 1
        if rng.random() < 0.5:  # near-copy fix: same reasoning, same style, bug removed
            attempt = code
        else:  # rewrite: new reasoning and another code style
            t.deep_retries += 1
            reasoning = rng.choice(REWRITE_REASONING).format(e=expr)
            style = (style + rng.randint(1, 2)) % 3
            attempt = code = code_for(expr, style)
        if rng.random() < 0.12:  # the retry fails again, with another bug
            attempt = inject_bug(attempt, rng.choice(BUGS), rng)
    return None


def make_transcript(task: Task, rng: random.Random, pool: SandboxPool, bug_rate: float = 1 / 3) -> Transcript:
    t = Transcript(task)
    q = task.question
    m = re.match(r"(?:First compute|Compute) (.+?)[,.] [Tt]hen (\w+) (?:that|the) result (\w+) (\d+)\.", q)
    expr = m.group(1) if m else re.search(r"(?:is|Compute|of|Evaluate) (.+?)[?.]$", q).group(1)
    value = _position(rng, pool, t, expr, rng.choice(FIRST_REASONING).format(e=expr), bug_rate, first=True)
    if value is not None and m:
        verb, k = m.group(2), m.group(4)
        op = next(o for o, (v, _) in STEP_OPS.items() if v == verb)
        step_expr = f"{k} - {value}" if op == "-" else f"{value} {op} {k}"
        reasoning = rng.choice(STEP_REASONING).format(x=value, verb=verb, prep=STEP_OPS[op][1], k=k)
        value = _position(rng, pool, t, step_expr, reasoning, bug_rate / 2, first=False)
    t.segments.append((rng.choice(FINAL).format(v=value if value is not None else "unknown") + IM_END, True))
    return t


def build_transcripts(tasks: list[Task], pool: SandboxPool, seed: int, bug_rate: float = 1 / 3) -> list[Transcript]:
    def one(i: int) -> Transcript:
        return make_transcript(tasks[i], random.Random(f"{seed}-{i}"), pool, bug_rate)

    with ThreadPoolExecutor(max_workers=max(1, pool.cfg.workers)) as ex:
        return list(ex.map(one, range(len(tasks))))


def tokenize_transcript(t: Transcript, chat: ChatFormat) -> tuple[list[int], list[int]]:
    """Token ids and loss mask, built piecewise exactly as the agent loop appends turns."""
    ids = chat.prompt_ids(t.task.question)
    mask = [0] * len(ids)
    for text, trained in t.segments:
        seg = chat.encode(text)
        ids += seg
        mask += [int(trained)] * len(seg)
    return ids, mask
