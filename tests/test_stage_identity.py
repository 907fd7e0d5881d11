"""One stage identity (storage/identity.py): whether a stage is done with the same inputs is decided once, by the
stage's plan, so the training flow's task and the stage run alone (what `cleaner rollout/purify/update` call) decide
alike. A speed-only setting (rollout.engine_tuning.threads) changed between the flow and the stage keeps what was
committed; a setting that changes the output refuses it in both, in one line; committed outputs keep matching."""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path
from types import SimpleNamespace

import pytest

from flows import training
from pipeline.config import load_config
from storage.checkpoints import checkpoint_for
from storage.errors import CleanerError
from storage.layout import RunLayout
from storage.shards import read_manifest
from tests.flow_helpers import copy_runs, tiny_config

EVAL = ["flow.eval_limit=2", "flow.eval_samples=1", "flow.eval_saar_off=false"]  # a short evaluation of iteration 0


def _config(root: Path, *overrides: str):
    return load_config(tiny_config(root), [*EVAL, *overrides])


def _flow_task(task, cfg, iteration: int) -> tuple[object, bool, list[str]]:
    """A training flow's task run as the flow runs it: (its value, whether it kept a committed output, its log)."""
    lines: list[str] = []
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(training, "get_run_logger", lambda: SimpleNamespace(info=lines.append, warning=lines.append))
        result = task.fn(cfg, "tiny", iteration)
    return training.value(result), isinstance(result, training.State), lines


@pytest.fixture(scope="module")
def run(uninterrupted, tmp_path_factory) -> Path:
    """A copy of the tiny flow's run (2 iterations), its iteration 0 evaluated by the flow's eval task too."""
    root = copy_runs(uninterrupted, tmp_path_factory.mktemp("identity"))
    _flow_task(training.eval_stage_task, _config(root), 0)
    return root


def _faster(root: Path):
    return _config(root, "rollout.engine_tuning.threads=2")


def test_rollout_speed_only_change_keeps_the_raw_shard_in_the_flow_and_the_stage(run):
    from rollout_gen.stage import run_rollout_stage

    cfg = _faster(run)
    committed = read_manifest(RunLayout(run, "tiny").raw_dir(1))
    rows, kept, log = _flow_task(training.rollout_task, cfg, 1)
    assert (rows, kept) == (committed.rows, True)
    assert log == [f"[rollout it 1] raw shard already committed ({committed.rows} trajectories): kept"]
    checkpoint = checkpoint_for(run, "tiny", 1, cfg.rollout.policy)
    assert run_rollout_stage(cfg, "tiny", 1, checkpoint, show_progress=False) == committed


def test_purify_speed_only_change_keeps_the_partitions_in_the_flow_and_the_stage(run):
    from purifier.stage import run_purify_stage

    cfg = _faster(run)
    purified, kept, log = _flow_task(training.purify_task, cfg, 1)
    assert kept and purified and log[-1].endswith(": already committed, kept"), log
    assert all(r.skipped for r in run_purify_stage(cfg, "tiny", 1))


def test_update_speed_only_change_keeps_the_checkpoint_in_the_flow_and_the_stage(run):
    from trainer.stage import run_update_stage

    cfg = _faster(run)
    target = RunLayout(run, "tiny").checkpoint_dir(2)
    record = (target / "_CHECKPOINT.json").read_bytes()
    checkpoint, kept, log = _flow_task(training.update_task, cfg, 1)
    assert (checkpoint, kept) == (str(target), True)
    assert log == ["[update it 1] checkpoint iteration=0002 already committed: kept"]
    assert run_update_stage(cfg, "tiny", 1, log=lambda *_: None) == target
    assert (target / "_CHECKPOINT.json").read_bytes() == record


