"""The purification stage as an Apache Beam pipeline (thin adapters around purifier/batch.py).

PurifyBatches (each raw part of the manifest read and validated (size, crc32, schema, rows) in
batches and purified in slices as it is read: one purified table per variant (pipeline.modes.Variant) and
slice, cut into buckets by a stable hash of the prompt and written to a file per part, variant and bucket)
→ GroupByKey(variant, bucket) of those files' paths → GroupStage (advantages, dynamic filter, batched log-prob
recompute with the model loaded once per worker process; writes the bucket's purified rows, sorted, to staging
itself) → WriteStaged (one Parquet file per other destination: a variant's dead letters, refused parts,
counts), in a staging folder laid out as the partitions are (`<variant.partition>/purified-<bucket>.parquet`),
and a summary of what was staged, written last. No GroupByKey holds purified rows: FnApiRunner buffers what
crosses one in memory and Dask sends it between workers, so only paths and small tables do; one process holds
a slice of a raw part and, in GroupStage, one bucket (benchmarks/bench_purify_memory.py). The driver
(purifier/stage.py) checks the staged files against that summary, then commits each partition through
storage/, merging the sorted buckets a chunk at a time (purifier/commit.py). Bad rows go to the dead-letter
destination with the reason instead of failing the whole stage. Arrow tables or paths, not rows, cross
every stage boundary, so Beam's per-element cost is paid per batch.

The same pipeline runs on every runner, so it uses only what every runner executes: each DoFn has one
output (a record's key tells a group from a destined table), nothing is emitted from finish_bundle,
everything ends in one last transform, and the counts the stage needs are staged as rows rather than
read from Beam metrics. Beam 2.77's DaskRunner does not keep tagged outputs apart (its ParDo returns one
bag of every output and each consumer of any tag reads that whole bag), drops finish_bundle output and
branches not upstream of the last transform, and its result's metrics() raises NotImplementedError
(tests/test_dask_purify.py checks both, so a Beam that fixes them shows up as a failing test). Objects
that are costly to build (the recompute model, the tokenizer) are held per process (`per_process`),
since some runners (Dask) call `setup` for every bundle. docs/scale_out.md says how to run it on Dask
(`purify.runner=dask`, tested) and on Beam's other runners (`--runner=FlinkRunner --flink_master=…`,
`--runner=SparkRunner`, `--runner=DataflowRunner …` in purify.beam_options; untested here). On a
distributed runner the bucket count bounds the group stage's parallelism, and the staging folder must be
on a file system that every worker and the driver share.
"""

from __future__ import annotations

import collections
import hashlib
import json
import logging
import os
import threading
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator

import apache_beam as beam
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
from apache_beam.options.pipeline_options import PipelineOptions

from pipeline.modes import IS_MODES, Variant
from pipeline.similarity import Measure
from purifier.batch import SORT, buckets, recompute_groups, token_slices, with_advantages
from storage.errors import CleanerError
from storage.schemas import DEAD_LETTER, PURIFIED, RAW
from storage.shards import PartInfo, ShardError, atomic_write_json, atomic_write_parquet, iter_part_batches

BUCKETS = 8
# Lived tokens purified at a time (PurifyBatches): bounds the Python objects of one slice of a raw part,
# 16 rows of 16k tokens, whatever the part's size (test_purify_memory).
SLICE_TOKENS = 1 << 18
# Parts that failed validation, with the reason: the driver refuses the shard when any is staged.
INVALID = pa.schema([("reason", pa.string())])
INVALID_DESTINATION = "invalid-parts"
# Counts the stage records beside the rows (filtered groups, tokens forwarded), staged as rows: not every
# runner reports Beam metrics.
COUNTS = pa.schema([("name", pa.string()), ("value", pa.int64())])
COUNTS_DESTINATION = "counts"
SLICES = "_slices"  # PurifyBatches' files of purified rows per part and bucket (BucketFiles), read by GroupStage
# Response tokens per row group of a staged bucket file (the commit reads one at a time: purifier/commit.py):
# 4 rows of 16k tokens, hundreds of short ones
STAGED_ROW_GROUP_TOKENS = 1 << 16
# Raw rows decoded at a time while a part is read (raw_slices gathers them into slices of SLICE_TOKENS)
RAW_BATCH_ROWS = 8
SUMMARY = "_STAGED.json"  # {destination: rows staged}, written by the pipeline's last transform
DASK_RUNNER = "apache_beam.runners.dask.dask_runner.DaskRunner"


