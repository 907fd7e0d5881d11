"""Atomic shard writer and validating reader.

A shard is a folder of `part-NNNNN.parquet` files plus `_MANIFEST.json`, written last. Parts are
written under temporary names and renamed, then the manifest is renamed into place: a stage that
crashed leaves no manifest, so readers treat it as absent and a rerun rewrites it from scratch.
"""
from __future__ import annotations

import fnmatch
import json
import os
import time
import uuid
import warnings
import zlib
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Iterable, Iterator

import pyarrow as pa
import pyarrow.parquet as pq

from storage import summaries, texts, verified
from storage.errors import CleanerError, os_error
from storage.schemas import SCHEMA_META_KEY, readable_as, schema_id, upgrade

MANIFEST = "_MANIFEST.json"
PART_GLOB = "part-*.parquet"
SUMMARY_GLOB = "summary-*.parquet"  # per-part row summaries (storage/summaries.py), listed in the manifest
TEXT_GLOB = "text-*.parquet"  # per-part decoded text (storage/texts.py), listed in the manifest


class ShardError(CleanerError, RuntimeError):
    """A shard that cannot be trusted; the message names the file and what is wrong with it."""


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
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex[:8]}.tmp")
    try:
        if isinstance(table, pa.Table):
            pq.write_table(table, tmp)
        else:
            with pq.ParquetWriter(str(tmp), table[0].schema) as writer:
                for group in table:
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

    Refuses to touch a committed shard with a different config hash: nothing already written is
    overwritten. Orphan parts of a crashed earlier attempt are removed first.

    `row_groups`: each write() goes to the open part as it comes, as its own row group(s), so the writer holds
    one write's rows, not a part's (the purify stage commits a partition of 16k-token rows this way). Off, a part
    is written whole, as one row group (every other shard); a shard written in one write() is the same bytes
    either way while that write is within one part.
    """

    def __init__(
        self,
        directory: Path,
        schema: pa.Schema,
        config_hash: str,
        inputs: Iterable[str] = (),
        rows_per_part: int = 50_000,
        compression: str = "zstd",
        row_groups: bool = False,
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
        self._pending: list[pa.Table] = []
        self._pending_rows = 0
        self._row_groups = row_groups
        self._open: dict[str, tuple[pq.ParquetWriter, Path]] = {}  # row_groups: the part, summary, text written
        self._open_rows = 0
        self._committed = False
        existing = read_manifest(self.directory)
        if existing is not None:
            raise ShardError(
                f"{self.directory / MANIFEST}: shard already committed (config {existing.config_hash}); "
                "refusing to overwrite it"
            )
        # folders this writer creates: an aborted write removes them again (when still empty)
        self._created = [p for p in (self.directory, *self.directory.parents) if not p.exists()]
        self.directory.mkdir(parents=True, exist_ok=True)
        for stale in self._leftovers():
            stale.unlink()

    def __enter__(self) -> "ShardWriter":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None and not self._committed:
            try:
                self.commit()
            except BaseException:
                self.abort()
                raise
        elif exc_type is not None and not self._committed:
            self.abort()

    def _leftovers(self) -> list[Path]:
        return [*self.directory.glob(PART_GLOB), *self.directory.glob(".part-*"), *self.directory.glob(SUMMARY_GLOB),
                *self.directory.glob(".summary-*"), *self.directory.glob(TEXT_GLOB), *self.directory.glob(".text-*"),
                *self.directory.glob(f".{MANIFEST}.tmp-*")]

    def write(self, data: pa.Table | pa.RecordBatch | list[dict[str, Any]]) -> None:
        if isinstance(data, list):
            table = pa.Table.from_pylist(data, schema=self.schema)
        elif isinstance(data, pa.RecordBatch):
            table = pa.Table.from_batches([data])
        else:
            table = data
        if not table.schema.equals(self.schema, check_metadata=False):
            table = table.cast(self.schema)
        if self._row_groups:
            while table.num_rows:
                room = self.rows_per_part - self._open_rows
                self._append(table.slice(0, room))
                table = table.slice(room)
                if self._open_rows == self.rows_per_part:
                    self._close_part()
            return
        self._pending.append(table)
        self._pending_rows += table.num_rows
        while self._pending_rows >= self.rows_per_part:
            self._flush(self.rows_per_part)

    def _part_paths(self) -> tuple[str, Path, Path]:
        name = f"part-{len(self._parts):05d}.parquet"
        return name, self.directory / name, self.directory / f".{name}.tmp-{os.getpid()}"

    def _append(self, rows: pa.Table) -> None:
        """row_groups: `rows` written to the open part (opened first if none) as row group(s) of their own, and
        their summary and text to the part's (per row, so a part's are its row groups' in order)."""
        rows = rows.replace_schema_metadata(self.schema.metadata)
        summary, text = self._sides(rows)
        self._write_open("part", rows, use_dictionary=self._dictionary)
        self._open_rows += rows.num_rows
        if summary is not None:
            self._write_open("summary", summary)
        if text is not None and self._texter:
            try:
                self._write_open("text", text)
            except Exception as e:  # noqa: BLE001 - as in _sides: a shard is committed without text, never lost
                self._drop_texts(e)

    def _write_open(self, kind: str, table: pa.Table, **options: Any) -> None:
        name = f"{kind}-{len(self._parts):05d}.parquet"
        if kind not in self._open:
            tmp = self.directory / f".{name}.tmp-{os.getpid()}"
            try:
                self._open[kind] = (pq.ParquetWriter(str(tmp), table.schema, compression=self.compression,
                                                     **options), tmp)
            except OSError as e:
                raise os_error(e, f"writing {self.directory / name}") from None
        writer = self._open[kind][0]
        try:
            writer.write_table(table if table.schema.equals(writer.schema) else table.cast(writer.schema))
        except OSError as e:
            raise os_error(e, f"writing {self.directory / name}") from None

    def _close_part(self) -> None:
        """row_groups: the open part (and its summary and text) closed, checksummed from disk in blocks and
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
                raise os_error(e, f"writing {final}") from None
            listed.append(PartInfo(name=final.name, rows=self._open_rows, bytes=size, crc32=crc))
        self._open_rows = 0

    def _close_open(self, kinds: Iterable[str]) -> None:
        """Open files of these kinds closed and removed (an aborted write, or text given up)."""
        for kind in kinds:
            writer, tmp = self._open.pop(kind, (None, None))
            if writer is not None:
                try:
                    writer.close()
                except OSError:
                    pass  # e.g. the full disk that aborted the write: the file is removed anyway
                tmp.unlink(missing_ok=True)

    def _sides(self, rows: pa.Table) -> tuple[pa.Table | None, pa.Table | None]:
        """The summary and decoded text of some rows of a part (None: this shard has none): both are per row, so
        a part's are its row groups' concatenated."""
        summary = self._summarize(rows) if self._summarize is not None else None
        if self._texter is None:
            self._texter = texts.texter(self.schema, self.directory, self.inputs) or False
        text = None
        if self._texter:
            try:
                text = self._texter(rows)
            except Exception as e:  # noqa: BLE001 - text is for people: a shard is committed without it, never lost
                self._drop_texts(e)
        return summary, text

    def _drop_texts(self, e: Exception) -> None:
        self._close_open(["text"])
        for p in self._texts:
            (self.directory / p.name).unlink(missing_ok=True)
        self._texts, self._texter = [], False
        warnings.warn(f"{self.directory}: committed without decoded text ({type(e).__name__}: {e})", stacklevel=3)

    def _record_sides(self, summary: pa.Table | None, text: pa.Table | None) -> None:
        index = len(self._parts) - 1
        if summary is not None:
            self._summaries.append(self._write_summary(summary, index))
        if text is not None and self._texter:
            try:
                self._texts.append(self._write_summary(text, index, "text"))
            except Exception as e:  # noqa: BLE001 - as in _sides: a shard is committed without text, never lost
                self._drop_texts(e)

    def _flush(self, rows: int) -> None:
        table = pa.concat_tables(self._pending)
        head, tail = table.slice(0, rows), table.slice(rows)
        self._pending = [tail] if tail.num_rows else []
        self._pending_rows = tail.num_rows
        name, final, tmp = self._part_paths()
        # Written straight to the file (an in-memory sink would copy the part several times as it grows);
        # the checksum then reads it back from the page cache.
        try:
            pq.write_table(head.replace_schema_metadata(self.schema.metadata), str(tmp), compression=self.compression,
                           use_dictionary=self._dictionary)
            with open(tmp, "rb+") as f:
                data = f.read()
                os.fsync(f.fileno())
            os.replace(tmp, final)
        except OSError as e:  # e.g. a full disk: one line naming the part; the writer's abort removes the rest
            tmp.unlink(missing_ok=True)
            raise os_error(e, f"writing {final}") from None
        self._parts.append(PartInfo(name=name, rows=head.num_rows, bytes=len(data), crc32=_crc32(data)))
        self._record_sides(*self._sides(head))

    def _write_summary(self, table: pa.Table, index: int, kind: str = "summary") -> PartInfo:
        name = f"{kind}-{index:05d}.parquet"
        sink = pa.BufferOutputStream()
        pq.write_table(table, sink, compression=self.compression)
        data = sink.getvalue().to_pybytes()
        try:
            _atomic_write_bytes(self.directory / name, data)
        except OSError as e:
            raise os_error(e, f"writing {self.directory / name}") from None
        return PartInfo(name=name, rows=table.num_rows, bytes=len(data), crc32=_crc32(data))

    def commit(self, extra: dict[str, Any] | None = None) -> Manifest:
        if self._row_groups and (self._open or not self._parts):
            if not self._open:
                self._append(self.schema.empty_table())  # an empty shard still gets one (empty) part
            self._close_part()
        elif self._pending_rows or not self._parts:
            self._flush(self._pending_rows)  # an empty shard still gets one (empty) part
        manifest = Manifest(
            schema=schema_id(self.schema),
            rows=sum(p.rows for p in self._parts),
            parts=self._parts,
            config_hash=self.config_hash,
            inputs=self.inputs,
            created_at=time.time(),
            extra={**(extra or {}), **({"summaries": [asdict(p) for p in self._summaries]} if self._summaries else {}),
                   **({"texts": [asdict(p) for p in self._texts]} if self._texts else {})},
        )
        _fsync_dir(self.directory)
        _atomic_write_bytes(self.directory / MANIFEST, json.dumps(asdict(manifest), indent=1).encode())
        _fsync_dir(self.directory)
        self._committed = True
        # the parts' checksums were taken from the bytes just written: readers need not read them again. Their
        # identity is taken now (renaming a file changes its ctime, so not before): a part changed since it was
        # written is caught by its checksum when read for training, and by `cleaner inspect --verify`.
        try:
            written = [(p.name, p.crc32, verified.identity(self.directory / p.name))
                       for p in [*self._parts, *self._summaries, *self._texts]]
        except OSError:  # a part gone already: nothing recorded, readers check in full
            written = []
        if written:
            verified.remember(self.directory, written)
        return manifest

    def abort(self) -> None:
        self._close_open(list(self._open))
        for p in self._leftovers():
            p.unlink(missing_ok=True)
        self._parts, self._summaries, self._texts, self._pending, self._pending_rows = [], [], [], [], 0
        for d in self._created:  # innermost first; a folder something else wrote into stays
            try:
                d.rmdir()
            except OSError:
                break


def write_shard(directory: Path, table: pa.Table, schema: pa.Schema, config_hash: str, **kw: Any) -> Manifest:
    extra = kw.pop("extra", None)
    with ShardWriter(directory, schema, config_hash, **kw) as w:
        w.write(table)
        return w.commit(extra)


def _check_schema(path: Path, got: pa.Schema, want: pa.Schema) -> pa.Schema:
    """The schema the part was written with (`want`, or an earlier version `want` still reads), checked."""
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


def _open_part(directory: Path, part: PartInfo, schema: pa.Schema,
               verify_checksums: bool) -> tuple[pq.ParquetFile, pa.Schema]:
    """One part checked against its manifest entry: size, crc32, schema version, columns and types, rows;
    with the schema it was written with (`schema` or an earlier version of it)."""
    global FULL_READS
    path = Path(directory) / part.name
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        raise ShardError(f"{path}: listed in the manifest but missing") from None
    FULL_READS += 1
    if len(data) != part.bytes:
        raise ShardError(f"{path}: {len(data)} bytes, manifest says {part.bytes}")
    if verify_checksums and _crc32(data) != part.crc32:
        raise ShardError(f"{path}: checksum mismatch (file changed after commit)")
    try:
        pf = pq.ParquetFile(pa.BufferReader(data))
    except (pa.ArrowException, OSError) as e:
        raise ShardError(f"{path}: corrupt Parquet ({e})") from None
    written = _check_schema(path, pf.schema_arrow, schema)
    if pf.metadata.num_rows != part.rows:
        raise ShardError(f"{path}: {pf.metadata.num_rows} rows, manifest says {part.rows}")
    return pf, written


def summary_parts(manifest: Manifest) -> list[PartInfo]:
    """The per-part row summaries a manifest lists ([] for shards committed without them)."""
    return [PartInfo(**p) for p in manifest.extra.get("summaries", [])]


def text_parts(manifest: Manifest) -> list[PartInfo]:
    """The per-part decoded texts a manifest lists ([] for shards committed without them)."""
    return [PartInfo(**p) for p in manifest.extra.get("texts", [])]


def check_summary(directory: Path, part: PartInfo, force: bool = False) -> None:
    """A summary file as its manifest lists it (size, crc32; once, then by identity, like a part)."""
    if not force and verified.is_verified(directory, part.name, part.bytes, part.crc32):
        return
    path = Path(directory) / part.name
    try:
        before = verified.identity(path)  # before reading: what the record may vouch for (verified.remember)
        data = path.read_bytes()
    except FileNotFoundError:
        raise ShardError(f"{path}: listed in the manifest but missing") from None
    if len(data) != part.bytes or _crc32(data) != part.crc32:
        raise ShardError(f"{path}: checksum mismatch (file changed after commit)")
    verified.remember(directory, [(part.name, part.crc32, before)])


def check_part(directory: Path, part: PartInfo, schema: pa.Schema, force: bool = False) -> None:
    """Validate one committed part without decoding its rows (what the catalog does before a view reads it):
    in full the first time, then only its identity while the file is unchanged (storage.verified); `force`
    checks in full whatever the record says (`cleaner inspect --verify`)."""
    if not force and verified.is_verified(directory, part.name, part.bytes, part.crc32):
        return
    path = Path(directory) / part.name
    try:
        before = verified.identity(path)  # before reading: what the record may vouch for (verified.remember)
    except FileNotFoundError:
        raise ShardError(f"{path}: listed in the manifest but missing") from None
    _open_part(directory, part, schema, True)
    verified.remember(directory, [(part.name, part.crc32, before)])


def read_part(directory: Path, part: PartInfo, schema: pa.Schema, verify_checksums: bool = True,
              columns: list[str] | None = None) -> pa.Table:
    """One validated part of a committed shard (readers that spread parts over workers, e.g. Beam)."""
    path = Path(directory) / part.name
    pf, written = _open_part(directory, part, schema, verify_checksums)
    stored = columns if columns is None or written is schema else [c for c in columns if c in written.names]
    try:
        table = pf.read(columns=stored)
    except (pa.ArrowException, OSError) as e:
        raise ShardError(f"{path}: corrupt Parquet ({e})") from None
    if table.num_rows != part.rows:
        raise ShardError(f"{path}: {table.num_rows} rows, manifest says {part.rows}")
    if written is not schema:  # an earlier version: read as this one (storage.schemas.upgrade)
        want = schema if columns is None else pa.schema([schema.field(c) for c in columns], metadata=schema.metadata)
        table = upgrade(table, want)
    return table


def iter_part_batches(directory: Path, part: PartInfo, schema: pa.Schema, batch_rows: int) -> Iterator[pa.Table]:
    """One validated part of a committed shard, `batch_rows` rows at a time (what read_part checks: size and crc32,
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
    if size != part.bytes:
        raise ShardError(f"{path}: {size} bytes, manifest says {part.bytes}")
    if crc != part.crc32:
        raise ShardError(f"{path}: checksum mismatch (file changed after commit)")
    try:
        # buffered and one thread: pages read as they are decoded (else a row group's column chunks are read whole)
        pf = pq.ParquetFile(path, buffer_size=1 << 16)
        written = _check_schema(path, pf.schema_arrow, schema)
        if pf.metadata.num_rows != part.rows:
            raise ShardError(f"{path}: {pf.metadata.num_rows} rows, manifest says {part.rows}")
        for batch in pf.iter_batches(batch_size=batch_rows, use_threads=False):  # threads read ahead
            rows = pa.Table.from_batches([batch])
            yield rows if written is schema else upgrade(rows, schema)
    except (pa.ArrowException, OSError) as e:
        raise ShardError(f"{path}: corrupt Parquet ({e})") from None
    if verified.identity_values(path) != before:  # the checksum vouched for other bytes than those decoded
        raise ShardError(f"{path}: changed while it was read (file changed after commit)")


def iter_parts(
    directory: Path, schema: pa.Schema, verify_checksums: bool = True, columns: list[str] | None = None
) -> Iterator[tuple[Path, pa.Table]]:
    """Validated (path, table) per part of a committed shard, in part order."""
    directory = Path(directory)
    manifest = committed_manifest(directory, schema)
    for part in manifest.parts:
        yield directory / part.name, read_part(directory, part, schema, verify_checksums, columns)


def read_shard(
    directory: Path, schema: pa.Schema, verify_checksums: bool = True, columns: list[str] | None = None
) -> pa.Table:
    tables = [t for _, t in iter_parts(directory, schema, verify_checksums, columns)]
    want = schema if columns is None else pa.schema([schema.field(c) for c in columns], metadata=schema.metadata)
    if not tables:
        return want.empty_table()
    return pa.concat_tables(tables).cast(want) if columns is None else pa.concat_tables(tables)


def atomic_write_json(path: Path, data: Any) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    _atomic_write_bytes(path, json.dumps(data, indent=1, sort_keys=True, default=str).encode())
