"""Bad command lines a user types, each refused in one line before anything runs or is written (found by using the
commands as a user does: each of these was a traceback, a silent fallback or a half-written run before)."""

from __future__ import annotations

import json

import pytest

from flows.cli import main as cli_main
from flows.policy_cmds import SFT_BATCH


def main(argv: list[str]) -> int:
    """`cleaner ARGV`'s exit code (argparse's refusals exit through SystemExit)."""
    try:
        return cli_main(argv)
    except SystemExit as e:
        return e.code


@pytest.mark.parametrize("run_id", ["", "a/b", "x\ttab", "-dash", ".hidden", "a\\b"])
def test_a_run_id_that_no_command_line_could_name_again_is_refused(run_id, tmp_path, capsys):
    """`gc --run ''` fell back to flow.run_id and acted on the default run; `flow.run_id=a/b` started a Prefect
    server before failing; a tab or a leading dash made runs no `--run` could name again."""
    assert main(["gc", f"--run={run_id}", "--dry-run", f"storage.root={tmp_path}"]) == 2
    assert "must be a plain folder name" in capsys.readouterr().err
    assert main(["config", f"flow.run_id={run_id}", f"storage.root={tmp_path}"]) == 2
    err = capsys.readouterr().err  # a tab does not even parse as a YAML value
    assert "flow.run_id" in err and ("must be a plain folder name" in err or "not valid YAML" in err), err


def test_a_run_id_with_a_space_is_a_name_stores_already_hold(tmp_path, capsys):
    """Quoted, a space names a run on every command line: runs stores hold under such names stay reachable."""
    assert main(["config", "flow.run_id=two words", f"storage.root={tmp_path}"]) == 0
    (tmp_path / "runs" / "two words").mkdir(parents=True)
    assert main(["gc", "--run", "two words", "--dry-run", f"storage.root={tmp_path}"]) == 0


@pytest.mark.parametrize("port", ["99999", "-1", "http"])
def test_a_port_out_of_range_is_refused(port, tmp_path, capsys):
    """`server start --port 99999` was an OverflowError traceback from bind."""
    assert main(["server", "start", "--port", port, f"storage.root={tmp_path}"]) == 2
    assert "is not a port: give a number from 1 to 65535" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("flag", "value", "says"),
    [
        ("--steps", "0", "≥ 1"),
        ("--steps", "-5", "≥ 1"),
        ("--corpus-size", "2", f"≥ {SFT_BATCH}"),
        ("--threads", "0", "≥ 1"),
    ],
)
def test_bootstrap_refuses_sizes_that_cannot_train(flag, value, says, tmp_path, capsys):
    """--steps 0 saved an untrained policy after 100 s; --corpus-size 0 and 2 were tracebacks after the corpus."""
    assert main(["bootstrap", "--out", str(tmp_path / "p"), flag, value]) == 2
    assert says in capsys.readouterr().err
    assert not (tmp_path / "p").exists()


def test_bootstrap_refuses_an_out_it_would_litter_before_any_work(tmp_path, capsys, monkeypatch):
    """`--out ''` wrote a policy into the working directory; a file as --out failed only after training."""
    from trainer.sft import SFTConfig

    assert SFTConfig().batch_size == SFT_BATCH
    (tmp_path / "README.md").write_text("mine")
    (tmp_path / "a-file").write_text("x")
    monkeypatch.chdir(tmp_path)
    for out, says in (("", "holds other files"), (str(tmp_path / "a-file"), "is a file, not a folder")):
        assert main(["bootstrap", "--out", out, "--steps", "1", "--corpus-size", "8"]) == 2
        assert says in capsys.readouterr().err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["README.md", "a-file"]


def test_bootstrap_force_rebuilds_a_policy_a_ctrl_c_cut_short_or_a_sharded_one(tmp_path):
    """Saving writes config.json before the weights: a folder left so was refused as "holds other files", even with
    --force, and so was a policy whose weights are sharded."""
    from flows.policy_cmds import out_problem

    (tmp_path / "cut").mkdir()
    (tmp_path / "cut" / "config.json").write_text("{}")
    (tmp_path / "sharded").mkdir()
    (tmp_path / "sharded" / "model-00001-of-00002.safetensors").write_bytes(b"")
    for out in (tmp_path / "cut", tmp_path / "sharded"):
        assert out_problem(out, force=True) is None
        assert "already holds a policy; pass --force" in out_problem(out, force=False)


def test_a_run_whose_policy_is_missing_writes_no_run_json(tmp_path):
    """A train with a wrong rollout.policy failed, but left run.json recording it: the corrected rerun was refused
    as "started with another config"."""
    from flows.run_config import freeze_run_config
    from pipeline.config import load_config
    from storage.errors import CheckpointError
    from storage.layout import RunLayout

    bad = load_config(None, [f"storage.root={tmp_path}", f"rollout.policy={tmp_path / 'nonexistent'}"])
    with pytest.raises(CheckpointError, match="nonexistent does not exist"):
        freeze_run_config(bad, "r")
    assert not RunLayout(tmp_path, "r").run_json.exists()
    good = load_config(None, [f"storage.root={tmp_path}"])
    freeze_run_config(good, "r")
    assert json.loads(RunLayout(tmp_path, "r").run_json.read_text())["rollout"]["policy"] == str(good.rollout.policy)


