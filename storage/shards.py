"""Atomic shard writer and validating reader.

A shard is a folder of `part-NNNNN.parquet` files plus `_MANIFEST.json`, written last. Parts are
written under temporary names and renamed, then the manifest is renamed into place: a stage that
crashed leaves no manifest, so readers treat it as absent and a rerun rewrites it from scratch.
"""

from __future__ import annotations

import contextlib
import fnmatch
import json
import os
import time
import uuid
import warnings
import zlib
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator

import pyarrow as pa
import pyarrow.parquet as pq

from storage import summaries, texts, verified
from storage.errors import CleanerError, os_error
from storage.locks import WriterLock
from storage.schemas import SCHEMA_META_KEY, readable_as, schema_id, upgrade, upgrade_inputs

MANIFEST = "_MANIFEST.json"
WRITER_LOCK = ".writer.lock"  # held by the shard's one writer (storage/locks.py), gone when it ends
PART_GLOB = "part-*.parquet"


class ShardError(CleanerError, RuntimeError):
    """A shard that cannot be trusted; the message names the file and what is wrong with it."""


class CommittedMeanwhile(ShardError):
    """Another process committed this shard, with the same config hash, while this writer worked: its shard is
    the one kept (`manifest`)."""

    def __init__(self, message: str, manifest: "Manifest") -> None:
        super().__init__(message)
        self.manifest = manifest


class ShardMissing(ShardError):
    """The stage that writes this shard has not committed it (absent or crashed mid-way)."""


@dataclass
class PartInfo:
    name: str
    rows: int
    bytes: int
    crc32: str


@dataclass
class Manifest:
    schema: str
    rows: int
    parts: list[PartInfo]
    config_hash: str
    inputs: list[str] = field(default_factory=list)
    created_at: float = 0.0
    extra: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def load(cls, path: Path) -> "Manifest":
        try:
            data = json.loads(path.read_text())
            data["parts"] = [PartInfo(**p) for p in data["parts"]]
            return cls(**data)
        except (json.JSONDecodeError, KeyError, TypeError) as e:
            raise ShardError(f"{path}: unreadable manifest ({e})") from None


# Parts read in full to check them, by this process (tests count them: a part verified once, by any process,
# is not read again by the catalog).
FULL_READS = 0


def _crc32(data: bytes | memoryview) -> str:
    return f"{zlib.crc32(data) & 0xFFFFFFFF:08x}"


def _file_crc32(path: Path) -> tuple[int, str]:
    """(size, crc32) of a file read in 4 MiB blocks: a part's checksum without holding its bytes."""
    crc, size = 0, 0
    with open(path, "rb") as f:
        while block := f.read(4 << 20):
            crc, size = zlib.crc32(block, crc), size + len(block)
    return size, f"{crc & 0xFFFFFFFF:08x}"


def _fsync_dir(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _atomic_write_bytes(path: Path, data: bytes) -> None:
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)  # a full disk must not leave the temporary file behind
        raise


def atomic_write_parquet(path: Path, table: pa.Table | list[pa.Table]) -> None:
    """One Parquet file written under a unique temporary name beside `path`, then renamed over it: a
    reader (or a retried writer) sees the whole file or none, never a half-written one. A list of tables
    (one schema) is written a row group each."""
    path, groups = Path(path), [table] if isinstance(table, pa.Table) else table
    tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex[:8]}.tmp")
    try:
        with pq.ParquetWriter(str(tmp), groups[0].schema) as writer:  # what pq.write_table does for one table
            for group in groups:
                writer.write_table(group)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def read_manifest(directory: Path) -> Manifest | None:
    path = Path(directory) / MANIFEST
    return Manifest.load(path) if path.is_file() else None


def is_committed(directory: Path, config_hash: str | None = None) -> bool:
    """True when the shard was committed (and, if given, with this config hash)."""
    m = read_manifest(directory)
    return m is not None and (config_hash is None or m.config_hash == config_hash)


