"""`cleaner gc` (issue #31 §4): a long run's store kept to what it needs, one whole item at a time."""

from __future__ import annotations

import hashlib
import os
import shutil
import signal
import subprocess
import time
from pathlib import Path

import pytest

from storage.catalog import Catalog
from storage.checkpoints import DONE_MARKER
from storage.layout import RunLayout
from tests.flow_helpers import cleaner, command_env, run_cleaner, train


def _gc(root: Path, *args: str) -> subprocess.CompletedProcess:
    """`cleaner gc --run tiny ARGS` on the store at root (a later --run replaces tiny)."""
    return run_cleaner(["gc", "--run", "tiny", *args, f"storage.root={root}"])


def _tree(root: Path) -> dict[str, str]:
    return {
        str(p.relative_to(root)): hashlib.blake2b(p.read_bytes()).hexdigest()
        for p in sorted(root.rglob("*"))
        if p.is_file()
    }


@pytest.fixture()
def run(uninterrupted, tmp_path) -> Path:
    root = tmp_path / "store"
    shutil.copytree(uninterrupted, root, symlinks=True, ignore=shutil.ignore_patterns(".prefect"))
    # a replay beside the run's own partitions, as `cleaner replay --gamma 0.3` writes it
    layout = RunLayout(root, "tiny")
    for i in (0, 1):
        shutil.copytree(layout.purified_dir(i, "saar", 0.5), layout.purified_dir(i, "saar", 0.3))
    return root


def test_dry_run_changes_nothing(run):
    before = _tree(run)
    out = _gc(run, "--keep-last", "1", "--remove-partition", "mode=saar/gamma=0.30", "--dry-run")
    assert out.returncode == 0, out.stderr
    assert "would remove checkpoint" in out.stdout and "would remove partition" in out.stdout
    assert _tree(run) == before


def test_gc_keeps_what_the_run_needs_and_a_killed_gc_then_a_resumed_run_work(run):
    layout = RunLayout(run, "tiny")
    # plenty to delete, so that the kill lands while gc is at work
    for k in range(4000):
        (layout.purified_dir(1, "saar", 0.3) / f"padding-{k}.bin").write_bytes(b"x" * 64)
    p = cleaner(
        [
            "gc",
            "--run",
            "tiny",
            "--keep-last",
            "1",
            "--remove-partition",
            "mode=saar/gamma=0.30",
            f"storage.root={run}",
        ],
        run,
        env=command_env(),
    )
    deadline = time.time() + 120
    while time.time() < deadline and not any((run / ".trash").glob("*")) and p.poll() is None:
        time.sleep(0.01)
    p.send_signal(signal.SIGKILL)
    p.wait(timeout=30)
    with Catalog(run) as cat:  # whatever the kill left, the store reads: every item is there whole or gone
        assert not cat.problems
    out = _gc(run, "--keep-last", "1", "--remove-partition", "mode=saar/gamma=0.30")
    assert out.returncode == 0, out.stdout + out.stderr
    assert not any((run / ".trash").glob("*"))
    assert not layout.checkpoint_dir(1).exists() and (layout.checkpoint_dir(2) / DONE_MARKER).is_file()
    assert not list(layout.run_dir.glob("iteration=*/purified/mode=saar/gamma=0.30"))
    assert layout.purified_dir(1, "saar", 0.5).is_dir() and layout.raw_dir(1).is_dir()
    with Catalog(run) as cat:
        assert not cat.problems
        assert cat.query("SELECT DISTINCT gamma FROM purified WHERE mode = 'saar'").to_pylist() == [{"gamma": 0.5}]
    # the run resumes and continues: a third iteration from the kept checkpoint, without training again the
    # update whose checkpoint gc removed (the next train had re-run it, and gc's space came back)
    out = train(run, "flow.iterations=3")
    assert (layout.checkpoint_dir(3) / DONE_MARKER).is_file()
    assert not layout.checkpoint_dir(1).exists(), out[-3000:]
    assert "checkpoint iteration=0001 was removed (cleaner gc); the run went on to checkpoint 2" in out, out[-3000:]


@pytest.mark.parametrize(
    "args, message",
    [
        (["--run", "nope", "--keep-last", "1"], "run 'nope' does not exist"),
        (["--keep-last", "0"], "--keep-last 0: at least 1"),
        (["--remove-partition", "mode=saar/gamma=0.50"], "the run's own flow writes it"),
        (["--remove-partition", "saar"], "expected the form mode=MODE/gamma=G"),
        (["--keep-last", "1", "--keep", "99"], "--keep 99: run 'tiny' has no checkpoint 99 (its checkpoints: 1, 2)"),
    ],
)
def test_bad_requests_are_one_line_and_remove_nothing(run, args, message):
    before = _tree(run)
    out = _gc(run, *args)
    assert out.returncode != 0 and message in out.stderr and len(out.stderr.strip().splitlines()) == 1, out.stderr
    assert _tree(run) == before


