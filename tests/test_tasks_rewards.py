"""Task loaders for the reference data layouts, and rewards (math, code through the real sandbox)."""
from __future__ import annotations

import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from rollout_gen.rewards import code_reward
from rollout_gen.tasks import TaskFileError, load_task_parquet


def test_open_agentrl_layout(tmp_path):
    path = tmp_path / "train.parquet"
    pq.write_table(pa.Table.from_pylist([
        {"prompt": [{"role": "system", "content": "sys"}, {"role": "user", "content": "What is 2+2?"}],
         "data_source": "math_dapo", "reward_model": {"ground_truth": "4", "style": "rule"}},
        {"prompt": [{"role": "user", "content": "Write a program."}], "data_source": "livecodebench",
         "reward_model": {"ground_truth": '[{"input": "", "output": "1"}]', "style": "rule"}},
    ]), path)
    a, b = load_task_parquet(path)
    assert (a.question, a.ground_truth, a.source, a.kind) == ("What is 2+2?", "4", "math_dapo", "math")
    assert b.kind == "code" and json.loads(b.ground_truth) == [{"input": "", "output": "1"}]
    assert a.prompt_id != b.prompt_id and load_task_parquet(path)[0].prompt_id == a.prompt_id


def test_flat_eval_layouts(tmp_path):
    path = tmp_path / "aime24.parquet"
    pq.write_table(pa.Table.from_pylist([{"problem": "Find x.", "answer": "17"}]), path)
    (t,) = load_task_parquet(path)
    assert (t.question, t.ground_truth, t.source) == ("Find x.", "17", "aime24")
    gpqa = tmp_path / "gpqa_diamond.parquet"
    pq.write_table(pa.Table.from_pylist([{"question": "Which? (A) x (B) y", "answer": "B"}]), gpqa)
    assert load_task_parquet(gpqa)[0].ground_truth == "B"


def test_bad_task_files_name_file_row_and_field(tmp_path):
    with pytest.raises(TaskFileError, match="does not exist"):
        load_task_parquet(tmp_path / "missing.parquet")
    path = tmp_path / "bad.parquet"
    pq.write_table(pa.Table.from_pylist([{"prompt": "ok", "reward_model": {"ground_truth": "1"}},
                                         {"prompt": "no truth", "reward_model": {"ground_truth": None}}]), path)
    with pytest.raises(TaskFileError, match=r"bad\.parquet: row 1: missing reward_model\.ground_truth"):
        load_task_parquet(path)
    path2 = tmp_path / "bad2.parquet"
    pq.write_table(pa.Table.from_pylist([{"text": "x"}]), path2)
    with pytest.raises(TaskFileError, match="row 0: no 'prompt'"):
        load_task_parquet(path2)


def test_code_reward_runs_tests_in_the_sandbox(sandbox):
    tests = json.dumps([{"input": "3\n", "output": "6"}, {"input": "5\n", "output": "10"}, {"input": "1\n", "output": "3"}])
    good = "```python\nn = int(input())\nprint(n * 2)\n```"
    assert code_reward(good, tests, sandbox) == pytest.approx(2 / 3)
    assert code_reward("no code here", tests, sandbox) == -1.0
    assert code_reward("```python\nprint(\n```", tests, sandbox) == 0.0


def test_cli_evaluates_a_task_file(tmp_path, capsys):
    from pipeline.cli import main

    path = tmp_path / "aime_like.parquet"
    pq.write_table(pa.Table.from_pylist([{"problem": "What is 12 + 30?", "answer": "42"},
                                         {"problem": "What is 7 * 6?", "answer": "42"}]), path)
    assert main(["eval", "--tasks", str(path), "--json"]) == 0
    metrics = json.loads(capsys.readouterr().out)  # stdout holds the JSON document alone
    assert metrics["trajectories"] == 2 and metrics["accuracy"] in (0.0, 0.5, 1.0)