def test_eval_speed_only_change_keeps_the_evaluation_in_the_flow_and_the_stage_without_calling_it_other(run):
    """The eval shard's identity hashed the threads: the stage kept it, but said it was committed with other
    settings (and the flow never compared)."""
    from rollout_gen.eval_stage import run_eval_stage

    cfg = _faster(run)
    committed = read_manifest(RunLayout(run, "tiny").metrics_dir(0, "eval"))
    extra, kept, _ = _flow_task(training.eval_stage_task, cfg, 0)
    assert (extra, kept) == (committed.extra, True)
    lines: list[str] = []
    checkpoint = checkpoint_for(run, "tiny", 0, cfg.rollout.policy)
    assert run_eval_stage(cfg, "tiny", 0, checkpoint, log=lines.append) == (committed, True)
    assert not any("other settings" in line for line in lines), lines


@pytest.mark.parametrize(
    "task, override, iteration, refusal",
    [
        ("rollout", "rollout.temperature=0.7", 1, "committed with other rollout settings"),
        ("purify", "purify.dynamic_filter=true", 1, "committed with other purify settings"),
        ("update", "train.lr=5e-5", 1, "committed by an update with other train settings"),
        ("eval", "flow.eval_samples=2", 0, "committed with other evaluation settings"),
    ],
)
def test_a_change_of_what_a_stage_computes_is_refused_by_the_flow_as_by_the_stage(
    run, task, override, iteration, refusal
):
    """The flow's rollout and eval tasks kept any committed output, whatever it was made with, where the stage run
    alone refused it (rollout) or kept it with a log line (eval)."""
    from purifier.stage import run_purify_stage
    from rollout_gen.eval_stage import run_eval_stage
    from rollout_gen.stage import run_rollout_stage
    from trainer.stage import run_update_stage

    cfg = _config(run, override)
    checkpoint = checkpoint_for(run, "tiny", iteration, cfg.rollout.policy)
    stage = {
        "rollout": lambda: run_rollout_stage(cfg, "tiny", iteration, checkpoint, show_progress=False),
        "purify": lambda: run_purify_stage(cfg, "tiny", iteration),
        "update": lambda: run_update_stage(cfg, "tiny", iteration, log=lambda *_: None),
        "eval": lambda: run_eval_stage(cfg, "tiny", iteration, checkpoint, log=lambda *_: None),
    }[task]
    flow_task = {
        "rollout": training.rollout_task,
        "purify": training.purify_task,
        "update": training.update_task,
        "eval": training.eval_stage_task,
    }[task]
    for decide in (stage, lambda: _flow_task(flow_task, cfg, iteration)):
        with pytest.raises(CleanerError) as e:
            decide()
        assert refusal in str(e.value) and "\n" not in str(e.value), str(e.value)


def test_after_gc_the_flow_and_the_stage_keep_what_the_removed_checkpoints_made(run, tmp_path):
    """`cleaner gc` removed checkpoint 1 once the run trained checkpoint 2: the flow kept iteration 0's update as
    done, while the update stage run alone trained checkpoint 1 again; iteration 1's rollout, sampled from the
    removed checkpoint, is kept by both (nothing is left to compare it with)."""
    from rollout_gen.stage import run_rollout_stage
    from trainer.stage import run_update_stage

    root = copy_runs(run, tmp_path / "ws")
    layout = RunLayout(root, "tiny")
    shutil.rmtree(layout.checkpoint_dir(1))
    cfg = _config(root)
    target, kept, log = _flow_task(training.update_task, cfg, 0)
    assert (target, kept) == (str(layout.checkpoint_dir(1)), True)
    assert log == [
        "[update it 0] checkpoint iteration=0001 was removed (cleaner gc); the run went on to checkpoint 2: "
        "kept as done"
    ]
    run_update_stage(cfg, "tiny", 0, log=lambda *_: None)
    assert not layout.checkpoint_dir(1).exists()
    committed = read_manifest(layout.raw_dir(1))
    assert _flow_task(training.rollout_task, cfg, 1)[:2] == (committed.rows, True)
    assert run_rollout_stage(cfg, "tiny", 1, show_progress=False) == committed


