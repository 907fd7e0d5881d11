"""Workspaces that move (issue #31 §5): a store copied to another directory and used from a third one gives
the original's results and never opens a file of the original (which is removed before the copy is used)."""

from __future__ import annotations

import shutil
import subprocess

from storage.layout import RunLayout, record_path, resolve_recorded
from storage.shards import read_manifest
from tests.flow_helpers import run_cleaner


def _replay(root, cwd) -> subprocess.CompletedProcess:
    return run_cleaner(
        ["replay", "--run", "tiny", "--iteration", "1", "--gamma", "0.3", f"storage.root={root}"], cwd=cwd
    )


def test_recorded_paths_are_relative_to_the_root(tmp_path):
    root = tmp_path / "ws"
    assert (
        record_path(root, root / "runs" / "r" / "checkpoints" / "iteration=0001") == "runs/r/checkpoints/iteration=0001"
    )
    assert record_path(root, tmp_path / "policy") == str((tmp_path / "policy").resolve())
    # what earlier cleaners recorded (relative to the command's directory, or absolute) reads inside this root
    for old in ("workspace/runs/r/checkpoints/iteration=0001", "/elsewhere/runs/ws/runs/r/checkpoints/iteration=0001"):
        assert resolve_recorded(root, old) == root / "runs/r/checkpoints/iteration=0001"
    assert str(resolve_recorded(root, "/opt/policies/tiny")) == "/opt/policies/tiny"  # outside any store
    (root / "policy").mkdir(parents=True)  # an initial policy kept inside the store is recorded relative to it
    assert record_path(root, root / "policy") == "policy" and resolve_recorded(root, "policy") == root / "policy"


def test_a_moved_store_works_from_another_directory_without_the_original(uninterrupted, tmp_path):
    original, moved, elsewhere = tmp_path / "original", tmp_path / "moved", tmp_path / "elsewhere"
    shutil.copytree(uninterrupted / "runs", original / "runs")
    elsewhere.mkdir()
    first = _replay(original, elsewhere)
    assert first.returncode == 0, first.stderr[-2000:]
    raw1 = read_manifest(RunLayout(original, "tiny").raw_dir(1))
    replayed = RunLayout(original, "tiny").purified_dir(1, "saar", 0.3)
    assert read_manifest(replayed).inputs == ["runs/tiny/iteration=0001/raw/_MANIFEST.json"]
    assert read_manifest(replayed).extra["checkpoint"] == "runs/tiny/checkpoints/iteration=0001"
    assert "checkpoints/iteration=0001" in raw1.inputs[0]
    shutil.copytree(original, moved)
    shutil.rmtree(RunLayout(moved, "tiny").purified_dir(1, "saar", 0.3))  # replayed again in the copy
    shutil.rmtree(original)  # whatever the copy reads, it cannot be the original's
    second = _replay(moved, elsewhere)
    assert second.returncode == 0, second.stderr[-2000:]
    again = read_manifest(RunLayout(moved, "tiny").purified_dir(1, "saar", 0.3))
    assert again.rows > 0 and again.extra["checkpoint"] == "runs/tiny/checkpoints/iteration=0001"  # the copy's own
    assert [ln for ln in second.stdout.splitlines() if "│" in ln] == [
        ln for ln in first.stdout.splitlines() if "│" in ln
    ]


def test_a_copied_catalog_file_refuses_to_read_the_originals_shards(uninterrupted, tmp_path):
    """The published catalog.duckdb holds absolute paths: opened in a copied workspace (by the duckdb CLI, a
    notebook) its views fail, naming the file they were published as, until a cleaner command publishes it there."""
    import duckdb
    import pytest

    from storage.catalog import publish

    original, copy = tmp_path / "original", tmp_path / "copy"
    shutil.copytree(uninterrupted / "runs", original / "runs")
    publish(original, original / "catalog.duckdb")
    with duckdb.connect(str(original / "catalog.duckdb"), read_only=True) as con:
        rows = con.sql("SELECT count(*) FROM raw_trajectories").fetchall()[0][0]
    with duckdb.connect() as con:  # a notebook attaching it under a name of its own
        con.execute(f"ATTACH '{original / 'catalog.duckdb'}' AS c (READ_ONLY)")
        assert con.sql("SELECT count(*) FROM c.raw_trajectories").fetchall()[0][0] == rows > 0
    shutil.copytree(original, copy)
    for view in ("raw_trajectories", "purified", "raw_summary", "metrics", "raw_kinds", "raw_texts"):
        with duckdb.connect(str(copy / "catalog.duckdb"), read_only=True) as con:
            with pytest.raises(duckdb.Error, match=f"published as {original / 'catalog.duckdb'}.*storage.root"):
                con.sql(f"SELECT count(*) FROM {view}").fetchall()
    out = run_cleaner(["inspect", f"storage.root={copy}"], cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    shutil.rmtree(original)
    with duckdb.connect(str(copy / "catalog.duckdb"), read_only=True) as con:
        assert con.sql("SELECT count(*) FROM raw_trajectories").fetchall()[0][0] == rows
