"""`cleaner train` refuses what would fail later before Prefect is set up or anything is written: a bad
flow.eval_tasks file, DeepSpeed fp16 without a GPU."""

from __future__ import annotations

import pyarrow as pa
import pytest

from tests.flow_helpers import refused
from tests.eval_fixtures import write


def test_train_refuses_a_bad_eval_task_file_before_prefect_or_run_json(tmp_path, capsys):
    """It started the flow, froze the bad settings in run.json and logged three Prefect ERROR lines first."""
    ws = tmp_path / "ws"
    empty = write(tmp_path / "empty.parquet", [], pa.schema([("Problem", pa.string()), ("Answer", pa.int64())]))
    refused(
        [
            "train",
            f"storage.root={ws}",
            "flow.run_id=e1",
            "flow.iterations=1",
            "flow.eval_every=1",
            f"flow.eval_tasks={empty}",
        ],
        capsys,
        1,
        str(empty),
        "no rows",
    )
    assert not ws.exists()


def test_train_refuses_deepspeed_fp16_without_a_gpu_before_anything_runs(tmp_path, capsys):
    """DeepSpeed refused fp16 on CPU only in the update, after a rollout and a purification, as a 1,927-character
    line of a rank's traceback."""
    import torch

    if torch.cuda.is_available():
        pytest.skip("a GPU trains fp16")
    ws = tmp_path / "ws"
    refused(
        ["train", f"storage.root={ws}", "train.strategy=deepspeed", "train.param_dtype=fp16"],
        capsys,
        1,
        "train.param_dtype=fp16 needs a GPU",
    )
    assert not ws.exists()


def _flat(path, rows):
    return write(path, rows, pa.schema([("problem", pa.string()), ("answer", pa.string())]))


def test_a_task_file_that_would_fail_the_rollout_is_one_line_before_anything_is_written(tmp_path, capsys):
    """Two tasks at 16 per iteration rolled every task out 8 times as rows with one key; a null answer failed after
    Prefect, the policy and the sandbox had started, with run.json left behind (locking the run id)."""
    ws = tmp_path / "ws"
    two = _flat(
        tmp_path / "two.parquet",
        [{"problem": "What is 11 + 7?", "answer": "18"}, {"problem": "What is 12 + 7?", "answer": "19"}],
    )
    refused(
        ["train", f"storage.root={ws}", f"rollout.tasks={two}"],
        capsys,
        1,
        "2 distinct tasks, fewer than rollout.tasks_per_iteration (16); lower it to at most 2",
    )
    null = _flat(tmp_path / "null.parquet", [{"problem": "What is 1 + 1?", "answer": None}])
    refused(
        ["train", f"storage.root={ws}", f"rollout.tasks={null}", "rollout.tasks_per_iteration=1"],
        capsys,
        1,
        "null.parquet: row 0: missing reward_model.ground_truth",
    )
    assert not ws.exists()


def test_rows_repeating_a_task_count_once_and_other_answers_blank_or_malformed_tests_are_refused(tmp_path):
    import json

    from rollout_gen.tasks import TaskFileError, load_task_parquet

    q = "What is 38 + 40?"
    same = _flat(
        tmp_path / "same.parquet",
        [{"problem": q, "answer": "78"}, {"problem": q, "answer": "78"}, {"problem": "What is 1 + 1?", "answer": "2"}],
    )
    assert [t.question for t in load_task_parquet(same)] == [q, "What is 1 + 1?"]
    other = _flat(tmp_path / "other.parquet", [{"problem": q, "answer": "78"}, {"problem": q, "answer": "79"}])
    with pytest.raises(TaskFileError, match=r"other.parquet: row 1: the question of row 0 with another answer"):
        load_task_parquet(other)
    for answer in ("  ", ""):
        with pytest.raises(TaskFileError, match=r"row 0: the answer is empty"):
            load_task_parquet(_flat(tmp_path / "blank.parquet", [{"problem": q, "answer": answer}]))
    with pytest.raises(TaskFileError, match=r"row 0: the answer is empty \(nan\)"):
        load_task_parquet(write(tmp_path / "nan.parquet", [{"problem": q, "answer": float("nan")}]))
    bad_tests = json.dumps({"inputs": ["1"], "outputs": []})
    with pytest.raises(TaskFileError, match=r"row 0: the answer reads as code tests but 1 inputs but 0 outputs"):
        load_task_parquet(_flat(tmp_path / "bad_tests.parquet", [{"problem": "Print it.", "answer": bad_tests}]))
    as_text = write(tmp_path / "rm_text.parquet", [{"prompt": q, "reward_model": json.dumps({"ground_truth": "78"})}])
    assert load_task_parquet(as_text)[0].ground_truth == "78"


def test_a_resumed_run_refuses_a_task_file_whose_content_changed(tmp_path):
    """run.json kept only the path: the file overwritten between two runs trained iteration 1 on other tasks."""
    from flows.run_config import RunConfigMismatch, freeze_run_config
    from pipeline.config import load_config

    tasks = _flat(
        tmp_path / "tasks.parquet", [{"problem": f"What is {i} + {i}?", "answer": str(2 * i)} for i in range(4)]
    )
    cfg = load_config(None, [f"storage.root={tmp_path / 'ws'}", f"rollout.tasks={tasks}"])
    freeze_run_config(cfg, "r")
    freeze_run_config(cfg, "r")  # the same file: goes on
    _flat(tasks, [{"problem": f"What is {i} * 3?", "answer": str(3 * i)} for i in range(4)])
    with pytest.raises(RunConfigMismatch, match="not the task file run 'r' started with"):
        freeze_run_config(cfg, "r")