def test_the_speed_only_settings_are_left_out_by_run_json_and_by_every_identity(tmp_path):
    from flows.run_config import freeze_run_config
    from purifier.stage import purify_identity
    from pipeline.modes import Variant
    from rollout_gen.eval_stage import eval_identity
    from rollout_gen.stage import rollout_identity
    from storage.identity import SPEED_ONLY
    from trainer.stage import update_identity

    assert SPEED_ONLY == ("rollout.engine_tuning.threads",)
    base = [f"storage.root={tmp_path}", "flow.run_id=r"]
    cfg, faster = load_config(None, base), load_config(None, [*base, "rollout.engine_tuning.threads=4"])
    freeze_run_config(cfg, "r")
    freeze_run_config(faster, "r")  # the rerun at another speed goes on
    for identity in (
        lambda c: rollout_identity(c, "v"),
        lambda c: eval_identity(c, "v"),
        update_identity,
        lambda c: purify_identity(c, Variant.of("saar", 0.5), "raw"),
    ):
        assert identity(faster).value == identity(cfg).value


def test_committed_identities_keep_their_values(tmp_path):
    """The values shards and checkpoints record: a new recipe would leave every committed output unmatched."""
    from pipeline.config import hashed_train_settings, train_settings
    from rollout_gen.eval_stage import eval_identity
    from rollout_gen.stage import rollout_identity
    from storage.identity import file_digest, identity_hash
    from trainer.stage import update_identity

    cfg = load_config(None, ["rollout.policy=/fixed/policy"])
    assert rollout_identity(cfg, "v1").value == "d0d99423eec0794f"
    assert eval_identity(cfg, "v1").value == "ac1ef27091393763"
    threads = load_config(None, ["rollout.policy=/fixed/policy", "rollout.engine_tuning.threads=3"])
    assert "fc07a2a1b1ef689c" in eval_identity(threads, "v1").legacy  # committed with the threads hashed
    assert update_identity(cfg).value == train_settings(cfg.train) == identity_hash(hashed_train_settings(cfg.train))
    tasks = tmp_path / "tasks.parquet"
    tasks.write_bytes(bytes(range(256)) * 9000)
    assert file_digest(tasks) == hashlib.blake2b(tasks.read_bytes(), digest_size=16).hexdigest()
    cfg.flow.eval_tasks = str(tasks)
    recorded = {
        "tasks": hashlib.blake2b(tasks.read_bytes(), digest_size=8).hexdigest(),
        "samples": 1,
        "limit": None,
        "settings": ["saar_on", "saar_off"],
        "sections": cfg.section_hash("rollout", "world"),
        "policy": "v1",
    }
    legacy = hashlib.blake2b(json.dumps(recorded, sort_keys=True).encode(), digest_size=8).hexdigest()
    assert legacy in eval_identity(cfg, "v1").legacy  # an eval shard that recorded the task file's 8-byte digest


def test_after_gc_the_stage_commands_keep_what_the_flow_keeps(run, tmp_path):
    """`cleaner rollout` and `cleaner update` decide with the stages' plans, as the flow: after checkpoint 1 was
    removed by `cleaner gc`, iteration 1's rollout and iteration 0's update are kept (the rollout command resolved
    the removed checkpoint itself and failed on it)."""
    from tests.flow_helpers import run_cleaner

    root = copy_runs(run, tmp_path / "ws")
    layout = RunLayout(root, "tiny")
    shutil.rmtree(layout.checkpoint_dir(1))
    for stage, iteration in (("rollout", 1), ("update", 0)):
        done = run_cleaner([stage, "--run", "tiny", "--iteration", str(iteration), "-c", str(tiny_config(root))], root)
        assert done.returncode == 0 and "kept (already committed)" in done.stdout, done.stderr[-2000:]
    assert not layout.checkpoint_dir(1).exists()
