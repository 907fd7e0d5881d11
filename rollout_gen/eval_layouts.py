"""The published evaluation layouts, read as tasks, with one-line errors naming the file and the column.

Open-AgentRL-Eval (Gen-Verse/Open-AgentRL-Eval: aime2024/aime_2024_problems.parquet, aime2025/
aime_2025_problems.parquet, gpqa-diamond/gpqa_diamond.parquet, livecodebench-v6/lcb_v6_2502_2505.parquet) is
told apart by its `data_source` value, as the reference's dataset class (recipe/demystify/reward.py,
CustomRLHFDataset) tells them apart; the columns are the ones that class reads:
  AIME2024          Problem, Answer
  AIME2025          problem, answer
  gpqa_diamond      problem, solution (the answer letter), domain
  LiveCodeBench_v6  problem, reward_model (JSON text: ground_truth = {inputs, outputs, fn_name?}), extra_info
LiveCodeBench's own code_generation_lite rows (question_id, question_content, public_test_cases,
private_test_cases, metadata with func_name, starter_code, platform, …) are read as LiveCodeBench reads them
(lcb_runner/benchmarks/code_generation.py). The questions are used as they are: the reference wraps them in
its own instructions, which a checkpoint's chat template or a task file of built prompts can carry.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import pyarrow as pa

from rollout_gen.lcb import CodeTests, LCBFormatError, code_tests, decode_test_cases


class LayoutError(ValueError):
    """A file that does not fit the layout it is in: one line naming the file, row and column."""


@dataclass(frozen=True)
class Row:
    """One task as the layout reads it (tasks.py names it and makes the Task)."""

    source: str
    question: str
    ground_truth: str
    kind: str  # "math" or "code"


KINDS: dict[str, tuple[str, Callable[[pa.DataType], bool]]] = {
    "text": ("a string", lambda t: pa.types.is_string(t) or pa.types.is_large_string(t)),
    "answer": (
        "a string or an integer",
        lambda t: pa.types.is_string(t) or pa.types.is_large_string(t) or pa.types.is_integer(t),
    ),
    "json": (
        "a JSON string or a struct",
        lambda t: pa.types.is_string(t) or pa.types.is_large_string(t) or pa.types.is_struct(t),
    ),
}


@dataclass(frozen=True)
class Layout:
    name: str
    source: str  # the benchmark's name when a file has no data_source column
    required: dict[str, str]  # column -> kind
    optional: dict[str, str]
    build: Callable[[dict, str], Row]  # (row, data_source) -> Row; raises ValueError naming the column

    def check(self, schema: pa.Schema, path: Path) -> None:
        for column in self.required:
            if column not in schema.names:
                raise LayoutError(
                    f"{path}: missing column '{column}' (the {self.name} layout needs {', '.join(self.required)})"
                )
        for column, kind in {**self.required, **self.optional}.items():
            if column in schema.names:
                want, ok = KINDS[kind]
                if not ok(schema.field(column).type):
                    raise LayoutError(
                        f"{path}: column '{column}' is {schema.field(column).type}, expected {want} "
                        f"(the {self.name} layout)"
                    )

    def load(self, table: pa.Table, path: Path, source: str | None) -> list[Row]:
        self.check(table.schema, path)
        tasks = []
        for i, row in enumerate(pylist(table, path)):
            for column in self.required:
                value = row[column]  # blank text too: a "  " answer matched an empty box
                if value is None or (isinstance(value, str) and not value.strip()):
                    raise LayoutError(f"{path}: row {i}: column '{column}' is empty")
            try:
                tasks.append(self.build(row, source or row.get("data_source") or self.source))
            except (ValueError, LCBFormatError) as e:
                raise LayoutError(f"{path}: row {i}: {e}") from None
        return tasks


def pylist(table: pa.Table, path: Path) -> list[dict]:
    """The rows as Python objects; text that is not UTF-8 is one LayoutError naming the row and column (it was
    a UnicodeDecodeError traceback)."""
    try:
        return table.to_pylist()
    except UnicodeDecodeError:
        for name in table.column_names:
            column = table.column(name)
            for i in range(len(column)):
                try:
                    column[i].as_py()
                except UnicodeDecodeError:
                    raise LayoutError(f"{path}: row {i}: column {name!r} holds text that is not UTF-8") from None
        raise


def _math(question: str, answer: Any, source: str) -> Row:
    return Row(source, question, str(answer).strip(), "math")


def _letter(row: dict, source: str) -> Row:
    letter = str(row["solution"]).strip().strip("()").upper()
    if len(letter) != 1 or not "A" <= letter <= "J":
        raise ValueError(f"column 'solution' is {row['solution']!r}, expected the answer letter (A to J)")
    return _math(row["problem"], letter, source)


def _json_field(row: dict, column: str) -> Any:
    value = row.get(column)
    if isinstance(value, str):
        try:
            return json.loads(value)
        except json.JSONDecodeError as e:
            raise ValueError(f"column '{column}' is not JSON ({e})") from None
    return value


def _code(question: str, tests: CodeTests, source: str) -> Row:
    if not tests.inputs:
        raise ValueError("no tests")
    return Row(source, question, tests.to_json(), "code")


def _lcb_v6(row: dict, source: str) -> Row:
    rm = _json_field(row, "reward_model")
    truth = rm.get("ground_truth") if isinstance(rm, dict) else None
    if isinstance(truth, str):
        truth = _json_field({"ground_truth": truth}, "ground_truth")
    if (
        not isinstance(truth, dict)
        or not isinstance(truth.get("inputs"), list)
        or not isinstance(truth.get("outputs"), list)
    ):
        raise ValueError("column 'reward_model' has no ground_truth {inputs: [...], outputs: [...]}")
    if len(truth["inputs"]) != len(truth["outputs"]):
        raise ValueError(f"column 'reward_model': {len(truth['inputs'])} inputs but {len(truth['outputs'])} outputs")
    extra = _json_field(row, "extra_info")
    qid = extra.get("question_id") if isinstance(extra, dict) else None
    return _code(row["problem"], code_tests(truth["inputs"], truth["outputs"], truth.get("fn_name"), qid), source)


def _lcb_native(row: dict, source: str) -> Row:
    tests = []
    for column in ("public_test_cases", "private_test_cases"):
        try:
            tests += decode_test_cases(row[column])
        except LCBFormatError as e:
            raise ValueError(f"column '{column}': {e}") from None
    meta = _json_field(row, "metadata")
    if not isinstance(meta, dict):
        raise ValueError("column 'metadata' is not a JSON object")
    fn = meta.get("func_name")
    question = row["question_content"]
    starter = (row.get("starter_code") or "").strip()
    if starter:  # call-based problems name their method in the starter code; the model needs it
        question += f"\n\nComplete this starter code:\n```python\n{starter}\n```"
    return _code(
        question,
        CodeTests(
            [str(t["input"]) for t in tests],
            [str(t["output"]) for t in tests],
            str(fn) if fn else None,
            str(row["question_id"]),
        ),
        source,
    )


AIME24 = Layout(
    "Open-AgentRL-Eval AIME2024",
    "AIME2024",
    {"Problem": "text", "Answer": "answer"},
    {"data_source": "text"},
    lambda r, s: _math(r["Problem"], r["Answer"], s),
)
AIME25 = Layout(
    "Open-AgentRL-Eval AIME2025",
    "AIME2025",
    {"problem": "text", "answer": "answer"},
    {"data_source": "text"},
    lambda r, s: _math(r["problem"], r["answer"], s),
)
GPQA = Layout(
    "Open-AgentRL-Eval gpqa_diamond",
    "gpqa_diamond",
    {"problem": "text", "solution": "text"},
    {"domain": "text", "data_source": "text"},
    _letter,
)
LCB_V6 = Layout(
    "Open-AgentRL-Eval LiveCodeBench_v6",
    "LiveCodeBench_v6",
    {"problem": "text", "reward_model": "json"},
    {"extra_info": "json", "data_source": "text", "ability": "text"},
    _lcb_v6,
)
LCB = Layout(
    "LiveCodeBench code_generation_lite",
    "livecodebench",
    {
        "question_id": "answer",
        "question_content": "text",
        "public_test_cases": "text",
        "private_test_cases": "text",
        "metadata": "json",
    },
    {"starter_code": "text", "platform": "text", "question_title": "text", "difficulty": "text"},
    _lcb_native,
)
BY_DATA_SOURCE = {"aime2024": AIME24, "aime2025": AIME25, "gpqa_diamond": GPQA, "livecodebench_v6": LCB_V6}
LCB_COLUMNS = {"question_id", "question_content", "public_test_cases", "private_test_cases"}


def detect(table: pa.Table) -> Layout | None:
    """The layout a table is in; None for the generic ones tasks.py reads (verl `prompt` + reward_model,
    flat question/problem + answer). Files of built prompts (a `prompt` column) stay generic."""
    names = set(table.column_names)
    if names & LCB_COLUMNS:
        return LCB
    if "prompt" in names:
        return None
    if "data_source" in names and table.num_rows and KINDS["text"][1](table.schema.field("data_source").type):
        layout = BY_DATA_SOURCE.get(str(table.column("data_source")[0].as_py() or "").lower())
        if layout is not None:
            return layout
    if names & {"Problem", "Answer"}:
        return AIME24
    return None
