"""storage/: round trips, atomic commits under SIGKILL, and validation errors that name the file."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from tests.synthetic import synthetic_trajectories
from pipeline.trajectory import trajectory_from_row, trajectory_to_row
from storage.catalog import Catalog
from storage.layout import RunLayout, format_threshold
from storage.schemas import RAW
from storage.shards import (
    MANIFEST,
    ShardError,
    ShardMissing,
    ShardWriter,
    is_committed,
    read_manifest,
    read_shard,
    write_shard,
)

ROOT = Path(__file__).resolve().parent.parent


def raw_table(n: int, seed: int = 0, **kw) -> pa.Table:
    return pa.Table.from_pylist([trajectory_to_row(t) for t in synthetic_trajectories(n, seed, **kw)], schema=RAW)


def test_round_trip_through_parquet_and_duckdb_views(tmp_path):
    trajectories = synthetic_trajectories(12, seed=3, run_id="rt")
    assert any(len(p.attempts) > 2 for t in trajectories for p in t.positions), "fixture needs retries"
    layout = RunLayout(tmp_path, "rt")
    table = pa.Table.from_pylist([trajectory_to_row(t) for t in trajectories], schema=RAW)
    write_shard(layout.raw_dir(0), table, RAW, config_hash="abc", rows_per_part=5)

    back = [trajectory_from_row(r) for r in read_shard(layout.raw_dir(0), RAW).to_pylist()]
    assert back == trajectories

    with Catalog(tmp_path) as cat:
        rows = cat.query("SELECT * FROM raw_trajectories ORDER BY prompt_id, sample_idx").to_pylist()
        assert [trajectory_from_row(r) for r in rows] == trajectories
        attempts = cat.query("SELECT count(*) AS n FROM raw_attempts").to_pylist()[0]["n"]
        assert attempts == sum(len(p.attempts) for t in trajectories for p in t.positions)
        failures = cat.query("SELECT count(*) AS n FROM raw_attempts WHERE status = 'failure'").to_pylist()[0]["n"]
        assert failures == sum(a.failed for t in trajectories for p in t.positions for a in p.attempts)


def test_manifest_records_counts_and_parts(tmp_path):
    m = write_shard(tmp_path / "s", raw_table(11), RAW, config_hash="h1", inputs=["x/_MANIFEST.json"], rows_per_part=4)
    assert m.rows == 11 and [p.rows for p in m.parts] == [4, 4, 3]
    assert read_manifest(tmp_path / "s") == m
    assert is_committed(tmp_path / "s", "h1") and not is_committed(tmp_path / "s", "other")


def test_committed_shard_is_never_overwritten(tmp_path):
    write_shard(tmp_path / "s", raw_table(3), RAW, config_hash="h1")
    before = (tmp_path / "s" / "part-00000.parquet").read_bytes()
    with pytest.raises(ShardError, match="already committed"):
        write_shard(tmp_path / "s", raw_table(5, seed=9), RAW, config_hash="h2")
    assert (tmp_path / "s" / "part-00000.parquet").read_bytes() == before


def test_failed_write_leaves_nothing_committed(tmp_path):
    with pytest.raises(RuntimeError):
        with ShardWriter(tmp_path / "s", RAW, "h", rows_per_part=2) as w:
            w.write(raw_table(5))
            raise RuntimeError("stage crashed")
    assert not (tmp_path / "s" / MANIFEST).exists()
    assert not list((tmp_path / "s").glob("part-*"))
    with pytest.raises(ShardMissing):
        read_shard(tmp_path / "s", RAW)


def test_an_interrupt_after_the_manifest_is_renamed_in_keeps_the_shard(tmp_path, monkeypatch):
    """Ctrl-C right after the manifest's rename (in the fsync of the folder that makes it durable) ran the writer's
    abort: the parts were deleted and the manifest kept, and every rerun found the shard "committed: kept" and then
    "listed in the manifest but missing"."""
    import storage.shards as shards

    calls = []
    fsync_dir = shards._fsync_dir

    def interrupted_second_time(d):
        calls.append(d)
        if len(calls) == 2:
            raise KeyboardInterrupt
        fsync_dir(d)

    monkeypatch.setattr(shards, "_fsync_dir", interrupted_second_time)
    with pytest.raises(KeyboardInterrupt):
        with ShardWriter(tmp_path / "s", RAW, "h", rows_per_part=2) as w:
            w.write(raw_table(5))
    assert len(calls) == 2
    assert read_shard(tmp_path / "s", RAW).num_rows == 5


def test_an_interrupt_as_the_manifest_rename_returns_keeps_the_shard(tmp_path, monkeypatch):
    """The other side of the rename: an interrupt the moment it returned must not reach the writer's abort (the
    commit's except branch that finds the manifest in place; the flag is now also set before anything else runs)."""
    import storage.shards as shards

    from tests.flow_helpers import interrupted_after

    interrupted_after(monkeypatch, shards, "_atomic_write_bytes")
    with pytest.raises(KeyboardInterrupt):
        with ShardWriter(tmp_path / "s", RAW, "h", rows_per_part=2) as w:
            w.write(raw_table(5))
    assert read_shard(tmp_path / "s", RAW).num_rows == 5