@dataclass(frozen=True)
class PurifyJob:
    """One purification of one raw shard, everything the pipeline needs: built once by the stage
    (purifier/stage.py), passed whole to `build` and `run` and to the DoFns that need part of it."""

    raw_parts: tuple[tuple[str, dict], ...]  # (raw shard directory, its manifest's PartInfo as a dict)
    variants: tuple[Variant, ...]
    staging: str  # where the pipeline stages its files (on a cluster: a path every worker shares)
    tokenizer_dir: str
    estimator: str = "group_norm"
    dynamic_filter: bool = False
    recompute: str = "none"  # cpu | sglang | vllm | none
    checkpoint: str | None = None  # the policy that sampled the raw shard (recompute and saar_is score with it)
    temperature: float = 1.0
    sglang_url: str = ""
    vllm_urls: tuple[str, ...] = ()  # recompute=vllm: servers resolved (or started) by the driver
    roc_group_size: int = 1
    runner: str = "FnApiRunner"
    beam_options: tuple[str, ...] = ()
    device: str = "cpu"  # recompute=cpu: purify.device, resolved in each process that loads the model

    def backend(self):
        """The recompute backend of this job, once per process (None: recompute off)."""
        key = (
            self.recompute,
            self.checkpoint,
            _files_key(self.checkpoint),
            self.temperature,
            self.sglang_url,
            self.vllm_urls,
            self.device,
        )
        return per_process("recompute", key, self._build_backend)

    def _build_backend(self):
        if not (self.recompute == "sglang" or self.checkpoint and self.recompute in ("cpu", "vllm")):
            return None
        from purifier.recompute import CPURecompute, SGLangRecompute, VLLMRecompute  # torch: only when recomputing

        if self.recompute == "cpu":
            return CPURecompute(Path(self.checkpoint), self.temperature, device=self.device)
        if self.recompute == "sglang":
            return SGLangRecompute(self.sglang_url, self.temperature)
        return VLLMRecompute(list(self.vllm_urls), Path(self.checkpoint), self.temperature)


class StagingIncomplete(CleanerError, RuntimeError):
    """The pipeline finished but what it staged is not all visible to the driver; nothing was committed."""


class RunLost(CleanerError, RuntimeError):
    """The runner ended the run without finishing its work (e.g. a Dask scheduler lost mid-run)."""


# ---- objects held once per process --------------------------------------------------------------

_held: dict[str, tuple[Any, Any]] = {}
_held_lock = threading.Lock()
loads: collections.Counter = collections.Counter()  # kind → how many times this process built one


def per_process(kind: str, key: Any, build: Callable[[], Any]) -> Any:
    """One `build()` per process for a given key, shared by every DoFn instance and bundle of that process
    (FnApiRunner calls `setup` once per run, Dask once per bundle). One object per kind is kept: a new key
    (the next iteration's checkpoint) replaces the previous one."""
    with _held_lock:
        held = _held.get(kind)
        if held is None or held[0] != key:
            _held.pop(kind, None)  # drop the old one before the new one is built: one model in memory
            _held[kind] = (key, build())
            loads[kind] += 1
        return _held[kind][1]


def _files_key(directory: str | None) -> tuple:
    """What identifies a checkpoint's content cheaply: its files' names, sizes and modification times."""
    if not directory:
        return ()
    try:
        return tuple(
            sorted((e.name, e.stat().st_size, e.stat().st_mtime_ns) for e in os.scandir(directory) if e.is_file())
        )
    except OSError:
        return ()


