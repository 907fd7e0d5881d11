"""Tasks the agent solves, and loaders for the reference data layouts users point at local files."""

from __future__ import annotations

import hashlib
import json
import math
from dataclasses import dataclass
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from storage.errors import CleanerError


@dataclass(frozen=True)
class Task:
    prompt_id: str
    source: str  # data_source: "world", "aime24", "gpqa_diamond", "livecodebench", ...
    question: str
    ground_truth: str  # the answer, or a JSON list of code tests for code tasks
    kind: str = "math"  # "math" (boxed answer) or "code" (tests run in the sandbox)


def stable_id(source: str, question: str) -> str:
    return source + "-" + hashlib.blake2b(question.encode(), digest_size=6).hexdigest()


ALL = "all"  # the overall group of the per-benchmark metrics


def code_tests_problem(truth: str) -> str | None:
    """A code task's ground truth is tests LiveCodeBench's way ({inputs, outputs} or [{input, output}] JSON):
    "" for a test list, None for an answer that is not one, else why a ground truth shaped as tests (JSON with
    inputs/outputs) is not a usable test list."""
    from rollout_gen.lcb import LCBFormatError, parse_tests

    try:
        parse_tests(truth)
    except LCBFormatError as e:
        try:
            data = json.loads(truth)
        except ValueError:
            text = truth.strip() if isinstance(truth, str) else ""
            # shaped as tests but cut or malformed: scored as a math answer, every sample failed without a word
            looks_like_tests = text[:1] in "{[" and text[:1] != "" and ('"inputs"' in text or '"input"' in text)
            return str(e) if looks_like_tests else None
        shaped = (
            isinstance(data, dict)
            and {"inputs", "outputs"} & set(data)
            or isinstance(data, list)
            and any(isinstance(x, dict) and {"input", "output"} & set(x) for x in data)
        )
        return str(e) if shaped else None
    return ""


class TaskFileError(CleanerError, ValueError):
    """A task file that does not have the expected layout; names the file, row and field."""


def _user_text(prompt: object, path: Path, row: int) -> str:
    if isinstance(prompt, str):
        return prompt
    if isinstance(prompt, (list, tuple)):
        users = [m.get("content") for m in prompt if isinstance(m, dict) and m.get("role") == "user"]
        if users and isinstance(users[-1], str):
            return users[-1]
    raise TaskFileError(f"{path}: row {row}: field 'prompt' has no user message")


def load_task_parquet(path: str | Path, source: str | None = None) -> list[Task]:
    """A task file: one of the published evaluation layouts (rollout_gen/eval_layouts.py: Open-AgentRL-Eval
    AIME24/25, GPQA-diamond, LiveCodeBench-v6; LiveCodeBench's code_generation_lite), or Open-AgentRL / verl
    style: `prompt` (chat messages or text), `data_source`, `reward_model.ground_truth`, or flat
    `question`/`problem` + `answer` columns."""
    from rollout_gen.eval_layouts import LayoutError, detect, pylist

    path = Path(path)
    if not path.is_file():
        raise TaskFileError(
            f"{path}: "
            + (
                "is a folder; give the task file in it (a .parquet file)"
                if path.is_dir()
                else "task file does not exist"
            )
        )
    try:
        table = pq.read_table(path)
    except (pa.ArrowException, OSError) as e:
        raise TaskFileError(
            f"{path}: not a readable Parquet file ({' '.join(str(e).split())[:200]})"
            + (
                "; task files are read as Parquet only (convert JSONL with pyarrow or pandas first)"
                if path.suffix.lower() in (".jsonl", ".json")
                else ""
            )
        ) from None
    if table.num_rows == 0:
        raise TaskFileError(f"{path}: no rows (an empty task file)")
    layout = detect(table)
    if layout is not None:
        try:
            rows = layout.load(table, path, source)
        except LayoutError as e:
            raise TaskFileError(str(e)) from None
        return _distinct(
            path, [Task(stable_id(r.source, r.question), r.source, r.question, r.ground_truth, r.kind) for r in rows]
        )
    try:
        rows = pylist(table, path)
    except LayoutError as e:
        raise TaskFileError(str(e)) from None
    tasks: list[Task] = []
    for i, r in enumerate(rows):
        if "prompt" in r:
            question = _user_text(r["prompt"], path, i)
        elif "question" in r or "problem" in r:
            column = "question" if "question" in r else "problem"
            question = r[column]
            if not isinstance(question, str):
                raise TaskFileError(
                    f"{path}: row {i}: column {column!r} is "
                    + ("empty (null)" if question is None else f"a {type(question).__name__}, expected a string")
                )
        else:
            raise TaskFileError(f"{path}: row {i}: no 'prompt', 'question' or 'problem' field")
        if not question.strip():
            raise TaskFileError(f"{path}: row {i}: the question is empty")
        rm = r.get("reward_model") or {}
        if isinstance(rm, str):  # stored as JSON text, as some exports do
            try:
                rm = json.loads(rm)
            except ValueError:
                raise TaskFileError(f"{path}: row {i}: reward_model is text that is not JSON") from None
        truth = rm.get("ground_truth") if isinstance(rm, dict) else None
        if truth is None:
            truth = r.get("answer")
        if truth is None:
            raise TaskFileError(f"{path}: row {i}: missing reward_model.ground_truth (or answer)")
        if isinstance(truth, float) and not math.isfinite(truth) or isinstance(truth, str) and not truth.strip():
            # an empty answer would reward an empty \boxed{}
            raise TaskFileError(f"{path}: row {i}: the answer is empty ({truth!r})")
        src = source or r.get("data_source") or path.stem
        if src == ALL:
            raise TaskFileError(
                f"{path}: row {i}: data_source {ALL!r} is the name of the overall group in the "
                "metrics; name the benchmark otherwise"
            )
        if not isinstance(truth, str):
            truth = json.dumps(truth)
        problem = code_tests_problem(truth)
        if problem:
            raise TaskFileError(f"{path}: row {i}: the answer reads as code tests but {problem}")
        kind = "code" if problem == "" else "math"  # what the ground truth is, whatever the source's name
        tasks.append(Task(stable_id(src, question), src, question, truth, kind))
    return _distinct(path, tasks)


def _distinct(path: Path, tasks: list[Task]) -> list[Task]:
    """The file's tasks, a row repeating an earlier one (the same question and source, the same answer) counted
    once: two copies in one iteration would be two rows with one key. The same question with another answer is
    refused."""
    first: dict[str, int] = {}
    out: list[Task] = []
    for i, t in enumerate(tasks):
        if t.prompt_id not in first:
            first[t.prompt_id] = i
            out.append(t)
        elif tasks[first[t.prompt_id]].ground_truth != t.ground_truth:
            raise TaskFileError(
                f"{path}: row {i}: the question of row {first[t.prompt_id]} with another answer "
                f"({t.ground_truth[:40]!r} vs {tasks[first[t.prompt_id]].ground_truth[:40]!r})"
            )
    return out