def test_a_partition_no_iteration_has_is_named_with_the_ones_there(run):
    """A partition no iteration has (a typo): it removed nothing, silently (exit 0). `gamma=0.3` is the folder
    `gamma=0.30`, as export reads it (tests/test_cli_refusals.py)."""

    def data() -> dict[str, str]:  # (the catalog's republication rewrites verification records and the catalog)
        return {k: v for k, v in _tree(run / "runs").items() if not k.endswith("_VERIFIED.json")}

    before = data()
    out = _gc(run, "--keep-last", "2", "--remove-partition", "mode=saar/gamma=0.7")
    assert out.returncode == 0, out.stderr
    assert "no iteration of run 'tiny' has partition mode=saar/gamma=0.70 (did you mean " in out.stdout, out.stdout
    assert (
        "(its partitions: mode=raw/gamma=0.00, mode=saar/gamma=0.30, mode=saar/gamma=0.50): nothing to remove for it"
    ) in out.stdout, out.stdout
    assert data() == before


@pytest.mark.parametrize("how", [["--sweep"], ["--gamma", "0.7"]])
def test_replay_of_an_iteration_whose_checkpoint_gc_removed_says_so(run, how):
    """It said 'no tokenizer in checkpoint …' (or '… does not exist') for a folder gc had removed."""
    assert _gc(run, "--keep-last", "1").returncode == 0
    out = run_cleaner(["replay", "--run", "tiny", "--iteration", "1", *how, f"storage.root={run}"])
    assert out.returncode == 1 and "Traceback" not in out.stderr, out.stderr
    assert (
        "checkpoints/iteration=0001, the checkpoint that sampled iteration 1, is gone (removed by `cleaner gc`?)"
        in out.stderr
        and "cleaner gc --keep 1" in out.stderr
    ), out.stderr
    assert not RunLayout(run, "tiny").purified_dir(1, "saar", 0.7).exists()


def test_a_root_under_a_file_is_one_line(tmp_path):
    (tmp_path / "file").write_text("x")
    out = _gc(tmp_path / "file" / "root", "--keep-last", "1")
    assert out.returncode != 0 and len(out.stderr.strip().splitlines()) == 1, out.stderr


def test_a_partial_update_beside_its_committed_checkpoint_goes(run):
    """A partial update the committed checkpoint did not resume (killed, or other settings) stayed beside it for
    good (14 MB a user found); gc removes it, and never one whose checkpoint is not committed (its rerun owns it)."""
    layout = RunLayout(run, "tiny")
    checkpoints = layout.run_dir / "checkpoints"
    done = sorted(p for p in checkpoints.glob("iteration=*") if (p / DONE_MARKER).is_file())
    stale = done[-1].with_name(done[-1].name + ".partial")
    (stale / "mb0001").mkdir(parents=True)
    (stale / "mb0001" / "state.pt").write_bytes(b"x" * 1024)
    staging = done[-1].with_name(done[-1].name + ".tmp")  # a killed update's staging folder
    staging.mkdir()
    frozen = done[-1].with_name(done[-1].name + ".config.yaml")  # a killed DeepSpeed launch's config
    frozen.write_text("train: {}\n")
    live = checkpoints / "iteration=0099.partial"  # an update of a checkpoint not committed yet
    live.mkdir()
    out = _gc(run, "--keep-last", "9")
    assert out.returncode == 0, out.stderr
    assert f"removing partial update {stale}" in out.stdout, out.stdout
    assert not stale.exists() and live.is_dir() and all(p.is_dir() for p in done)
    assert not staging.exists() and not frozen.exists() and "removing update config" in out.stdout


def test_gc_and_the_next_publish_remove_what_killed_writers_left(run):
    """A purify killed with -9 left iteration=N/.staging/purify-ID (only that iteration's next purify removed it),
    and a publish killed with -9 left .catalog.duckdb.PID.tmp and its .wal for good (each publisher removed its
    own pid's only). gc removes the first; every publish removes the second, once its pid is gone."""
    dead = subprocess.Popen(["true"])
    dead.wait()
    staged = RunLayout(run, "tiny").run_dir / "iteration=0000" / ".staging"
    (staged / "purify-deadbeef").mkdir(parents=True)
    (staged / "purify-deadbeef" / "saar-00000.parquet").write_bytes(b"x")
    (staged / "purify-deadbeef.lock").write_text("")
    catalog = run / "catalog.duckdb"
    left = [run / f".catalog.duckdb.{dead.pid}.tmp", run / f".catalog.duckdb.{dead.pid}.tmp.wal"]
    alive = run / f".catalog.duckdb.{os.getppid()}.tmp"  # a publish still running
    for path in (*left, alive):
        path.write_bytes(b"x")
    out = _gc(run, "--keep-last", "2")
    assert out.returncode == 0, out.stderr
    assert not staged.exists()
    assert catalog.is_file() and not any(p.exists() for p in left) and alive.exists()


def test_an_item_another_gc_removed_meanwhile_is_not_an_error(tmp_path):
    """Two gc of one run at once: the one that came second to a partition stopped with 'No such file or directory',
    its other items left and the catalog not republished."""
    from storage.retention import Removal, remove

    gone = tmp_path / "runs" / "r" / "iteration=0000" / "purified" / "mode=saar" / "gamma=0.40"
    remove(tmp_path, Removal(gone, "partition", 0))  # never there, or renamed into the trash by the other gc
    assert not gone.exists()
