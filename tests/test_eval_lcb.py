"""LiveCodeBench scored as LiveCodeBench scores it (rollout_gen/lcb.py), on fixture problems in its own
code_generation_lite layout, in the real sandbox; its custom-evaluation export read back by a reader written
from its format (lcb_runner/runner/custom_evaluator.py); the Open-AgentRL-Eval layouts."""

from __future__ import annotations

import base64
import json
import os
import pickle
import time
import zlib
from pathlib import Path
from types import SimpleNamespace

import pytest

from pipeline.config import SandboxConfig
from rollout_gen.eval_run import question_id
from rollout_gen.evaluate import solved
from rollout_gen.lcb import TIME_LIMIT_S, CodeTests, LCBFormatError, custom_output, parse_tests, run_tests
from rollout_gen.rewards import reward
from rollout_gen.sandbox import SandboxPool
from rollout_gen.tasks import load_task_parquet
from tests.eval_fixtures import (
    CALL_PAIR,
    STDIN_LOOP,
    STDIN_SUM,
    aime24_file,
    aime25_file,
    gpqa_file,
    lcb_file,
    lcb_rows,
    lcb_v6_file,
)


@pytest.fixture(scope="module")
def quick_sandbox():
    """The real sandbox pool; LiveCodeBench rows run under the harness's own limits (rollout_gen/lcb.py)."""
    with SandboxPool(SandboxConfig(timeout_s=1.0)) as pool:
        yield pool


@pytest.fixture(scope="module")
def lcb(tmp_path_factory) -> tuple[dict, Path]:
    path = lcb_file(tmp_path_factory.mktemp("lcb") / "lcb.parquet")
    return {question_id(t): t for t in load_task_parquet(path)}, path


def answer(code: str) -> str:
    return f"I will read the input and compute it.\n```python\n{code}\n```\nThat is my solution."


def read_custom_output(path: Path, benchmark_ids: list[str]) -> dict[str, list[str]]:
    """What LiveCodeBench's custom_evaluator does with --custom_output_file for codegeneration: a list as long as
    the benchmark, of dicts; their code_list sorted by str(question_id), zipped with the benchmark's problems
    sorted by question_id."""
    custom_outputs = json.loads(path.read_text())
    assert isinstance(custom_outputs, list)
    assert len(custom_outputs) == len(benchmark_ids), f"{len(custom_outputs)} != {len(benchmark_ids)}"
    assert all(isinstance(o, dict) for o in custom_outputs)
    codes = [o["code_list"] for o in sorted(custom_outputs, key=lambda x: str(x["question_id"]))]
    assert all(isinstance(c, list) and all(isinstance(x, str) for x in c) for c in codes)
    return dict(zip(sorted(benchmark_ids), codes))


def test_code_generation_lite_rows_become_code_tasks(lcb):
    tasks, _ = lcb
    assert set(tasks) == {STDIN_SUM, CALL_PAIR, STDIN_LOOP}
    total = parse_tests(tasks[STDIN_SUM].ground_truth)
    # public tests, then the private ones decoded from base64 / zlib / pickle
    assert total == CodeTests(["1 2\n", "10 20\n", "-5 5\n"], ["3\n", "30\n", "0\n"], None, STDIN_SUM)
    call = parse_tests(tasks[CALL_PAIR].ground_truth)
    assert call.fn_name == "topTwo" and len(call.inputs) == 3
    assert "def topTwo(self" in tasks[CALL_PAIR].question  # the starter code names the method
    assert all(t.kind == "code" and t.source == "livecodebench" for t in tasks.values())


def test_all_pass_scores_one_and_counts_as_solved(lcb, quick_sandbox):
    task = lcb[0][STDIN_SUM]
    text = answer("import sys\na, b = map(int, sys.stdin.buffer.read().split())\nprint(a + b)")
    score = reward(task, text, quick_sandbox)
    assert score == 1.0 and solved(SimpleNamespace(reward=score), task.kind)


def test_a_partial_pass_scores_zero_as_livecodebench_counts_it(lcb, quick_sandbox):
    task = lcb[0][STDIN_SUM]
    text = answer("a, b = map(int, input().split())\nprint(a + b if a > 0 else 1)")  # wrong on the negative case
    score = reward(task, text, quick_sandbox)
    assert score == pytest.approx(2 / 3)  # the training reward keeps the share of tests passed …
    assert not solved(SimpleNamespace(reward=score), task.kind)  # … the problem is not solved: pass@k counts 0


def test_call_based_tests_call_the_solution_method(lcb, quick_sandbox):
    task = lcb[0][CALL_PAIR]
    good = "class Solution:\n    def topTwo(self, nums, k):\n        return tuple(sorted(nums, reverse=True)[:k])"
    assert reward(task, answer(good), quick_sandbox) == 1.0  # a tuple is compared as a list
    bare = "def topTwo(nums, k):\n    return sorted(nums)[-k:][::-1]"  # no class: the module's function
    assert reward(task, answer(bare), quick_sandbox) == 1.0
    wrong = "class Solution:\n    def topTwo(self, nums, k):\n        return [0] * k"
    assert reward(task, answer(wrong), quick_sandbox) == 0.0
    renamed = "class Solution:\n    def top(self, nums, k):\n        return sorted(nums, reverse=True)[:k]"
    assert run_tests(renamed, parse_tests(task.ground_truth), quick_sandbox)[0].why == "no function topTwo"