def test_gc_names_a_partition_as_the_writer_does(purified_run, tmp_path, capsys):
    """`gc --remove-partition mode=saar/gamma=0.5` said the run had no such partition (its folder is gamma=0.50)
    and went on with the rest."""
    from tests.flow_helpers import copy_runs

    root = copy_runs(purified_run.storage.root, tmp_path / "ws")
    args = ["gc", "--run", "w", "--dry-run", f"storage.root={root}", "--remove-partition"]
    # the run's own partition, as typed: found, and kept (before: "no iteration has it", exit 0)
    assert main([*args, "mode=saar/gamma=0.5"]) == 1
    assert "mode=saar/gamma=0.50: the run's own flow writes it" in capsys.readouterr().err
    assert main([*args, "mode=saar/gamma=0.3"]) == 0
    assert "has partition mode=saar/gamma=0.30 (did you mean mode=saar/gamma=0.50?)" in capsys.readouterr().out
    assert main([*args, "saar gamma 0.5"]) == 1
    assert "saar gamma 0.5" in capsys.readouterr().err


@pytest.mark.parametrize(
    "argv",
    [
        ["update", "--iteration", "0"],
        ["rollout", "--iteration", "5"],
        ["purify", "--iteration", "0"],
        ["gc", "--keep-last", "1"],
        ["report"],
        ["filter", "--out", "f.parquet"],
    ],
)
def test_every_command_says_a_run_does_not_exist_in_the_same_words(argv, tmp_path, capsys):
    """update said "run `cleaner purify` first" and rollout "run the update of iteration 4" for a run that did not
    exist; the others said it four different ways."""
    (tmp_path / "runs" / "other").mkdir(parents=True)
    assert main([*argv, "--run", "nosuch", f"storage.root={tmp_path}"]) != 0
    err = capsys.readouterr().err
    assert f"run 'nosuch' does not exist under {tmp_path} (runs there: other); check --run and storage.root" in err


def test_a_stage_refused_for_other_settings_names_them(uninterrupted, tmp_path, capsys):
    """`cleaner update` without the run's -c file was refused with two config hashes and nothing to act on."""
    import shutil

    from tests.flow_helpers import tiny_config

    root = tmp_path / "store"
    shutil.copytree(uninterrupted, root, ignore=shutil.ignore_patterns(".prefect"))
    cfg = tiny_config(tmp_path)  # the run's own file, as the fixture wrote it
    args = ["update", "--run", "tiny", "--iteration", "0", "-c", str(cfg), f"storage.root={root}"]
    assert main([*args, "train.lr=0.5"]) == 1
    err = capsys.readouterr().err
    assert "committed by an update with other train settings" in err and "-> 0.5; give the run's -c file" in err, err
    assert main(args) == 0  # the run's own settings: kept


@pytest.mark.parametrize(
    ("override", "says"),
    [
        ("rollout.tasks_per_iteration=1e12", "trajectories an iteration, more than 10,000,000"),
        ("rollout.samples_per_prompt=100000000", "rollout.samples_per_prompt: Input should be less than or equal"),
    ],
)
def test_an_iteration_too_large_to_plan_is_refused_when_the_config_is_read(override, says, tmp_path, capsys):
    """1.6e9 trajectories were a MemoryError traceback after the policy loaded; 1e12 tasks a silent hang."""
    assert main(["config", override, f"storage.root={tmp_path}"]) == 2
    assert says in capsys.readouterr().err


def test_a_mistyped_command_or_choice_gets_a_did_you_mean(capsys):
    """A config key typo got one; `cleaner trian` only the list of commands."""
    assert main(["trian"]) == 2
    assert "did you mean 'train'?" in capsys.readouterr().err
    assert main(["replay", "--mode", "sar"]) == 2
    assert "did you mean 'saar'?" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("argv", "says"),
    [
        (["inspect", "--sql", "SELECT 1", "--run", "w"], "--run restricts the summary tables, not --sql"),
        (
            ["export", "--format", "verl", "--partition", "mode=saar/gamma=0.50"],
            "--partition is not read by --format verl",
        ),
        (["init-policy", "--random", "--retrain"], "--random writes untrained weights, --retrain reruns the SFT"),
    ],
)
def test_a_flag_the_command_would_ignore_is_refused(argv, says, tmp_path, capsys):
    """Each ran as if the flag were not there: the SQL over every run, the prompts of the run, random weights."""
    out = ["--out", str(tmp_path / "out")] if argv[0] in ("export", "init-policy") else []
    overrides = [] if argv[0] == "init-policy" else [f"storage.root={tmp_path}"]
    assert main([*argv, *out, *overrides]) in (1, 2)
    assert says in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize(
    ("override", "says"),
    [
        ("purify.runner=dask", "no purify.dask_address and no local Dask cluster"),
        ("purify.dask_address=tcp://127.0.0.1:9", "purify.dask_address=tcp://127.0.0.1:9: no Dask scheduler answers"),
        ("purify.runner=SparkRunnr", "purify.runner=SparkRunnr: Beam knows no such runner"),
    ],
)
def test_train_refuses_a_purify_runner_that_cannot_run_before_any_rollout(override, says, tmp_path, capsys):
    """Found only at the first purify, after minutes of rollout and a committed raw shard."""
    extra = ["purify.runner=dask"] if "dask_address" in override else []
    assert main(["train", f"storage.root={tmp_path}", override, *extra]) != 0
    assert says in capsys.readouterr().err
    assert not (tmp_path / "runs").exists() and not (tmp_path / ".prefect").exists()


def test_a_new_run_from_a_truncated_policy_is_refused_before_prefect_starts(tmp_path, capsys):
    """The policy's weights were read first by the rollout task, inside the flow, after a server had started."""
    import shutil

    from pipeline.config import DEFAULT_POLICY

    policy = tmp_path / "policy"
    shutil.copytree(DEFAULT_POLICY, policy)
    weights = policy / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:100_000])
    root = tmp_path / "ws"
    assert main(["train", f"storage.root={root}", f"rollout.policy={policy}"]) != 0
    assert "truncated" in capsys.readouterr().err
    assert not (root / ".prefect").exists() and not (root / "runs").exists()