class ShardWriter:
    """Writes one shard atomically. Use as a context manager, or call commit() yourself.

    Refuses to touch a committed shard, whatever its config hash: nothing already written is overwritten.
    One writer at a time (storage/locks.py: another live one is refused in one line, storage.locks.Busy); orphan
    parts of a crashed earlier attempt are removed first, under that lock, so never another writer's.

    Each write() goes to the open part as it comes, as its own row group(s), so the writer holds one write's rows,
    not a part's (the purify stage commits a partition of 16k-token rows this way); a part is closed when it holds
    `rows_per_part` rows, so a shard written in one write() has one row group per part.
    """

    def __init__(
        self,
        directory: Path,
        schema: pa.Schema,
        config_hash: str,
        inputs: Iterable[str] = (),
        rows_per_part: int = 50_000,
        compression: str = "zstd",
    ) -> None:
        self.directory = Path(directory)
        self.schema = schema
        self.config_hash = config_hash
        self.inputs = list(inputs)
        self.rows_per_part = rows_per_part
        self.compression = compression
        self._parts: list[PartInfo] = []
        self._summaries: list[PartInfo] = []
        self._summarize = summaries.summarizer(schema)
        self._texts: list[PartInfo] = []
        self._texter: object = None  # storage.texts.texter, found at the first part (None: no text)
        # Dictionary encoding only for flat columns (ids, modes, names): on token-id lists it costs a third more
        # bytes at Qwen3's vocabulary (19.6 vs 13.0 bytes/token, benchmarks/RESULTS.md `bytes`)
        self._dictionary = [f.name for f in schema if not (pa.types.is_list(f.type) or pa.types.is_struct(f.type))]
        self._open: dict[str, tuple[pq.ParquetWriter, Path]] = {}  # the part, summary and text being written
        self._open_rows = 0
        self._committed = False
        self._refuse_committed()
        # folders this writer creates: an aborted write removes them again (when still empty)
        self._created = [p for p in (self.directory, *self.directory.parents) if not p.exists()]
        self.directory.mkdir(parents=True, exist_ok=True)
        self._lock = WriterLock(self.directory / WRITER_LOCK, f"shard {self.directory}").acquire()
        try:
            self._refuse_committed()  # committed by a writer that held the lock until now
            for stale in self._leftovers():
                stale.unlink()
        except BaseException:
            self._lock.release()
            raise

    def _refuse_committed(self) -> None:
        existing = read_manifest(self.directory)
        if existing is None:
            return
        if existing.config_hash == self.config_hash:
            raise CommittedMeanwhile(
                f"{self.directory / MANIFEST}: already committed with the same settings (config "
                f"{existing.config_hash}), by another process meanwhile or an earlier write: that shard is kept",
                existing,
            )
        raise ShardError(
            f"{self.directory / MANIFEST}: shard already committed (config {existing.config_hash}); "
            "refusing to overwrite it"
        )

    def __enter__(self) -> "ShardWriter":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        try:
            if exc_type is None and not self._committed:
                self.commit()
        finally:
            if not self._committed:  # the stage or the commit failed
                self.abort()

    def _leftovers(self) -> list[Path]:
        """The files of an earlier attempt (or of this one, aborted): parts, their summaries and texts (storage/
        summaries.py, texts.py), and the temporary files of each and of the manifest."""
        return [
            p
            for pattern in (
                PART_GLOB,
                ".part-*",
                "summary-*.parquet",
                ".summary-*",
                "text-*.parquet",
                ".text-*",
                f".{MANIFEST}.tmp-*",
            )
            for p in self.directory.glob(pattern)
        ]

    def write(self, table: pa.Table) -> None:
        if not table.schema.equals(self.schema, check_metadata=False):
            table = table.cast(self.schema)
        while table.num_rows:
            room = self.rows_per_part - self._open_rows
            self._append(table.slice(0, room))
            table = table.slice(room)
            if self._open_rows == self.rows_per_part:
                self._close_part()

    def _append(self, rows: pa.Table) -> None:
        """`rows` written to the open part (opened first if none) as row group(s) of their own, and their summary
        and decoded text to the part's (both per row, so a part's are its row groups' in order)."""
        rows = rows.replace_schema_metadata(self.schema.metadata)
        self._write_open("part", rows, use_dictionary=self._dictionary)
        self._open_rows += rows.num_rows
        if self._summarize is not None:
            self._write_open("summary", self._summarize(rows))
        if self._texter is None:
            self._texter = texts.texter(self.schema, self.directory, self.inputs) or False
        if self._texter:
            try:
                self._write_open("text", self._texter(rows))
            except Exception as e:  # noqa: BLE001 - text is for people: a shard is committed without it, never lost
                self._drop_texts(e)

    def _write_open(self, kind: str, table: pa.Table, **options: Any) -> None:
        name = f"{kind}-{len(self._parts):05d}.parquet"
        try:
            if kind not in self._open:
                tmp = self.directory / f".{name}.tmp-{os.getpid()}"
                self._open[kind] = (
                    pq.ParquetWriter(str(tmp), table.schema, compression=self.compression, **options),
                    tmp,
                )
            self._open[kind][0].write_table(table)  # parts cast in write(); summaries and texts are of one schema
        except OSError as e:  # e.g. a full disk: one line naming the file; the writer's abort removes the rest
            raise os_error(e, f"writing {self.directory / name}") from None

    def _close_part(self) -> None:
        """The open part (and its summary and text) closed, checksummed from disk in blocks (the page cache) and
        renamed into place."""
        index = len(self._parts)
        for kind, listed in (("part", self._parts), ("summary", self._summaries), ("text", self._texts)):
            if kind not in self._open:
                continue
            writer, tmp = self._open.pop(kind)
            final = self.directory / f"{kind}-{index:05d}.parquet"
            try:
                writer.close()
                with open(tmp, "rb+") as f:
                    os.fsync(f.fileno())
                size, crc = _file_crc32(tmp)
                os.replace(tmp, final)
            except OSError as e:
                tmp.unlink(missing_ok=True)
                if kind == "text":  # as in _append: a shard is committed without text, never lost
                    self._drop_texts(e)
                    continue
                raise os_error(e, f"writing {final}") from None
            listed.append(PartInfo(name=final.name, rows=self._open_rows, bytes=size, crc32=crc))
        self._open_rows = 0

    def _close_open(self, kinds: Iterable[str]) -> None:
        """Open files of these kinds closed and removed (an aborted write, or text given up)."""
        for kind in [k for k in kinds if k in self._open]:
            writer, tmp = self._open.pop(kind)
            with contextlib.suppress(OSError):  # e.g. the full disk that aborted the write: the file is removed anyway
                writer.close()
            tmp.unlink(missing_ok=True)

    def _drop_texts(self, e: Exception) -> None:
        self._close_open(["text"])
        for p in self._texts:
            (self.directory / p.name).unlink(missing_ok=True)
        self._texts, self._texter = [], False
        warnings.warn(f"{self.directory}: committed without decoded text ({type(e).__name__}: {e})", stacklevel=3)

    def commit(self, extra: dict[str, Any] | None = None) -> Manifest:
        if not self._open and not self._parts:
            self._append(self.schema.empty_table())  # an empty shard still gets one (empty) part
        if self._open:
            self._close_part()
        manifest = Manifest(
            schema=schema_id(self.schema),
            rows=sum(p.rows for p in self._parts),
            parts=self._parts,
            config_hash=self.config_hash,
            inputs=self.inputs,
            created_at=time.time(),
            extra={
                **(extra or {}),
                **({"summaries": [asdict(p) for p in self._summaries]} if self._summaries else {}),
                **({"texts": [asdict(p) for p in self._texts]} if self._texts else {}),
            },
        )
        try:
            _fsync_dir(self.directory)
            _atomic_write_bytes(self.directory / MANIFEST, json.dumps(asdict(manifest), indent=1).encode())
            self._committed = True  # before anything else can be interrupted: __exit__ aborts what is not
        except BaseException:
            if (self.directory / MANIFEST).is_file():  # interrupted past the rename, which is the commit
                self._committed = True
                self._lock.release()
            else:
                self.abort()  # a commit() called outside `with` that fails leaves neither parts nor the lock
            raise
        self._committed = True
        self._lock.release()
        # the rename made durable; an interrupt here leaves the shard committed (aborting deleted its parts
        # under a manifest that listed them)
        _fsync_dir(self.directory)
        # the parts' checksums were taken from the bytes just written: readers need not read them again. Their
        # identity is taken now (renaming a file changes its ctime, so not before): a part changed since it was
        # written is caught by its checksum when read for training, and by `cleaner inspect --verify`.
        with contextlib.suppress(OSError):  # a part gone already: nothing recorded, readers check in full
            verified.remember(
                self.directory,
                [
                    (p.name, p.crc32, verified.identity(self.directory / p.name))
                    for p in [*self._parts, *self._summaries, *self._texts]
                ],
            )
        return manifest

    def abort(self) -> None:
        self._close_open(list(self._open))
        for p in self._leftovers():
            p.unlink(missing_ok=True)
        self._lock.release()
        for d in self._created:  # innermost first; a folder something else wrote into stays
            try:
                d.rmdir()
            except OSError:
                break