class ArrowTableCoder(beam.coders.Coder):
    """pyarrow Tables as Arrow IPC streams: no pickle, and a slice carries only its own rows."""

    def encode(self, table: pa.Table) -> bytes:
        sink = pa.BufferOutputStream()
        with pa.ipc.new_stream(sink, table.schema) as writer:
            writer.write_table(table)
        return sink.getvalue().to_pybytes()

    def decode(self, data: bytes) -> pa.Table:
        return pa.ipc.open_stream(data).read_all()

    def estimate_size(self, table: pa.Table) -> int:
        # Beam samples element sizes for its metrics; the default would serialise every table once more
        return table.nbytes


beam.coders.registry.register_coder(pa.Table, ArrowTableCoder)


class VariantCoder(beam.coders.Coder):
    """A Variant as the JSON of its fields: deterministic, as a GroupByKey key must be (Beam's fallback for a
    dataclass works too, but warns at every bundle)."""

    def encode(self, v: Variant) -> bytes:
        return json.dumps([v.mode, v.threshold, v.measure.similarity, v.measure.on]).encode()

    def decode(self, data: bytes) -> Variant:
        mode, threshold, similarity, on = json.loads(data)
        return Variant(mode, threshold, Measure(similarity, on))

    def is_deterministic(self) -> bool:
        return True


beam.coders.registry.register_coder(Variant, VariantCoder)
BucketFile = beam.typehints.Tuple[beam.typehints.Tuple[Variant, int], str]  # ((variant, bucket), path: BucketFiles)
DestinedTable = beam.typehints.Tuple[str, pa.Table]


def destination(variant: Variant, kind: str) -> str:
    """Staged file prefix of a variant's purified rows (kind "purified") or dead letters (kind "dead"): the
    variant's partition path, so staging is laid out as the partitions are."""
    return f"{variant.partition}/{kind}"


def row_counter(variant: Variant, kind: str) -> str:
    """Name of the counter of the rows the pipeline produced for a variant and kind."""
    return f"{kind}/{variant.partition}"


def schema_of(dest: str) -> pa.Schema:
    """The schema of a staged destination."""
    if dest == INVALID_DESTINATION:
        return INVALID
    if dest == COUNTS_DESTINATION:
        return COUNTS
    return PURIFIED if dest.endswith("/purified") else DEAD_LETTER


def staged_file(staging: Path, dest: str, shard: str = "00000-of-00001") -> Path:
    """A staged file of a destination: the one file WriteStaged writes (named as Beam's WriteToFiles named a
    single shard), or a bucket's file of a variant's purified rows (`shard` the bucket)."""
    return Path(staging) / f"{dest}-{shard}.parquet"


def write_staged(staging: Path, dest: str, table: pa.Table, shard: str = "00000-of-00001") -> int:
    """One staged file, written to a hidden temporary name and renamed: a retried or re-executed bundle (a
    worker lost mid-run) rewrites the same complete file, never a second copy of its rows."""
    schema = schema_of(dest)
    path = staged_file(staging, dest, shard)
    path.parent.mkdir(parents=True, exist_ok=True)  # <variant.partition>/, on whichever worker writes it
    table = table.select(schema.names).cast(schema)
    # purified rows in row groups of what the commit reads at a time: Arrow reads a nested column's row group whole
    groups = (token_slices(table, STAGED_ROW_GROUP_TOKENS, "response_ids") if schema is PURIFIED else []) or [table]
    atomic_write_parquet(path, groups)
    return table.num_rows


def read_staged(staging: Path, dest: str) -> pa.Table:
    """Every staged file of a destination as one table (in file-name order), its schema's empty table if none."""
    schema = schema_of(dest)
    tables = [pq.read_table(f).cast(schema) for f in sorted(Path(staging).glob(f"{dest}-*.parquet"))]
    return pa.concat_tables(tables) if tables else schema.empty_table()


def _tokenizer_decode(tokenizer_dir: str) -> Callable[[list[int]], str]:
    from tokenizers import Tokenizer  # the Rust tokenizer alone: no transformers import per worker

    tok = Tokenizer.from_file(str(Path(tokenizer_dir) / "tokenizer.json"))
    return lambda ids: tok.decode(list(ids), skip_special_tokens=False)


