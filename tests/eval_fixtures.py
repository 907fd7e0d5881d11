"""Tiny task files in the published evaluation layouts, with exactly their columns (rollout_gen/eval_layouts.py
says where each layout's columns come from), written by the tests that need them."""

from __future__ import annotations

import base64
import json
import pickle
import zlib
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

STDIN_SUM = "lcb_sum"  # a + b on stdin (AtCoder style)
CALL_PAIR = "3001"  # LeetCode style: Solution().topTwo(nums, k)
STDIN_LOOP = "lcb_echo"  # echo a line: the fixture a looping program times out on

# code_generation_lite's columns, in LiveCodeBench's order (lcb_runner/benchmarks/code_generation.py)
LCB_COLUMNS = [
    "question_title",
    "question_content",
    "platform",
    "question_id",
    "contest_id",
    "contest_date",
    "starter_code",
    "difficulty",
    "public_test_cases",
    "private_test_cases",
    "metadata",
]


def _tests(pairs: list[tuple[str, str]], kind: str) -> list[dict]:
    return [{"input": i, "output": o, "testtype": kind} for i, o in pairs]


def _compressed(tests: list[dict]) -> str:
    """How code_generation_lite stores private tests from release v2 on: JSON, pickled, zlib, base64."""
    return base64.b64encode(zlib.compress(pickle.dumps(json.dumps(tests)))).decode()


def lcb_rows() -> list[dict]:
    return [
        {
            "question_title": "Sum",
            "question_content": "Read a and b and print a + b.",
            "platform": "atcoder",
            "question_id": STDIN_SUM,
            "contest_id": "abc999",
            "contest_date": "2025-03-01T00:00:00",
            "starter_code": "",
            "difficulty": "easy",
            "public_test_cases": json.dumps(_tests([("1 2\n", "3\n")], "stdin")),
            "private_test_cases": _compressed(_tests([("10 20\n", "30\n"), ("-5 5\n", "0\n")], "stdin")),
            "metadata": json.dumps({}),
        },
        {
            "question_title": "Top two",
            "question_content": "Return the k largest numbers, largest first.",
            "platform": "leetcode",
            "question_id": CALL_PAIR,
            "contest_id": "weekly-contest-400",
            "contest_date": "2025-04-01T00:00:00",
            "starter_code": "class Solution:\n    def topTwo(self, nums: List[int], k: int) -> List[int]:\n        ",
            "difficulty": "medium",
            "public_test_cases": json.dumps(_tests([("[1, 5, 3]\n2", "[5, 3]")], "functional")),
            "private_test_cases": json.dumps(
                _tests([("[4]\n1", "[4]"), ("[2, 9, 7, 1]\n3", "[9, 7, 2]")], "functional")
            ),
            "metadata": json.dumps({"func_name": "topTwo"}),
        },
        {
            "question_title": "Echo",
            "question_content": "Print the line you read.",
            "platform": "codeforces",
            "question_id": STDIN_LOOP,
            "contest_id": "2050",
            "contest_date": "2025-05-01T00:00:00",
            "starter_code": "",
            "difficulty": "hard",
            "public_test_cases": json.dumps(_tests([("hi\n", "hi\n")], "stdin")),
            "private_test_cases": json.dumps(_tests([("a b\n", "a b\n"), ("x\n", "x\n")], "stdin")),
            "metadata": json.dumps({}),
        },
    ]


def write(path: Path, rows: list[dict], schema: pa.Schema | None = None) -> Path:
    pq.write_table(pa.Table.from_pylist(rows, schema=schema), path)
    return path


def lcb_file(path: Path) -> Path:
    schema = pa.schema([(c, pa.string()) for c in LCB_COLUMNS])
    return write(path, lcb_rows(), schema)


def aime24_file(path: Path) -> Path:
    """Open-AgentRL-Eval aime2024/aime_2024_problems.parquet: Problem, Answer (an integer), data_source."""
    return write(
        path,
        [
            {"data_source": "AIME2024", "Problem": "What is 40 + 2?", "Answer": 42},
            {"data_source": "AIME2024", "Problem": "What is 3 * 7?", "Answer": 21},
        ],
    )


def aime25_file(path: Path) -> Path:
    return write(path, [{"data_source": "AIME2025", "problem": "What is 100 - 1?", "answer": "99"}])


def gpqa_file(path: Path) -> Path:
    return write(
        path,
        [
            {
                "data_source": "gpqa_diamond",
                "problem": "Which is a noble gas? (A) N (B) Ne (C) Na (D) Ni",
                "solution": "B",
                "domain": "Chemistry",
            }
        ],
    )


def lcb_v6_file(path: Path, with_question_id: bool = True) -> Path:
    """Open-AgentRL-Eval livecodebench-v6: problem, reward_model and extra_info as JSON text."""
    truth = {"inputs": ["1 2\n", "10 20\n"], "outputs": ["3\n", "30\n"]}
    extra = {"question_id": "abc400_a"} if with_question_id else {}
    return write(
        path,
        [
            {
                "data_source": "LiveCodeBench_v6",
                "problem": "Read a and b and print a + b.",
                "reward_model": json.dumps({"ground_truth": truth, "style": "rule"}),
                "ability": "code",
                "extra_info": json.dumps(extra),
            }
        ],
    )