SLOW_WRITER = """
import sys, time
sys.path.insert(0, {root!r})
import pyarrow as pa
from tests.synthetic import synthetic_trajectories
from pipeline.trajectory import trajectory_to_row
from storage.schemas import RAW
from storage.shards import ShardWriter
rows = [trajectory_to_row(t) for t in synthetic_trajectories(40, seed=5)]
with ShardWriter({out!r}, RAW, "cfg", rows_per_part=10) as w:
    for i in range(0, 40, 10):
        w.write(pa.Table.from_pylist(rows[i:i + 10], schema=RAW))
        print("part", i // 10, flush=True)
        time.sleep({pause})
"""


def test_sigkill_mid_shard_leaves_no_manifest_and_rerun_is_identical(tmp_path):
    out = tmp_path / "killed"
    proc = subprocess.Popen(
        [sys.executable, "-c", SLOW_WRITER.format(root=str(ROOT), out=str(out), pause=30)],
        stdout=subprocess.PIPE,
        text=True,
    )
    assert proc.stdout.readline().strip() == "part 0"
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=30)
    assert list(out.glob("part-*.parquet")), "the writer should have flushed a part before it was killed"
    assert not (out / MANIFEST).exists()
    assert not is_committed(out)
    with pytest.raises(ShardMissing, match="no _MANIFEST.json"):
        read_shard(out, RAW)

    # Rerun the same stage to completion; compare with an uninterrupted run of the same input.
    subprocess.run(
        [sys.executable, "-c", SLOW_WRITER.format(root=str(ROOT), out=str(out), pause=0)],
        check=True,
        stdout=subprocess.DEVNULL,
    )
    reference = tmp_path / "reference"
    subprocess.run(
        [sys.executable, "-c", SLOW_WRITER.format(root=str(ROOT), out=str(reference), pause=0)],
        check=True,
        stdout=subprocess.DEVNULL,
    )
    assert read_shard(out, RAW).equals(read_shard(reference, RAW))
    got, want = read_manifest(out), read_manifest(reference)
    assert [(p.name, p.rows, p.crc32) for p in got.parts] == [(p.name, p.rows, p.crc32) for p in want.parts]