def test_a_program_past_the_time_limit_fails_and_ends_the_run(lcb, quick_sandbox):
    task = lcb[0][STDIN_LOOP]
    assert reward(task, answer("print(input())"), quick_sandbox) == 1.0
    loop = "s = input()\nwhile True:\n    pass"
    t0 = time.monotonic()
    assert reward(task, answer(loop), quick_sandbox) == 0.0
    assert TIME_LIMIT_S == 6.0 and TIME_LIMIT_S <= time.monotonic() - t0 < 2 * TIME_LIMIT_S  # the harness's 6 s, once
    results = run_tests(loop, parse_tests(task.ground_truth), quick_sandbox, time_limit_s=1.0)
    assert [r.why for r in results] == ["time limit exceeded"] + ["not run (an earlier test failed)"] * 2


def test_stdout_is_compared_as_livecodebench_compares_it(quick_sandbox):
    tests = CodeTests(["", ""], ["0.5  \n1 2\n", "x"])
    assert [r.passed for r in run_tests("print('0.50')\nprint(' 1 2 ')", tests, quick_sandbox)] == [True, False]
    # decimals per line, stripped lines, the same number of lines; a runtime error fails
    assert run_tests("print(1/0)", CodeTests([""], [""]), quick_sandbox)[0].why == (
        "runtime error: ZeroDivisionError: division by zero (at `print(1 / 0)`)"
    )  # the line as the harness runs it


def test_model_code_never_runs_in_this_process(quick_sandbox):
    here = CodeTests([""], [str(os.getpid())])
    assert not run_tests("import os\nprint(os.getpid())", here, quick_sandbox)[0].passed


def test_a_pickle_naming_code_is_refused_not_run(tmp_path):
    marker = tmp_path / "ran"

    class Evil:
        def __reduce__(self):
            return (os.system, (f"touch {marker}",))

    rows = lcb_rows()[:1]
    rows[0]["private_test_cases"] = base64.b64encode(zlib.compress(pickle.dumps(Evil()))).decode()
    from tests.eval_fixtures import LCB_COLUMNS, write

    import pyarrow as pa

    path = write(tmp_path / "evil.parquet", rows, pa.schema([(c, pa.string()) for c in LCB_COLUMNS]))
    from rollout_gen.tasks import TaskFileError

    with pytest.raises(
        TaskFileError,
        match=r"evil\.parquet: row 0: column 'private_test_cases': neither JSON"
        r".*refused: the pickle names (posix|os)\.system",
    ):  # why, not only "corrupt"
        load_task_parquet(path)
    assert not marker.exists()
    (tmp_path / "aime2024").mkdir()
    with pytest.raises(TaskFileError, match="aime2024: is a folder; give the task file in it"):
        load_task_parquet(tmp_path / "aime2024")
    (tmp_path / "test6.jsonl").write_text('{"question_id": "a"}\n')
    with pytest.raises(TaskFileError, match="read as Parquet only"):
        load_task_parquet(tmp_path / "test6.jsonl")


def test_export_is_read_back_by_a_livecodebench_reader(tmp_path):
    entries = [
        (STDIN_LOOP, ["print(input())", ""]),
        (CALL_PAIR, ["class Solution: ...", "def topTwo(): ..."]),
        (STDIN_SUM, ["print(3)", "print(sum(map(int, input().split())))"]),
    ]
    path = tmp_path / "generations.json"
    path.write_text(json.dumps(custom_output(entries)))
    assert read_custom_output(path, [STDIN_SUM, CALL_PAIR, STDIN_LOOP]) == dict(entries)
    with pytest.raises(LCBFormatError, match="appears twice"):
        custom_output(entries + entries[:1])


def test_cli_exports_every_problem_aligned_by_question_id(lcb, tmp_path, capsys):
    from flows.cli import main

    _, path = lcb
    out = tmp_path / "generations.json"
    assert (
        main(
            [
                "eval",
                "--tasks",
                str(path),
                "--samples",
                "2",
                "--export-lcb",
                str(out),
                "--json",
                f"storage.root={tmp_path / 'ws'}",
                "rollout.sandbox.timeout_s=1",
            ]
        )
        == 0
    )
    metrics = json.loads(capsys.readouterr().out)
    assert metrics["samples"] == 2 and metrics["benchmarks"]["livecodebench"]["tasks"] == 3
    assert 0.0 <= metrics["benchmarks"]["livecodebench"]["pass@1"] <= 1.0
    got = read_custom_output(out, [r["question_id"] for r in lcb_rows()])
    assert all(len(codes) == 2 for codes in got.values())  # k generations per problem, in sample order


def test_open_agentrl_eval_layouts(tmp_path):
    a24 = load_task_parquet(aime24_file(tmp_path / "aime_2024_problems.parquet"))
    assert [(t.source, t.question, t.ground_truth, t.kind) for t in a24] == [
        ("AIME2024", "What is 40 + 2?", "42", "math"),
        ("AIME2024", "What is 3 * 7?", "21", "math"),
    ]
    assert reward(a24[0], "so the answer is \\boxed{42}") == 1.0
    (a25,) = load_task_parquet(aime25_file(tmp_path / "aime_2025_problems.parquet"))
    assert (a25.source, a25.ground_truth) == ("AIME2025", "99")
    (gpqa,) = load_task_parquet(gpqa_file(tmp_path / "gpqa_diamond.parquet"))
    assert (gpqa.source, gpqa.ground_truth) == ("gpqa_diamond", "B")
    assert reward(gpqa, "The answer is \\boxed{B}") == 1.0
    (v6,) = load_task_parquet(lcb_v6_file(tmp_path / "lcb_v6_2502_2505.parquet"))
    assert v6.kind == "code" and v6.source == "LiveCodeBench_v6" and question_id(v6) == "abc400_a"
    assert parse_tests(v6.ground_truth).outputs == ["3\n", "30\n"]
