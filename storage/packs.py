"""Packs: the small files the default `cleaner inspect` tables read (row summaries, metrics), copied together so
that a query opens a few dozen files instead of one per shard.

At 2,000 iterations raw_summary, purified_summary and metrics are 2,000 files each, and every query over one of
them opens them all: a second per query, several queries per `cleaner inspect`. A whole-root scan
(storage/shard_index.py) therefore copies the rows of every PACK_FILES such files it validated into one Parquet
file under `<root>/_CATALOG_INDEX/` and merges MERGE packs of a size into one of the next (32, 256, 2,048 ...
files: at most MERGE - 1 packs per size stay, and each row is copied a few times over the store's life). The
catalog's views read the packs and, beside them, the files no pack holds.

A pack only ever holds rows of validated files: each source file is read and its crc32 checked against its
manifest's before its rows are copied, and a pack is used only while every file it was made from is still in
the scan with the same crc32 (a file removed, changed or failing validation: the pack is dropped and its
files are read one by one until the next pack of them). The pack's own bytes are checked like a part: by its
crc32 until its identity is settled (storage/shard_index.py), then by identity; any other pack is not used. A
pack is never rewritten (its name is its content's): one that the index no longer uses is deleted after GRACE_S,
so a catalog published before still reads it meanwhile.
"""

from __future__ import annotations

import hashlib
import os
import time
import zlib
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from storage.verified import identity_values

FOLDER = "_CATALOG_INDEX"
PACK_FILES = 32  # loose files of a kind and version that make a pack
MERGE = 8  # packs of one size merged into one
GRACE_S = 24 * 3600  # an unused pack is kept this long (a published catalog may still read it)
# What is packed: per pack kind, the view whose shards hold the files and which of their files
KINDS = {
    "raw_summary": ("raw_trajectories", "summaries"),
    "purified_summary": ("purified", "summaries"),
    "metrics": ("metrics", "parts"),
}
FILENAME_KINDS = ("purified_summary",)  # its views take the partition's measure from each row's file name


def _crc32(data: bytes) -> str:
    return f"{zlib.crc32(data) & 0xFFFFFFFF:08x}"


def _read(path: Path, crc32: str) -> pa.Table | None:
    """The table in `path` when its bytes have this crc32 (else None: changed since it was checked)."""
    try:
        data = path.read_bytes()
        # ParquetFile, not pq.read_table: a third of the time per small file
        return pq.ParquetFile(pa.BufferReader(data)).read() if _crc32(data) == crc32 else None
    except (OSError, pa.ArrowException):
        return None