def test_a_second_writer_of_a_shard_is_refused_while_the_first_lives(tmp_path):
    """Two writers of one shard (two `cleaner train` of one run, a rollout started twice) each removed the other's
    files as a crashed attempt's leftovers and both committed: a manifest listed a part the other had deleted. Now
    the shard has one writer at a time (a lock the kernel drops when its process dies): another live writer is
    refused in one line naming its pid, and nothing of the first's is touched."""
    from storage.locks import Busy

    out = tmp_path / "shared"
    proc = subprocess.Popen(
        [sys.executable, "-c", SLOW_WRITER.format(root=str(ROOT), out=str(out), pause=30)],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stdout.readline().strip() == "part 0"
        parts = sorted(p.name for p in out.iterdir())
        with pytest.raises(Busy) as e:
            ShardWriter(out, RAW, "cfg", rows_per_part=10)
        assert f"(pid {proc.pid})" in str(e.value) and "\n" not in str(e.value) and str(out) in str(e.value)
        assert sorted(p.name for p in out.iterdir()) == parts  # the live writer's files are all there
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
    # its process is gone, and its lock with it: the next writer goes on, and the shard commits whole
    write_shard(out, raw_table(4), RAW, "cfg", rows_per_part=10)
    assert read_shard(out, RAW).num_rows == 4 and not (out / ".writer.lock").exists()


def test_a_shard_committed_meanwhile_with_the_same_settings_is_kept(tmp_path):
    """A writer that finds the shard committed by another process with its config hash keeps that one (it said
    'refusing to overwrite it' and failed after a whole stage's work); with another hash it is still refused."""
    from storage.shards import CommittedMeanwhile

    first = write_shard(tmp_path / "s", raw_table(3), RAW, config_hash="h")
    again = write_shard(tmp_path / "s", raw_table(5, seed=2), RAW, config_hash="h")
    assert again.rows == first.rows == 3 and read_shard(tmp_path / "s", RAW).num_rows == 3
    with pytest.raises(CommittedMeanwhile, match="already committed with the same settings"):
        ShardWriter(tmp_path / "s", RAW, "h")
    with pytest.raises(ShardError, match="refusing to overwrite it"):
        ShardWriter(tmp_path / "s", RAW, "other")


@pytest.fixture
def committed(tmp_path) -> Path:
    d = tmp_path / "shard"
    write_shard(d, raw_table(6), RAW, config_hash="h", rows_per_part=3)
    return d


def test_corrupt_parquet_is_named(committed):
    part = committed / "part-00001.parquet"
    data = bytearray(part.read_bytes())
    data[len(data) // 2 : len(data) // 2 + 64] = b"\x00" * 64
    part.write_bytes(bytes(data))
    with pytest.raises(ShardError, match=r"part-00001\.parquet: checksum mismatch"):
        read_shard(committed, RAW)
    with pytest.raises(ShardError, match=r"part-00001\.parquet: corrupt Parquet"):
        read_shard(committed, RAW, verify_checksums=False)


def _rewrite_part(committed: Path, table: pa.Table) -> None:
    """Replace part 0 and patch the manifest so only the content check can catch the problem."""
    part = committed / "part-00000.parquet"
    pq.write_table(table, part)
    manifest = json.loads((committed / MANIFEST).read_text())
    import zlib

    data = part.read_bytes()
    manifest["parts"][0].update(bytes=len(data), crc32=f"{zlib.crc32(data) & 0xFFFFFFFF:08x}")
    (committed / MANIFEST).write_text(json.dumps(manifest))


def test_missing_column_is_named(committed):
    table = pq.read_table(committed / "part-00000.parquet")
    _rewrite_part(committed, table.drop_columns(["positions"]))
    with pytest.raises(ShardError, match=r"part-00000\.parquet: missing column 'positions'"):
        read_shard(committed, RAW)


def test_wrong_schema_version_is_named(committed):
    table = pq.read_table(committed / "part-00000.parquet")
    _rewrite_part(committed, table.replace_schema_metadata({b"cleaner.schema": b"raw/0"}))
    with pytest.raises(ShardError, match=r"part-00000\.parquet: schema version raw/0, expected raw/2"):
        read_shard(committed, RAW)
    manifest = json.loads((committed / MANIFEST).read_text())
    manifest["schema"] = "raw/9"
    (committed / MANIFEST).write_text(json.dumps(manifest))
    with pytest.raises(ShardError, match=r"_MANIFEST\.json: schema version raw/9, expected raw/2"):
        read_shard(committed, RAW)


def test_manifest_count_disagreement_is_named(committed):
    manifest = json.loads((committed / MANIFEST).read_text())
    manifest["parts"][1]["rows"] = 7
    (committed / MANIFEST).write_text(json.dumps(manifest))
    with pytest.raises(ShardError, match=r"part-00001\.parquet: 3 rows, manifest says 7"):
        read_shard(committed, RAW)


def test_unreadable_manifest_and_unlisted_part(committed):
    (committed / "part-00009.parquet").write_bytes(b"stray")
    with pytest.raises(ShardError, match="parts not in the manifest"):
        read_shard(committed, RAW)
    (committed / MANIFEST).write_text("{not json")
    with pytest.raises(ShardError, match="unreadable manifest"):
        read_shard(committed, RAW)


def test_catalog_ignores_uncommitted_parts_and_serves_empty_views(tmp_path):
    layout = RunLayout(tmp_path, "r1")
    with Catalog(tmp_path) as cat:
        assert cat.query("SELECT count(*) AS n FROM raw_trajectories").to_pylist()[0]["n"] == 0
        assert cat.query("SELECT count(*) AS n FROM purify_compare").to_pylist()[0]["n"] == 0
    write_shard(layout.raw_dir(0), raw_table(4, run_id="r1"), RAW, config_hash="h")
    crashed = layout.raw_dir(1)
    crashed.mkdir(parents=True)
    pq.write_table(raw_table(3, run_id="r1"), crashed / "part-00000.parquet")  # no manifest
    with Catalog(tmp_path, tmp_path / "catalog.duckdb") as cat:
        assert cat.query("SELECT count(*) AS n FROM raw_trajectories").to_pylist()[0]["n"] == 4
    # The views persist in the DuckDB file for users' own sessions.
    import duckdb

    con = duckdb.connect(str(tmp_path / "catalog.duckdb"), read_only=True)
    assert con.sql("SELECT count(*) FROM raw_attempts").fetchall()[0][0] > 0
    con.close()


def test_layout_paths():
    layout = RunLayout(Path("/r"), "run")
    assert str(layout.purified_dir(7, "saar", 0.5)) == "/r/runs/run/iteration=0007/purified/mode=saar/gamma=0.50"
    assert format_threshold(1.01) == "1.01" and format_threshold(0.125) == "0.125" and format_threshold(0) == "0.00"
    with pytest.raises(ValueError):
        RunLayout(Path("/r"), "../escape")


@pytest.mark.parametrize("folder", ["it's here", "two\nlines"])
def test_views_read_a_root_whose_path_has_a_quote_or_a_newline(tmp_path, folder):
    """The views list their files as one string split at newlines (storage.catalog._sql_list), or as a list of
    literals when a path holds a newline: both read every committed shard, quotes escaped."""
    from benchmarks.store_generator import build

    root = tmp_path / folder
    build(root, 3, rows=2, tokens=8, log=None)
    with Catalog(root) as cat:
        assert not cat.problems
        assert cat.query(
            "SELECT iteration, count(*) AS n FROM raw_trajectories GROUP BY ALL ORDER BY ALL"
        ).to_pylist() == [{"iteration": i, "n": 2} for i in range(3)]
        assert cat.query("SELECT count(*) AS n FROM purified").to_pylist() == [{"n": 6}]


def test_raw_rows_of_schema_v1_read_as_v2_beside_v2_rows(tmp_path):
    """Raw schema v2 adds `reward_reason`: a shard written before reads with it empty, in Python and in the catalog,
    beside v2 shards that carry it."""
    from storage.schemas import RAW_V1

    layout = RunLayout(tmp_path, "mixed")
    old = synthetic_trajectories(4, seed=1, run_id="mixed", iteration=0)
    write_shard(
        layout.raw_dir(0),
        raw_table(4, seed=1, run_id="mixed", iteration=0).select(RAW_V1.names).cast(RAW_V1),
        RAW_V1,
        config_hash="v1",
    )
    new = synthetic_trajectories(4, seed=2, run_id="mixed", iteration=1)
    new[0].reward_reason = "test 2 of 3: wrong answer"
    write_shard(
        layout.raw_dir(1), pa.Table.from_pylist([trajectory_to_row(t) for t in new], schema=RAW), RAW, config_hash="v2"
    )
    assert [trajectory_from_row(r) for r in read_shard(layout.raw_dir(0), RAW).to_pylist()] == old
    assert [trajectory_from_row(r) for r in read_shard(layout.raw_dir(1), RAW).to_pylist()] == new
    with Catalog(tmp_path) as cat:
        rows = cat.query(
            "SELECT iteration, reward_reason FROM raw_trajectories ORDER BY iteration, prompt_id, sample_idx"
        ).to_pylist()
    assert [r["reward_reason"] for r in rows if r["iteration"] == 0] == [None] * 4
    assert "test 2 of 3: wrong answer" in [r["reward_reason"] for r in rows if r["iteration"] == 1]