def write_shard(
    directory: Path,
    table: pa.Table,
    schema: pa.Schema,
    config_hash: str,
    extra: dict[str, Any] | None = None,
    **kw: Any,
) -> Manifest:
    """`table` as a committed shard; the shard another process committed meanwhile with the same config hash is
    the one kept (a rerun of the same stage's inputs)."""
    try:
        with ShardWriter(directory, schema, config_hash, **kw) as w:
            w.write(table)
            return w.commit(extra)
    except CommittedMeanwhile as e:
        return e.manifest


def _check_file(path: Path, part: PartInfo, size: int, crc: str | None) -> None:
    """A listed file's size and crc32 (None: not checked) against its manifest entry."""
    if size != part.bytes:
        raise ShardError(f"{path}: {size} bytes, manifest says {part.bytes}")
    if crc is not None and crc != part.crc32:
        raise ShardError(f"{path}: checksum mismatch (file changed after commit)")


def _check_footer(path: Path, pf: pq.ParquetFile, part: PartInfo, want: pa.Schema) -> pa.Schema:
    """The schema the part was written with (`want`, or an earlier version `want` still reads), checked with its
    rows against the manifest."""
    got = pf.schema_arrow
    meta = (got.metadata or {}).get(SCHEMA_META_KEY)
    written = readable_as(meta.decode(), want) if meta else None
    if written is None:
        found = meta.decode() if meta else "none"
        raise ShardError(f"{path}: schema version {found}, expected {schema_id(want)}")
    for f in written:
        idx = got.get_field_index(f.name)
        if idx < 0:
            raise ShardError(f"{path}: missing column {f.name!r}")
        if not got.field(idx).type.equals(f.type):
            raise ShardError(f"{path}: column {f.name!r} has type {got.field(idx).type}, expected {f.type}")
    if pf.metadata.num_rows != part.rows:
        raise ShardError(f"{path}: {pf.metadata.num_rows} rows, manifest says {part.rows}")
    return written


