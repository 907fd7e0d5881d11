"""The scan index and the packs (issue #31 §2, storage/shard_index.py, storage/packs.py): a process finds the
committed, validated shards of a root through one index file instead of every manifest and verification
record, and the default tables read a few packs instead of a file per shard; neither ever lets a changed,
added or failing file into the views, whatever state the index or a pack is in."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from benchmarks.store_generator import build
from storage import packs, shard_index, shards
from storage.catalog import Catalog, publish
from storage.layout import RunLayout
from storage.shards import read_manifest

ITERATIONS = 12
ROOT = Path(__file__).resolve().parent.parent
QUERIES = {
    "raw": "SELECT iteration, count(*) AS n, sum(reward) AS r FROM raw_trajectories GROUP BY ALL ORDER BY ALL",
    "raw_summary": "SELECT * EXCLUDE (stats) FROM raw_summary ORDER BY ALL",
    "purified_summary": "SELECT * FROM purified_summary ORDER BY ALL",
    "purify_compare": "SELECT * FROM purify_compare ORDER BY ALL",
    "metrics": "SELECT * FROM metrics ORDER BY ALL",
}


@pytest.fixture()
def settle(monkeypatch):
    """Identities count as settled 0.1 s after they were taken (2 s in use): tests wait that long, not 2 s."""
    monkeypatch.setattr(shard_index, "SETTLE_NS", 100_000_000)
    monkeypatch.setattr(packs, "PACK_FILES", 4)
    monkeypatch.setattr(packs, "MERGE", 2)
    return lambda: time.sleep(0.2)


@pytest.fixture()
def store(tmp_path, settle):
    root = tmp_path / "store"
    build(root, ITERATIONS, rows=4, tokens=16, log=None)
    # a replay under another similarity measure: its rows' measure comes from its folder's name
    layout = RunLayout(root, "scale")
    for i in range(ITERATIONS):
        shutil.copytree(layout.purified_dir(i, "saar", 0.5), layout.purified_dir(i, "saar", 0.5, "difflib-segment"))
    settle()
    return root


@pytest.fixture()
def store_indexed(store, settle):
    """The store once every shard is in the index: the copied partitions' folders change when their first check
    writes their records, so they are indexed by the scan after (once settled)."""
    for _ in range(2):
        Catalog(store).close()
        settle()
    assert _validated(lambda: Catalog(store).close()) == 0
    return store


def _rows(root: Path) -> dict[str, list[dict]]:
    with Catalog(root) as cat:
        return {name: cat.query(sql).to_pylist() for name, sql in QUERIES.items()}


def _bad(root: Path) -> list[Path]:
    with Catalog(root) as cat:
        return [p.path for p in cat.problems if p.committed]


def _index(root: Path) -> Path:
    return root / packs.FOLDER / shard_index.INDEX


def _validated(fn) -> int:
    before = shard_index.VALIDATED
    fn()
    return shard_index.VALIDATED - before


def test_packs_and_the_index_change_no_row(store, monkeypatch):
    with monkeypatch.context() as m:  # the views as they were: every file read one by one, no index
        m.setattr(packs, "PACK_FILES", 10**9)
        m.setattr(shard_index, "INDEX", "absent.json")
        m.setattr(shard_index, "SETTLE_NS", 10**18)
        plain = _rows(store)
    assert _rows(store) == plain  # the first scan builds the index and the packs ...
    scanned = shard_index.scan(store)
    assert all(scanned.packs[kind] for kind in packs.KINDS)  # ... which the views now read
    assert _rows(store) == plain
    measures = {r["measure"] for r in plain["purified_summary"]}
    assert measures == {"rapidfuzz-segment", "difflib-segment"}
    assert len(plain["raw_summary"]) == ITERATIONS * 4


def test_a_second_process_uses_the_index_without_reading_a_manifest(store):
    # The child counts every manifest and verification record it reads, and every part read in full.
    code = """if 1:
        import json, sys
        from storage import shard_index, shards, verified
        shard_index.SETTLE_NS = 100_000_000
        reads = {"manifests": 0, "records": 0}
        load, record = shards.Manifest.load.__func__, verified.load
        def counted_manifest(cls, path):
            reads["manifests"] += 1
            return load(cls, path)
        def counted_record(directory):
            reads["records"] += 1
            return record(directory)
        shards.Manifest.load = classmethod(counted_manifest)
        verified.load = counted_record
        from storage.catalog import Catalog
        with Catalog(sys.argv[1]) as cat:
            n = cat.query("SELECT count(*) AS n FROM raw_summary").to_pylist()[0]["n"]
        print(json.dumps({**reads, "parts": shards.FULL_READS, "validated": shard_index.VALIDATED, "rows": n}))
    """
    env = {**os.environ, "PYTHONPATH": str(ROOT)}

    def child() -> dict:
        p = subprocess.run(
            [sys.executable, "-c", code, str(store)], capture_output=True, text=True, env=env, timeout=300
        )
        assert p.returncode == 0, p.stderr[-2000:]
        return json.loads(p.stdout)

    shard_count = ITERATIONS * 4  # raw, two purified partitions, metrics
    first = child()
    assert first["validated"] == shard_count and first["manifests"] >= shard_count
    assert first["parts"] == ITERATIONS  # the copied partitions (new inodes: their records do not vouch for them)
    # Their folders changed when their records were written: indexed by the next scan once that has settled
    second = child()
    assert second["parts"] == 0 and second["validated"] == ITERATIONS
    time.sleep(0.2)
    third = child()
    assert third == {"manifests": 0, "records": 0, "parts": 0, "validated": 0, "rows": ITERATIONS * 4}


@pytest.mark.parametrize(
    "change",
    ["part: same size, other bytes", "part: another size", "summary held by a pack", "manifest rewritten in place"],
)
def test_a_file_changed_after_it_was_indexed_is_caught(store_indexed, change):
    store = store_indexed
    before = _rows(store)
    d = RunLayout(store, "scale").raw_dir(3)
    manifest = read_manifest(d)
    name = {
        "summary held by a pack": manifest.extra["summaries"][0]["name"],
        "manifest rewritten in place": shards.MANIFEST,
    }.get(change, manifest.parts[0].name)
    path = d / name
    assert (
        any(str(path) in held for _, _, held in shard_index.scan(store).packs["raw_summary"]) or "summary" not in change
    )
    st = os.stat(path)
    data = bytearray(path.read_bytes())
    if change == "part: another size":
        data += b"\0"
    elif change == "manifest rewritten in place":  # the same length: another crc32 for its part
        doc = json.loads(data)
        doc["parts"][0]["crc32"] = f"{int(doc['parts'][0]['crc32'], 16) ^ 1:08x}"
        data = bytearray(json.dumps(doc, indent=1).encode())
        assert len(data) == st.st_size
    else:
        data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))  # even with its mtime put back
    assert _bad(store) == [d]
    after = _rows(store)
    assert [r for r in before["raw_summary"] if r["iteration"] != 3] == after["raw_summary"]  # nothing of it is read
    assert not any(str(path) in held for _, _, held in shard_index.scan(store).packs["raw_summary"])


@pytest.mark.parametrize(
    "damage",
    [
        "deleted",
        "garbage",
        "truncated",
        "another version",
        "forged without its digest",
        "stale (from before the change)",
    ],
)
def test_a_corrupt_stale_or_deleted_index_is_safe(store_indexed, damage):
    store = store_indexed
    expected = _rows(store)
    index = _index(store)
    saved = index.read_bytes()
    d = RunLayout(store, "scale").raw_dir(5)
    part = d / read_manifest(d).parts[0].name
    st = os.stat(part)
    data = bytearray(part.read_bytes())
    data[100] ^= 0xFF  # a corrupt part ...
    part.write_bytes(bytes(data))
    os.utime(part, ns=(st.st_atime_ns, st.st_mtime_ns))
    header, _, body = saved.partition(b"\n")
    if damage == "deleted":
        index.unlink()
    elif damage == "garbage":
        index.write_bytes(b"{not json")
    elif damage == "truncated":
        index.write_bytes(saved[: len(saved) // 2])
    elif damage == "another version":
        index.write_bytes(json.dumps({**json.loads(header), "version": 0}).encode() + b"\n" + body)
    elif damage == "forged without its digest":  # ... and an index that vouches for its new identity
        doc = json.loads(body)
        entry = doc["shards"][str(d.relative_to(store))]
        names = [*entry[2], *(entry[3] or ()), *entry[4]]
        entry[0] = shard_index._ids_digest(
            [
                shard_index.identity(d),
                shard_index.identity(d / shards.MANIFEST),
                *[shard_index.identity(d / n) for n in names],
            ]
        )
        index.write_bytes(header + b"\n" + json.dumps(doc).encode())
    else:
        index.write_bytes(saved)
    assert _bad(store) == [d]
    assert _rows(store)["raw_summary"] == [r for r in expected["raw_summary"] if r["iteration"] != 5]


def test_a_part_beside_an_indexed_manifest_is_caught(store_indexed):
    store = store_indexed
    Catalog(store).close()
    d = RunLayout(store, "scale").purified_dir(2, "saar", 0.5)
    shutil.copy(d / "part-00000.parquet", d / "part-00001.parquet")
    with Catalog(store) as cat:
        assert [str(p) for p in cat.problems] == [f"{d}: parts not in the manifest: ['part-00001.parquet']"]


def test_new_and_removed_shards_are_seen_and_only_new_ones_validated(store_indexed, settle):
    store = store_indexed
    Catalog(store).close()
    build(store, 2, rows=4, tokens=16, start=ITERATIONS, log=None)  # two more iterations ...
    shutil.rmtree(RunLayout(store, "scale").iteration_dir(0))  # ... and the first one gone
    settle()
    validated = shard_index.VALIDATED
    iterations = [r["iteration"] for r in _rows(store)["raw"]]
    assert iterations == list(range(1, ITERATIONS + 2))
    assert shard_index.VALIDATED - validated == 2 * 3  # the new shards only (raw, purified, metrics)


def test_fresh_identities_are_not_indexed(store, monkeypatch):
    """A file changed within its clock tick keeps its identity: identities younger than SETTLE_NS are not
    recorded, so such shards are validated from their manifests again by the next scan."""
    monkeypatch.setattr(shard_index, "SETTLE_NS", 3600 * 10**9)
    Catalog(store).close()
    assert _validated(lambda: Catalog(store).close()) == ITERATIONS * 4


def test_a_changed_pack_is_not_read(store_indexed):
    store = store_indexed
    expected = _rows(store)
    scanned = shard_index.scan(store)
    pack = Path(scanned.packs["purified_summary"][0][0])
    data = bytearray(pack.read_bytes())
    data[len(data) // 2] ^= 0xFF
    pack.write_bytes(bytes(data))
    used = [Path(p) for p, _, _ in shard_index.scan(store).packs["purified_summary"]]
    assert all(p.read_bytes() != bytes(data) for p in used)  # not read: its files are packed again
    assert _rows(store) == expected


def test_unused_packs_are_removed_after_a_grace_period(store_indexed, monkeypatch, settle):
    store = store_indexed
    Catalog(store).close()
    old = {p for ps in shard_index.scan(store).packs.values() for p, _, _ in ps}
    shutil.rmtree(RunLayout(store, "scale").iteration_dir(0))  # every pack that held one of its files goes
    settle()
    scanned = shard_index.scan(store)
    unused = old - {p for ps in scanned.packs.values() for p, _, _ in ps}
    assert unused and all(Path(p).exists() for p in unused)  # a catalog published before may still read them
    monkeypatch.setattr(packs, "GRACE_S", 0)
    shard_index.scan(store)
    assert not any(Path(p).exists() for p in unused)


def test_publish_keeps_a_current_catalog_and_rebuilds_any_other(store_indexed, settle):
    store = store_indexed
    db = store / "catalog.duckdb"

    def identity() -> tuple[int, int]:
        st = os.stat(db)
        return st.st_ino, st.st_mtime_ns

    publish(store, db)
    first = identity()
    publish(store, db)  # nothing changed: the file is kept
    assert identity() == first
    build(store, 1, rows=4, tokens=16, start=ITERATIONS, log=None)
    publish(store, db)  # a new commit: rebuilt
    assert identity() != first
    time.sleep(0.05)
    shutil.copy(db, db.with_name("copy.duckdb"))
    os.replace(db.with_name("copy.duckdb"), db)  # another file in its place (a copy of it, even)
    copied = identity()
    time.sleep(0.05)
    publish(store, db)
    assert identity() != copied
    import duckdb

    with duckdb.connect(str(db), read_only=True) as con:
        assert con.sql("SELECT max(iteration) FROM raw_trajectories").fetchall() == [(ITERATIONS,)]


def _index_doc(root: Path) -> dict:
    return json.loads(_index(root).read_bytes().partition(b"\n")[2])


def test_an_indexed_iteration_is_one_entry_and_a_new_partition_in_it_is_seen(store_indexed, settle):
    store = store_indexed
    Catalog(store).close()
    its = _index_doc(store)["iterations"]
    assert sorted(its) == [f"runs/scale/iteration={i:04d}" for i in range(ITERATIONS)]
    assert its["runs/scale/iteration=0004"][2] == [
        "metrics/stage=update",
        "purified/mode=saar/gamma=0.50",
        "purified/mode=saar/gamma=0.50-difflib-segment",
        "raw",
    ]
    before = _rows(store)["purified_summary"]
    layout = RunLayout(store, "scale")
    new = layout.purified_dir(4, "saar", 0.7)
    shutil.copytree(layout.purified_dir(4, "saar", 0.5), new)  # a replay's partition, in an indexed iteration
    assert len(_rows(store)["purified_summary"]) == len(before) + 4
    assert str(new / "part-00000.parquet") in [p for s in shard_index.scan(store).shards["purified"] for p in s.parts]


def test_a_folder_without_a_manifest_keeps_its_iteration_checked_folder_by_folder(store_indexed, settle):
    """An empty shard folder is no shard, so the iteration's digest could not cover a part written into it
    later: such an iteration is not indexed as one entry, and the part is named as soon as it appears."""
    store = store_indexed
    d = RunLayout(store, "scale").purified_dir(6, "saar", 0.7)
    d.mkdir(parents=True)
    settle()
    for _ in range(2):
        Catalog(store).close()
        settle()
    assert "runs/scale/iteration=0006" not in _index_doc(store)["iterations"]
    shutil.copy(RunLayout(store, "scale").purified_dir(6, "saar", 0.5) / "part-00000.parquet", d)
    with Catalog(store) as cat:
        assert [(p.path, p.committed) for p in cat.problems] == [(d, False)]


def test_a_committed_shard_that_lost_its_manifest_is_bad_not_uncommitted(store_indexed):
    """A raw folder of parts without a manifest is a stage still writing, unless a committed shard of its iteration
    records that manifest as its input: then the shard was committed and lost its manifest since. `inspect --verify`
    names it BAD and exits 1 (before: 'uncommitted', exit 0, and the report left the iteration out silently)."""
    store = store_indexed
    layout = RunLayout(store, "scale")
    purified = layout.purified_dir(3, "saar", 0.5) / "_MANIFEST.json"
    doc = json.loads(purified.read_text())
    doc["inputs"] = ["runs/scale/iteration=0003/raw/_MANIFEST.json"]  # what the purify stage records
    purified.write_text(json.dumps(doc))
    (layout.raw_dir(3) / "_MANIFEST.json").unlink()
    (layout.raw_dir(4) / "_MANIFEST.json").unlink()  # named by no shard: a stage writing it, as before
    with Catalog(store) as cat:
        found = {p.path: (p.committed, p.message) for p in cat.problems}
    assert found[layout.raw_dir(3)][0] and str(purified) in found[layout.raw_dir(3)][1], found
    assert found[layout.raw_dir(4)][0] is False, found
    out = subprocess.run(
        [sys.executable, "-m", "flows.cli", "inspect", "--verify", f"storage.root={store}"],
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        timeout=300,
    )
    assert out.returncode == 1, out.stdout + out.stderr
    assert f"BAD {layout.raw_dir(3)}: committed, but its _MANIFEST.json is gone" in out.stderr, out.stderr


def test_a_publish_scans_the_root_in_its_turn(store_indexed, settle):
    """Two publishes at once renamed in the order they finished: one that had scanned before a commit could replace
    the other's newer file and leave the commit out of the catalog. A publish scans once it has its turn."""
    import fcntl
    import threading

    import duckdb

    store = store_indexed
    db = store / "catalog.duckdb"
    publish(store, db)
    fd = os.open(db.with_name(".catalog.duckdb.lock"), os.O_RDONLY)
    fcntl.flock(fd, fcntl.LOCK_EX)  # another publish has its turn
    late = threading.Thread(target=publish, args=(store, db))
    late.start()
    time.sleep(0.5)
    assert late.is_alive()  # it waits
    build(store, 1, rows=4, tokens=16, start=ITERATIONS, log=None)  # committed while it waited
    settle()
    os.close(fd)
    late.join(timeout=60)
    with duckdb.connect(str(db), read_only=True) as con:
        assert con.sql("SELECT max(iteration) FROM raw_trajectories").fetchall() == [(ITERATIONS,)]


def test_a_write_ahead_log_a_killed_session_left_does_not_break_the_next_catalog(store_indexed, settle):
    """A duckdb session that wrote into the published file and was killed left `catalog.duckdb.wal`; DuckDB replayed
    it into the next published file and refused every open ("WAL does not match database file")."""
    import duckdb

    store = store_indexed
    db = store / "catalog.duckdb"
    publish(store, db)
    notes = "CREATE TABLE my_notes AS SELECT 42 AS x"
    write = f"import duckdb, os\ncon = duckdb.connect({str(db)!r})\ncon.execute({notes!r})\nos._exit(0)"
    subprocess.run([sys.executable, "-c", write], check=True)  # killed: no checkpoint, no close
    assert db.with_name("catalog.duckdb.wal").is_file()
    build(store, 1, rows=4, tokens=16, start=ITERATIONS, log=None)
    settle()
    publish(store, db)
    with duckdb.connect(str(db), read_only=True) as con:
        assert con.sql("SELECT max(iteration) FROM raw_trajectories").fetchall() == [(ITERATIONS,)]
        assert "my_notes" not in {t for (t,) in con.sql("SHOW TABLES").fetchall()}