def raw_slices(batches: Iterator[pa.Table], budget: int) -> Iterator[pa.Table]:
    """A raw part read in batches (storage.shards.iter_part_batches) as the slices `token_slices` cuts the whole
    part into (its greedy cut is the same from any slice's start), holding one slice and one batch at a time."""
    pending: list[pa.Table] = []
    tokens = 0
    for batch in batches:
        pending.append(batch)
        tokens += int(pc.sum(pc.list_value_length(batch["lived_ids"])).as_py() or 0)
        if tokens >= budget:
            *done, rest = token_slices(pa.concat_tables(pending), budget)
            yield from done
            pending, tokens = [rest], int(pc.sum(pc.list_value_length(rest["lived_ids"])).as_py() or 0)
    if pending:
        yield from token_slices(pa.concat_tables(pending), budget)


class BucketFiles:
    """The purified rows of one raw part, per (variant, bucket), written as they are purified: one Parquet file
    each (a row group per slice) under `<staging>/_slices/<variant.partition>/`, so what crosses the GroupByKey
    is each file's path, not its rows. Files are written under temporary names and renamed when the part is
    done: a retried bundle rewrites the same complete files."""

    def __init__(self, staging: str, source: str) -> None:
        self.root, self.tag = Path(staging) / SLICES, hashlib.blake2b(source.encode(), digest_size=8).hexdigest()
        self.open: dict[tuple[Variant, int], tuple[pq.ParquetWriter, Path, Path]] = {}

    def write(self, variant: Variant, bucket: int, rows: pa.Table) -> None:
        if (variant, bucket) not in self.open:
            final = self.root / variant.partition / f"{bucket:05d}-{self.tag}.parquet"
            final.parent.mkdir(parents=True, exist_ok=True)
            tmp = final.with_name(f".{final.name}.{uuid.uuid4().hex[:8]}.tmp")
            self.open[variant, bucket] = (pq.ParquetWriter(str(tmp), rows.schema), tmp, final)
        writer = self.open[variant, bucket][0]
        writer.write_table(rows if rows.schema.equals(writer.schema) else rows.cast(writer.schema))

    def close(self) -> list[tuple[tuple[Variant, int], str]]:
        done = []
        for key, (writer, tmp, final) in self.open.items():
            writer.close()
            os.replace(tmp, final)
            done.append((key, str(final)))
        self.open = {}
        return done

    def abort(self) -> None:
        for writer, tmp, _ in self.open.values():
            try:
                writer.close()
            finally:
                tmp.unlink(missing_ok=True)
        self.open = {}


class PurifyBatches(beam.DoFn):
    """(raw shard folder, manifest part entry) → ((variant, bucket), path of the part's purified rows of that
    bucket: BucketFiles), and (destination, dead letters).

    The part is read here, validated (size, crc32, schema, rows: storage.shards.iter_part_batches) and purified
    in slices of at most `slice_tokens` lived tokens as it is read, so neither the part nor its purified rows
    are held whole, nor buffered by the GroupByKey after it. A plain DoFn over the manifest's parts rather than
    Beam's Parquet source: runners without splittable reads (Dask) can run it. A part that fails validation is
    not raised (Beam would log a traceback per retry) but emitted as (INVALID_DESTINATION, the reason), which goes
    to staging; the driver then refuses the whole shard. One output for all (a tuple key is a group, a str key a
    destination; see `build`): tagged outputs are not kept apart by every runner."""

    def __init__(self, job: PurifyJob, slice_tokens: int | None = None) -> None:
        self.job, self.slice_tokens = job, slice_tokens or SLICE_TOKENS

    def setup(self) -> None:
        tokenizer_dir = self.job.tokenizer_dir
        self.decode = per_process(
            "tokenizer",
            (str(Path(tokenizer_dir) / "tokenizer.json"), _files_key(tokenizer_dir)),
            lambda: _tokenizer_decode(tokenizer_dir),
        )
        # saar_is scores every rollback with the recompute model (the same one GroupStage uses, once per process)
        self.score = self.job.backend().score if any(v.mode in IS_MODES for v in self.job.variants) else None

    def process(self, element):
        from purifier.batch import purify_batch  # looked up per call: test_purify_memory spies on it

        directory, part = element
        info = PartInfo(**part)
        filename = str(Path(directory) / info.name)
        files = BucketFiles(self.job.staging, filename)
        letters = []
        try:
            for batch in raw_slices(iter_part_batches(Path(directory), info, RAW, RAW_BATCH_ROWS), self.slice_tokens):
                batch = batch.select(RAW.names).cast(RAW)
                for variant, (table, dead) in purify_batch(
                    batch, list(self.job.variants), self.decode, filename, self.score
                ).items():
                    if dead:
                        letters.append((destination(variant, "dead"), pa.Table.from_pylist(dead, schema=DEAD_LETTER)))
                    for bucket, rows in buckets(table, BUCKETS):
                        files.write(variant, bucket, rows)
        except ShardError as e:
            files.abort()
            yield INVALID_DESTINATION, pa.table({"reason": [str(e)]}, schema=INVALID)
            return
        except BaseException:
            files.abort()
            raise
        yield from letters
        yield from files.close()