def committed_manifest(directory: Path, schema: pa.Schema) -> Manifest:
    """The manifest of a committed shard of this schema, with no part files beside it that it does not list."""
    directory = Path(directory)
    manifest = read_manifest(directory)
    if manifest is None:
        raise ShardMissing(f"{directory}: no {MANIFEST} (stage not run, or crashed before committing)")
    if readable_as(manifest.schema, schema) is None:
        raise ShardError(f"{directory / MANIFEST}: schema version {manifest.schema}, expected {schema_id(schema)}")
    extra = set(fnmatch.filter(os.listdir(directory), PART_GLOB)) - {p.name for p in manifest.parts}
    if extra:
        raise ShardError(f"{directory}: parts not in the manifest: {sorted(extra)}")
    return manifest


def _open_part(
    path: Path, part: PartInfo, schema: pa.Schema, verify_checksums: bool
) -> tuple[pq.ParquetFile, pa.Schema]:
    """One part read whole and checked against its manifest entry: size, crc32, schema version, columns and
    types, rows; with the schema it was written with (`schema` or an earlier version of it)."""
    global FULL_READS
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        raise ShardError(f"{path}: listed in the manifest but missing") from None
    FULL_READS += 1
    _check_file(path, part, len(data), _crc32(data) if verify_checksums else None)
    try:
        pf = pq.ParquetFile(pa.BufferReader(data))
    except (pa.ArrowException, OSError) as e:
        raise ShardError(f"{path}: corrupt Parquet ({e})") from None
    return pf, _check_footer(path, pf, part, schema)


def summary_parts(manifest: Manifest) -> list[PartInfo]:
    """The per-part row summaries a manifest lists ([] for shards committed without them)."""
    return [PartInfo(**p) for p in manifest.extra.get("summaries", [])]


