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
    refused(["train", f"storage.root={ws}", "flow.run_id=e1", "flow.iterations=1", "flow.eval_every=1",
              f"flow.eval_tasks={empty}"], capsys, 1, str(empty), "no rows")
    assert not ws.exists()


def test_train_refuses_deepspeed_fp16_without_a_gpu_before_anything_runs(tmp_path, capsys):
    """DeepSpeed refused fp16 on CPU only in the update, after a rollout and a purification, as a 1,927-character
    line of a rank's traceback."""
    import torch

    if torch.cuda.is_available():
        pytest.skip("a GPU trains fp16")
    ws = tmp_path / "ws"
    refused(["train", f"storage.root={ws}", "train.strategy=deepspeed", "train.param_dtype=fp16"], capsys, 1,
             "train.param_dtype=fp16 needs a GPU")
    assert not ws.exists()