class GroupStage(beam.DoFn):
    """Advantages + dynamic filtering + log-prob recompute for the prompt groups of one bucket → the bucket's
    purified rows staged (`<partition>/purified-<bucket>.parquet`), and (COUNTS_DESTINATION, counts): rows staged,
    filtered groups, tokens forwarded."""

    def __init__(self, job: PurifyJob) -> None:
        self.job = job

    def setup(self) -> None:
        self.backend = self.job.backend()  # once per process and checkpoint: Dask calls setup for every bundle

    def process(self, element):
        (variant, bucket), files = element
        job = self.job
        rows = pa.concat_tables([pq.read_table(f) for f in sorted(files)])  # one bucket: every part's rows of it
        table, filtered = with_advantages(
            rows, job.estimator, job.dynamic_filter, job.roc_group_size if variant.mode == "roc" else None
        )
        del rows
        counts = {}
        if filtered:
            counts[row_counter(variant, "filtered_groups")] = filtered
        if table.num_rows:
            if self.backend is not None:
                table = recompute_groups(table, self.backend).sort_by(SORT)  # the driver merges sorted buckets
            counts["tokens_forwarded"] = int(pc.sum(table["tokens_forwarded"]).as_py() or 0)
            counts[row_counter(variant, "purified")] = write_staged(
                Path(job.staging), destination(variant, "purified"), table, f"{bucket:05d}"
            )
        if counts:
            yield COUNTS_DESTINATION, pa.table({"name": list(counts), "value": list(counts.values())}, schema=COUNTS)


def _write_destination(record: tuple[str, Iterable[pa.Table]], staging: str) -> tuple[str, int]:
    """(destination, its tables) → one Parquet file in staging (`write_staged`), then (destination, rows written)."""
    dest, tables = record
    return dest, write_staged(Path(staging), dest, pa.concat_tables(list(tables)))


def _write_summary(record: tuple[int, Iterable[tuple[str, int]]], staging: str) -> None:
    """All (destination, rows) of the run → SUMMARY, the pipeline's own account of what it staged."""
    atomic_write_json(Path(staging) / SUMMARY, {dest: rows for dest, rows in record[1] if dest})


def _is_destined(record) -> bool:
    return isinstance(record[0], str)


