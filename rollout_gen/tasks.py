"""Tasks the agent solves, and loaders for the reference data layouts users point at local files."""
from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path

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
    """Open-AgentRL / verl style parquet: `prompt` (chat messages or text), `data_source`,
    `reward_model.ground_truth`; eval layouts (AIME24/25, GPQA-diamond, LiveCodeBench-v6) use the
    same fields, or flat `question`/`problem` + `answer` columns, which are accepted too."""
    path = Path(path)
    if not path.is_file():
        raise TaskFileError(f"{path}: task file does not exist")
    rows = pq.read_table(path).to_pylist()
    tasks: list[Task] = []
    for i, r in enumerate(rows):
        if "prompt" in r:
            question = _user_text(r["prompt"], path, i)
        elif "question" in r or "problem" in r:
            question = r.get("question") or r.get("problem")
        else:
            raise TaskFileError(f"{path}: row {i}: no 'prompt', 'question' or 'problem' field")
        rm = r.get("reward_model") or {}
        truth = rm.get("ground_truth") if isinstance(rm, dict) else None
        if truth is None:
            truth = r.get("answer")
        if truth is None:
            raise TaskFileError(f"{path}: row {i}: missing reward_model.ground_truth (or answer)")
        src = source or r.get("data_source") or path.stem
        kind = "code" if "code" in str(src).lower() or "livecodebench" in str(src).lower() else "math"
        if not isinstance(truth, str):
            truth = json.dumps(truth)
        tasks.append(Task(stable_id(src, question), src, question, truth, kind))
    return tasks
