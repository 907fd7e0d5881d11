"""Verification paid once (issue #31 §1): a part is checked in full once, by whichever process first needs
it, then trusted by its file identity while unchanged; a change, a copy or a bad record means a full check."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest

from storage import shards, verified
from storage.catalog import Catalog
from storage.layout import RunLayout
from storage.schemas import RAW
from storage.shards import ShardError, read_manifest, read_shard


@pytest.fixture()
def store(world_copy):
    return world_copy.storage.root


def _raw(store):
    d = RunLayout(store, "w").raw_dir(0)
    return d, read_manifest(d).parts[0]


def _reads(fn) -> int:
    before = shards.FULL_READS
    fn()
    return shards.FULL_READS - before


def test_a_part_verified_by_one_process_is_not_read_by_the_next(store):
    d, part = _raw(store)
    (d / verified.RECORD).unlink()  # as if committed by a cleaner without records: the first reader pays
    code = (
        "import sys; from storage.catalog import Catalog; from storage import shards; "
        "Catalog(sys.argv[1]).close(); print(shards.FULL_READS)"
    )
    env = {**os.environ, "PYTHONPATH": os.getcwd()}
    first = subprocess.run(
        [sys.executable, "-c", code, str(store)], capture_output=True, text=True, env=env, check=True
    )
    second = subprocess.run(
        [sys.executable, "-c", code, str(store)], capture_output=True, text=True, env=env, check=True
    )
    assert int(first.stdout) >= 1 and int(second.stdout) == 0
    assert verified.is_verified(d, part.name, part.bytes, part.crc32)
    # a reader that feeds training still reads and checks every byte
    assert _reads(lambda: read_shard(d, RAW)) == len(read_manifest(d).parts)


@pytest.mark.parametrize("change", ["same size, other bytes", "another size"])
def test_a_part_changed_after_it_was_verified_is_caught(store, change, capsys):
    d, part = _raw(store)
    path = d / part.name
    Catalog(store).close()  # the copy is checked once ...
    assert verified.is_verified(d, part.name, part.bytes, part.crc32)  # ... and recorded
    st = os.stat(path)
    data = bytearray(path.read_bytes())
    if change == "same size, other bytes":
        data[len(data) // 2] ^= 0xFF
    else:
        data += b"\\0"
    path.write_bytes(bytes(data))
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))  # even with its mtime put back
    with Catalog(store) as cat:
        assert [p.path for p in cat.problems if p.committed] == [d]
        assert "checksum mismatch" in str(cat.problems[0]) or "bytes, manifest says" in str(cat.problems[0])
    with pytest.raises(ShardError):
        read_shard(d, RAW)
    from flows.inspect import run_inspect
    from pipeline.config import load_config

    assert run_inspect(load_config(None, [f"storage.root={store}"]), verify=True) == 1
    assert f"BAD {d}" in capsys.readouterr().err


def test_a_commit_records_its_parts(tmp_path):
    import pyarrow as pa

    from storage.schemas import METRICS
    from storage.shards import write_shard

    d = RunLayout(tmp_path, "r").metrics_dir(0, "s")
    write_shard(
        d,
        pa.Table.from_pylist(
            [{"run_id": "r", "iteration": 0, "stage": "s", "step": 0, "name": "x", "value": 1.0}], schema=METRICS
        ),
        METRICS,
        "h",
    )
    part = read_manifest(d).parts[0]
    assert verified.is_verified(d, part.name, part.bytes, part.crc32)
    with Catalog(tmp_path) as cat:
        assert cat.query("SELECT count(*) AS n FROM metrics").to_pylist() == [{"n": 1}]
    assert _reads(lambda: Catalog(tmp_path).close()) == 0


@pytest.mark.parametrize("damage", ["deleted", "garbage", "forged"])
def test_a_corrupt_or_missing_record_is_safe(store, damage):
    d, part = _raw(store)
    Catalog(store).close()
    record = d / verified.RECORD
    data = bytearray((d / part.name).read_bytes())
    data[100] ^= 0xFF  # the part is corrupt ...
    st = os.stat(d / part.name)
    (d / part.name).write_bytes(bytes(data))
    if damage == "deleted":
        record.unlink()
    elif damage == "garbage":
        record.write_bytes(b"{not json")
    else:  # ... and the record claims the new identity without a valid digest
        doc = json.loads(record.read_text())
        doc["parts"][part.name].update(verified.identity(d / part.name))
        record.write_text(json.dumps(doc))
    os.utime(d / part.name, ns=(st.st_atime_ns, st.st_mtime_ns))
    with Catalog(store) as cat:
        assert [p.path for p in cat.problems if p.committed] == [d]


def test_a_copied_store_is_checked_again_once(store, tmp_path):
    copy = tmp_path / "copy"
    shutil.copytree(store / "runs", copy / "runs")  # new inodes: the records do not vouch for the copies
    assert _reads(lambda: Catalog(copy).close()) >= 1
    assert _reads(lambda: Catalog(copy).close()) == 0


@pytest.mark.parametrize("change", ["replaced", "rewritten in place"])
def test_a_part_changed_while_it_is_checked_is_not_recorded_as_verified(tmp_path, monkeypatch, change):
    """The record holds the identity the part had when its bytes were read, never one taken after: a change
    that lands between the read and the record (here, deterministically, right after the checker's read) must
    not be vouched for by bytes that were checked before it."""
    import pathlib
    import time

    import pyarrow as pa

    from storage.schemas import METRICS
    from storage.shards import check_part, write_shard

    d = RunLayout(tmp_path, "r").metrics_dir(0, "s")
    write_shard(
        d,
        pa.Table.from_pylist(
            [{"run_id": "r", "iteration": 0, "stage": "s", "step": 0, "name": "x", "value": 1.0}], schema=METRICS
        ),
        METRICS,
        "h",
    )
    part = read_manifest(d).parts[0]
    (d / verified.RECORD).unlink()  # not yet verified: the next check reads it in full
    path = d / part.name
    read = pathlib.Path.read_bytes

    def read_then_change(self: pathlib.Path) -> bytes:
        data = read(self)
        if self == path:
            bad = bytearray(data)
            bad[len(bad) // 2] ^= 0xFF  # same size, other bytes
            if change == "replaced":  # another file renamed over it: a new inode
                other = path.with_name(".other")
                other.write_bytes(bytes(bad))
                os.replace(other, path)
            else:
                time.sleep(0.05)  # past the clock's tick, so that the write changes the file's ctime
                with open(path, "r+b") as f:
                    f.write(bytes(bad))
        return data

    monkeypatch.setattr(pathlib.Path, "read_bytes", read_then_change)
    check_part(d, part, METRICS)  # the bytes it read were good
    monkeypatch.undo()
    assert not verified.is_verified(d, part.name, part.bytes, part.crc32)
    with Catalog(tmp_path) as cat:
        assert [p.path for p in cat.problems if p.committed] == [d]
        assert "checksum mismatch" in str(cat.problems[0])