class Packs:
    """The packs of a root: `old` as the index holds them (name -> kind, version, level, identity, crc32 and
    sources [relative path, crc32]), `files` each kind's validated files in this scan (relative path -> crc32,
    version)."""

    def __init__(
        self, root: Path, old: Any, files: dict[str, dict[str, tuple[str, str]]], settled: int, verify: bool
    ) -> None:
        self.root, self.folder, self.files, self.settled = root, root / FOLDER, files, settled
        self.writable = os.access(root, os.W_OK)  # a read-only root: nothing read to be packed
        self.packs: dict[str, dict[str, Any]] = {}
        self.created: set[str] = set()
        taken: set[str] = set()
        for name, pack in sorted(old.items()) if isinstance(old, dict) else ():
            if self._usable(name, pack, verify) and not taken & {s for s, _ in pack["sources"]}:
                self.packs[name] = pack
                taken |= {s for s, _ in pack["sources"]}

    def _usable(self, name: str, pack: Any, verify: bool) -> bool:
        try:
            if not (isinstance(pack["level"], int) and isinstance(pack["version"], str)):
                return False
            files = self.files[pack["kind"]]
            if any(files.get(s, ("",))[0] != crc for s, crc in pack["sources"]):
                return False  # a source gone, changed or failing validation
            identity, path = identity_values(self.folder / name), self.folder / name
            if identity != pack["identity"]:
                return False
            if verify or not (identity[1] < self.settled and identity[2] < self.settled):
                return _read(path, pack["crc32"]) is not None
            return True
        except (OSError, KeyError, TypeError, ValueError):
            return False

    def update(self) -> None:
        """Packs the loose files (PACK_FILES at a time), then merges packs of a size (MERGE at a time)."""
        if not self.writable:
            return
        for kind, files in self.files.items():
            held = {s for p in self.packs.values() if p["kind"] == kind for s, _ in p["sources"]}
            loose: dict[str, list[str]] = {}
            for path, (_, version) in sorted(files.items()):
                if path not in held:
                    loose.setdefault(version, []).append(path)
            for version, paths in loose.items():
                while len(paths) >= PACK_FILES:  # the largest size first: a store seen for the first time
                    level = 0
                    while len(paths) >= PACK_FILES * MERGE ** (level + 1):
                        level += 1
                    size = PACK_FILES * MERGE**level
                    self._write(kind, version, level, [(p, files[p][0]) for p in paths[:size]], None)
                    paths = paths[size:]
        level = 0
        while level <= max((p["level"] for p in self.packs.values()), default=-1):
            groups: dict[tuple[str, str], list[str]] = {}
            for name, p in sorted(self.packs.items(), key=lambda kv: kv[1]["sources"][0]):
                if p["level"] == level:
                    groups.setdefault((p["kind"], p["version"]), []).append(name)
            for (kind, version), names in groups.items():
                for i in range(0, len(names) - MERGE + 1, MERGE):
                    merged = names[i : i + MERGE]
                    sources = [s for n in merged for s in self.packs[n]["sources"]]
                    self._write(kind, version, level + 1, sources, merged)
            level += 1

    def _write(
        self,
        kind: str,
        version: str,
        level: int,
        sources: list[list[str]] | list[tuple[str, str]],
        merged: list[str] | None,
    ) -> None:
        """One pack of `sources` (read from the shard files, or from the packs `merged`), written atomically."""
        if not self.writable:
            return
        if merged is None:
            tables = [_read(self.root / s, crc) for s, crc in sources]
            if kind in FILENAME_KINDS:  # the file's path under the root, all the views' `measure` looks at
                tables = [
                    t if t is None else t.append_column("filename", pa.array([s] * t.num_rows))
                    for t, (s, _) in zip(tables, sources)
                ]
        else:
            tables = [_read(self.folder / n, self.packs[n]["crc32"]) for n in merged]
        if any(t is None for t in tables):
            return  # a file changed since its check: the next scan names it
        try:
            table = pa.concat_tables(tables)  # type: ignore[arg-type]
        except pa.ArrowInvalid:
            return  # files of one version with other columns (not written by this cleaner): left loose
        sink = pa.BufferOutputStream()
        pq.write_table(table, sink, compression="zstd")
        data = sink.getvalue().to_pybytes()
        digest = hashlib.blake2b(repr(sorted(map(tuple, sources))).encode(), digest_size=12).hexdigest()
        name = f"{kind}-{level}-{digest}.parquet"
        tmp = self.folder / f".{name}.tmp-{os.getpid()}"
        try:
            self.folder.mkdir(exist_ok=True)
            tmp.write_bytes(data)
            os.replace(tmp, self.folder / name)
            identity = identity_values(self.folder / name)
        except OSError:  # a root that cannot be written: the files stay loose
            tmp.unlink(missing_ok=True)
            self.writable = False
            return
        for n in merged or ():
            del self.packs[n]
            if n in self.created:  # made by this scan: no catalog reads it
                (self.folder / n).unlink(missing_ok=True)
        self.created.add(name)
        self.packs[name] = {
            "kind": kind,
            "version": version,
            "level": level,
            "identity": identity,
            "crc32": _crc32(data),
            "sources": [list(s) for s in sources],
        }

    def collect(self) -> None:
        """Deletes the files of the folder that no pack in use is, once older than GRACE_S."""
        try:
            entries = list(os.scandir(self.folder))
        except OSError:
            return
        for e in entries:
            try:
                if e.name not in self.packs and e.name != "index.json" and e.stat().st_mtime < time.time() - GRACE_S:
                    os.unlink(e.path)
            except OSError:
                pass

    def of(self) -> dict[str, list[tuple[str, str, set[str]]]]:
        """Per kind, the packs in use: (absolute path, version, the absolute paths of the files it holds)."""
        out: dict[str, list[tuple[str, str, set[str]]]] = {kind: [] for kind in KINDS}
        base = str(self.root) + os.sep
        for name, p in sorted(self.packs.items()):
            out[p["kind"]].append((str(self.folder / name), p["version"], {base + s for s, _ in p["sources"]}))
        return out