def text_parts(manifest: Manifest) -> list[PartInfo]:
    """The per-part decoded texts a manifest lists ([] for shards committed without them)."""
    return [PartInfo(**p) for p in manifest.extra.get("texts", [])]


def _check_once(directory: Path, part: PartInfo, force: bool, check: Callable[[Path], object]) -> None:
    """`check` of a listed file, in full the first time, then only its identity while the file is unchanged
    (storage.verified); `force` checks in full whatever the record says (`cleaner inspect --verify`)."""
    if not force and verified.is_verified(directory, part.name, part.bytes, part.crc32):
        return
    path = Path(directory) / part.name
    try:
        before = verified.identity(path)  # before reading: what the record may vouch for (verified.remember)
        check(path)
    except FileNotFoundError:
        raise ShardError(f"{path}: listed in the manifest but missing") from None
    verified.remember(directory, [(part.name, part.crc32, before)])


def check_summary(directory: Path, part: PartInfo, force: bool = False) -> None:
    """A summary or text file as its manifest lists it: size and crc32 (once, then by identity, like a part)."""
    _check_once(directory, part, force, lambda path: _check_file(path, part, *_file_crc32(path)))


def check_part(directory: Path, part: PartInfo, schema: pa.Schema, force: bool = False) -> None:
    """Validate one committed part without decoding its rows (what the catalog does before a view reads it)."""
    _check_once(directory, part, force, lambda path: _open_part(path, part, schema, True))


def iter_part_batches(directory: Path, part: PartInfo, schema: pa.Schema, batch_rows: int) -> Iterator[pa.Table]:
    """One validated part of a committed shard, `batch_rows` rows at a time (what read_shard checks: size and crc32,
    taken in blocks before any row is decoded, then schema and rows), without holding the part's bytes or rows:
    a raw part holds up to storage.rows_per_part rows of up to 32k tokens (the purify stage reads it so)."""
    global FULL_READS
    path = Path(directory) / part.name
    try:
        before = verified.identity_values(path)
        size, crc = _file_crc32(path)
    except FileNotFoundError:
        raise ShardError(f"{path}: listed in the manifest but missing") from None
    FULL_READS += 1
    _check_file(path, part, size, crc)
    try:
        # buffered and one thread: pages read as they are decoded (else a row group's column chunks are read whole)
        pf = pq.ParquetFile(path, buffer_size=1 << 16)
        written = _check_footer(path, pf, part, schema)
        for batch in pf.iter_batches(batch_size=batch_rows, use_threads=False):  # threads read ahead
            rows = pa.Table.from_batches([batch])
            yield rows if written is schema else upgrade(rows, schema)
    except (pa.ArrowException, OSError) as e:
        raise ShardError(f"{path}: corrupt Parquet ({e})") from None
    if verified.identity_values(path) != before:  # the checksum vouched for other bytes than those decoded
        raise ShardError(f"{path}: changed while it was read (file changed after commit)")


def read_shard(
    directory: Path, schema: pa.Schema, verify_checksums: bool = True, columns: list[str] | None = None
) -> pa.Table:
    """A committed shard's rows (or these columns), every part validated and read whole; parts of an earlier
    schema version read as this one (storage.schemas.upgrade)."""
    directory = Path(directory)
    want = schema if columns is None else pa.schema([schema.field(c) for c in columns], metadata=schema.metadata)
    tables = []
    for part in committed_manifest(directory, schema).parts:
        path = directory / part.name
        pf, written = _open_part(path, part, schema, verify_checksums)
        try:
            table = pf.read(
                columns=columns
                if columns is None or written is schema
                else [c for c in upgrade_inputs(want) if c in written.names]
            )
        except (pa.ArrowException, OSError) as e:
            raise ShardError(f"{path}: corrupt Parquet ({e})") from None
        if table.num_rows != part.rows:
            raise ShardError(f"{path}: {table.num_rows} rows, manifest says {part.rows}")
        tables.append(table if written is schema else upgrade(table, want))
    if not tables:
        return want.empty_table()
    return pa.concat_tables(tables).cast(want) if columns is None else pa.concat_tables(tables)


def atomic_write_json(path: Path, data: Any) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    _atomic_write_bytes(path, json.dumps(data, indent=1, sort_keys=True, default=str).encode())
