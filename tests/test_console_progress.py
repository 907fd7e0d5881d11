"""Never silent for long (issue #32 §5), with real commands on the 2-iteration tiny run: a stage run alone again
says its output is already committed, as `purify` always did; a fresh update says what it loads and reports its
progress per micro-batch, each step's line as its mini-batch ends; replay and `cleaner server start` say what
they are doing before their first result. Asserted on the messages, never on timings."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from tests.flow_helpers import cleaner, copy_runs, run_cleaner, tiny_config


@pytest.fixture()
def run(uninterrupted, tmp_path) -> Path:
    """A copy of the tiny run (the shared one is never modified) and its config file, tiny.yaml."""
    root = copy_runs(uninterrupted, tmp_path / "ws")
    tiny_config(root)
    return root


def _out(args: list[str], root: Path) -> str:
    p = cleaner([*args, "-c", str(root / "tiny.yaml")], root)
    out, _ = p.communicate(timeout=600)
    assert p.returncode == 0, out[-3000:]
    return out


@pytest.mark.parametrize("stage", ["rollout", "purify", "update"])
def test_a_stage_run_again_alone_says_already_committed(run, stage):
    for iteration in (0, 1):
        out = _out([stage, "--run", "tiny", "--iteration", str(iteration)], run)
        assert "already committed" in out, out


def test_an_update_says_what_it_loads_and_logs_each_step_as_it_is_taken(run):
    shutil.rmtree(run / "runs" / "tiny" / "checkpoints" / "iteration=0002")  # the last update, to do again
    out = _out(["update", "--run", "tiny", "--iteration", "1"], run)
    lines = out.splitlines()

    def at(start: str) -> int:
        return next(i for i, line in enumerate(lines) if line.startswith(start))

    order = [
        at("[update it 1] loading the trainer"),
        at("[update it 1] 2 mini-batches to go"),
        at("[update] step 3:"),
        at("[update] step 4:"),
        at("[update it 1] 2/2 mini-batches (100%) in "),
    ]
    assert order == sorted(order), out  # the steps between the start and the end of the progress, not after it
    assert "already committed" not in out


def test_update_progress_lines_follow_every_micro_batch(purified_run, tmp_path, monkeypatch):
    import trainer.stage
    from trainer.stage import run_update_stage

    cfg = purified_run.model_copy(deep=True)
    cfg.storage.root = copy_runs(purified_run.storage.root, tmp_path)
    cfg.train.micro_batch_tokens, cfg.train.mini_batches = 200, 2
    monkeypatch.setattr(trainer.stage, "PROGRESS_EVERY_S", 0.0)  # a line per micro-batch, whatever the speed
    lines: list[str] = []
    run_update_stage(cfg, "w", 0, log=lines.append)
    micro = [line for line in lines if "micro-batch" in line]
    assert len(micro) >= 4 and lines.index(micro[0]) < lines.index(next(x for x in lines if "step 1:" in x))
    assert any("mini-batch 2/2" in line for line in micro), lines


def test_replay_says_what_it_does_before_its_first_table(run):
    out = _out(["replay", "--run", "tiny", "--iteration", "0", "--gamma", "0.3"], run)
    first = out.splitlines()[0]
    assert first.startswith("[replay tiny it 0] purifying saar γ 0.3 beside the committed partitions"), out
    assert "[replay tiny it 0] reading the raw shard" in out


def test_server_start_says_what_it_is_doing(tmp_path):
    try:
        tiny_config(tmp_path)
        out = _out(["server", "start", "--no-ui"], tmp_path)
    finally:
        _out(["server", "stop"], tmp_path)
    lines = out.splitlines()
    assert lines[0].startswith("starting a Prefect server for "), out
    assert any(line.startswith("started: pid ") for line in lines[1:]), out


def test_server_status_exits_nonzero_when_not_running_as_cluster_status_does(tmp_path):
    """A script's `cleaner server status && ...` must not go on when no server runs (exit 1, as `cluster status`)."""
    tiny_config(tmp_path)
    for command in ("server", "cluster"):
        p = run_cleaner([command, "status", "-c", str(tmp_path / "tiny.yaml")], tmp_path)
        assert (p.returncode, p.stdout.strip()) == (1, "not running"), (command, p.stdout, p.stderr)