def build(p: beam.Pipeline, job: PurifyJob) -> None:
    purified = (
        p
        | "RawParts" >> beam.Create(list(job.raw_parts))
        | "Purify"
        >> beam.ParDo(PurifyBatches(job)).with_output_types(
            beam.typehints.Tuple[beam.typehints.Any, beam.typehints.Any]
        )
    )
    grouped = (
        purified
        | "Groups" >> beam.Filter(lambda record: not _is_destined(record)).with_output_types(BucketFile)
        | "ByPromptBucket" >> beam.GroupByKey()
        | "GroupStage" >> beam.ParDo(GroupStage(job)).with_output_types(DestinedTable)
    )
    letters = purified | "DeadAndRefused" >> beam.Filter(_is_destined).with_output_types(DestinedTable)
    written = (
        (grouped, letters)
        | "ToStage" >> beam.Flatten()
        | "ByDestination" >> beam.GroupByKey()
        | "WriteStaged" >> beam.Map(_write_destination, job.staging).with_output_types(beam.typehints.Tuple[str, int])
    )
    # the last transform depends on every branch (Dask computes only what the last one needs); the
    # empty record makes a summary even when nothing was staged
    (
        (written, p | "Nothing" >> beam.Create([("", 0)]).with_output_types(beam.typehints.Tuple[str, int]))
        | "AllWritten" >> beam.Flatten()
        | "OneKey"
        >> beam.Map(lambda record: (0, record)).with_output_types(
            beam.typehints.Tuple[int, beam.typehints.Tuple[str, int]]
        )
        | "Together" >> beam.GroupByKey()
        | "WriteSummary" >> beam.Map(_write_summary, job.staging)
    )


def staged_counts(staging: Path) -> dict[str, int]:
    """The counts of what a finished pipeline staged, from its summary and counts destination:
    "purified/<partition>", "dead/<partition>", "invalid_parts", "filtered_groups[/<partition>]", "tokens_forwarded"
    (<partition>: Variant.partition, e.g. mode=saar/gamma=0.50)."""
    try:
        summary = json.loads((Path(staging) / SUMMARY).read_text())
    except FileNotFoundError:
        raise StagingIncomplete(
            f"{staging}: the pipeline finished but its summary {SUMMARY} is not there: its workers wrote "
            "somewhere the driver cannot see (on a cluster, storage.root must be a file system every worker "
            "and the driver share at the same path); nothing was committed"
        ) from None
    counters: dict[str, int] = {}
    for dest, rows in summary.items():
        if dest == INVALID_DESTINATION:
            counters["invalid_parts"] = rows
        elif dest != COUNTS_DESTINATION:
            partition, kind = dest.rsplit("/", 1)
            counters[f"{kind}/{partition}"] = rows
    if summary.get(COUNTS_DESTINATION):
        try:
            counts = pq.read_table(staged_file(staging, COUNTS_DESTINATION)).to_pylist()
        except FileNotFoundError:
            raise StagingIncomplete(
                f"{staged_file(staging, COUNTS_DESTINATION)}: staged by the pipeline but not "
                "there; nothing was committed"
            ) from None
        for c in counts:
            counters[c["name"]] = counters.get(c["name"], 0) + c["value"]
            if c["name"].startswith("filtered_groups/"):
                counters["filtered_groups"] = counters.get("filtered_groups", 0) + c["value"]
    return counters


def run(job: PurifyJob) -> dict[str, int]:
    p = beam.Pipeline(options=PipelineOptions([f"--runner={job.runner}", *job.beam_options]))
    build(p, job)
    # Beam logs every failing DoFn's traceback before re-raising it; the exception itself reaches the
    # stage (which turns a full disk into one line) and the CLI (which keeps a bug's traceback).
    # Dask's client logs its lost connections with tracebacks; the stage says it in one line.
    quiet = [logging.getLogger(n) for n in ("apache_beam.runners.common", "distributed.client", "distributed.utils")]
    levels = [log.level for log in quiet]
    for log in quiet:
        log.setLevel(logging.CRITICAL)
    result = None
    try:
        result = p.run()
        result.wait_until_finish()
        # DaskRunner reports a run whose work its lost scheduler cancelled as finished
        if any(getattr(f, "status", "") == "cancelled" for f in getattr(result, "futures", None) or ()):
            raise RunLost("the runner cancelled the pipeline's work before it finished (its scheduler was lost)")
    finally:
        client = getattr(result, "client", None)  # DaskRunner leaves its distributed.Client open
        if client is not None:
            client.close()
        for log, level in zip(quiet, levels):
            log.setLevel(level)
        with _held_lock:  # an in-process runner built the model here: do not keep it past the stage
            _held.clear()
    return staged_counts(Path(job.staging))
