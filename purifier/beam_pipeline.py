"""The purification stage as an Apache Beam pipeline (thin adapters around purifier/batch.py).

ReadRawParts(the raw manifest's parts, each validated: size, crc32, schema, rows) → PurifyBatches (Arrow
batches: one purified table per (mode, γ), cut into buckets by a stable hash of the prompt) →
GroupByKey((mode, γ), bucket) → GroupStage (advantages, dynamic filter, batched log-prob recompute with
the model loaded once per worker process) → WriteStaged (one Parquet file per destination: a variant's
purified rows, its dead letters, refused parts, counts) into a staging folder, and a summary of what was
staged, written last. The driver (purifier/stage.py) checks the staged files against that summary,
then sorts and commits each partition through storage/. Bad rows go to the dead-letter destination with
the reason instead of failing the whole stage. Arrow tables, not rows, cross every stage boundary, so
Beam's per-element cost is paid per batch.

The same pipeline runs on every runner, so it uses only what every runner executes: each DoFn has one
output (a record's key tells a group from a destined table), nothing is emitted from finish_bundle,
everything ends in one last transform, and the counts the stage needs are staged as rows rather than
read from Beam metrics (Beam's DaskRunner drops tagged outputs, finish_bundle output and branches not
upstream of the last transform, and reports no metrics). Objects that are costly to build (the
recompute model, the tokenizer) are held per process (`per_process`), since some runners (Dask) call
`setup` for every bundle. docs/scale_out.md says how to run it on Dask (`purify.runner=dask`, tested)
and on Beam's other runners (`--runner=FlinkRunner --flink_master=…`, `--runner=SparkRunner`,
`--runner=DataflowRunner …` in purify.beam_options; untested here). On a distributed runner the bucket
count bounds the group stage's parallelism, and the staging folder must be on a file system that every
worker and the driver share.
"""
from __future__ import annotations

import collections
import json
import logging
import os
import threading
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import apache_beam as beam
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
from apache_beam.options.pipeline_options import PipelineOptions

from pipeline.modes import IS_MODES, Variant
from pipeline.similarity import DEFAULT_MEASURE, Measure
from storage.errors import CleanerError
from storage.schemas import DEAD_LETTER, PURIFIED, RAW
from storage.shards import atomic_write_parquet

BUCKETS = 8
# Parts that failed validation, with the reason: the driver refuses the shard when any is staged.
INVALID = pa.schema([("reason", pa.string())])
INVALID_DESTINATION = "invalid-parts"
# Counts the stage records beside the rows (filtered groups, tokens forwarded), staged as rows: not every
# runner reports Beam metrics.
COUNTS = pa.schema([("name", pa.string()), ("value", pa.int64())])
COUNTS_DESTINATION = "counts"
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
    measure: Measure = DEFAULT_MEASURE
    roc_group_size: int = 1
    runner: str = "FnApiRunner"
    beam_options: tuple[str, ...] = ()

    def backend_key(self) -> tuple:
        return (self.recompute, self.checkpoint, _files_key(self.checkpoint), self.temperature, self.sglang_url,
                self.vllm_urls)

    def backend(self):
        """The recompute backend of this job, once per process (None: recompute off)."""
        return per_process("recompute", self.backend_key(), lambda: _recompute_backend(
            self.recompute, self.checkpoint, self.temperature, self.sglang_url, self.vllm_urls))


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


def release_per_process() -> None:
    """Drop what this process holds (the driver, after an in-process run: the model is not kept)."""
    with _held_lock:
        _held.clear()


def _files_key(directory: str | None) -> tuple:
    """What identifies a checkpoint's content cheaply: its files' names, sizes and modification times."""
    if not directory:
        return ()
    try:
        return tuple(sorted((e.name, e.stat().st_size, e.stat().st_mtime_ns) for e in os.scandir(directory)
                            if e.is_file()))
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

    def is_deterministic(self) -> bool:
        return False


beam.coders.registry.register_coder(pa.Table, ArrowTableCoder)
KeyedTable = beam.typehints.Tuple[beam.typehints.Any, pa.Table]
DestinedTable = beam.typehints.Tuple[str, pa.Table]


def variant_name(mode: str, gamma: float) -> str:
    from storage.layout import format_gamma

    return f"{mode}-{format_gamma(gamma)}"


def destination(variant: Variant, kind: str) -> str:
    """Staged file prefix of a variant's purified rows (kind "purified") or dead letters (kind "dead")."""
    return f"{variant_name(*variant)}.{kind}"


def row_counter(variant: Variant, kind: str) -> str:
    """Name of the counter of the rows the pipeline produced for a variant and kind."""
    return f"{kind}/{variant_name(*variant)}"


def schema_of(dest: str) -> pa.Schema:
    """The schema of a staged destination."""
    if dest == INVALID_DESTINATION:
        return INVALID
    if dest == COUNTS_DESTINATION:
        return COUNTS
    return PURIFIED if dest.endswith(".purified") else DEAD_LETTER


def staged_file(staging: Path, dest: str) -> Path:
    """The one staged file of a destination (named as Beam's WriteToFiles named a single shard)."""
    return Path(staging) / f"{dest}-00000-of-00001.parquet"


class ReadRawParts(beam.DoFn):
    """(shard folder, manifest part entry) → (part path, validated raw table).

    A plain DoFn over the manifest's parts rather than Beam's Parquet source: every part is checked
    against the manifest (storage.shards.read_part) wherever it is read, and runners without
    splittable reads (Dask) can run it. A part that fails validation is not raised (Beam would log a
    traceback per retry) but emitted as (INVALID_DESTINATION, the reason), which goes to staging; the
    driver then refuses the whole shard.
    """

    def infer_output_type(self, input_type):
        return DestinedTable

    def process(self, element):
        from storage.shards import PartInfo, ShardError, read_part

        directory, part = element
        info = PartInfo(**part)
        try:
            table = read_part(Path(directory), info, RAW)
        except ShardError as e:
            yield INVALID_DESTINATION, pa.table({"reason": [str(e)]}, schema=INVALID)
            return
        yield str(Path(directory) / info.name), table.select(RAW.names).cast(RAW)


def _tokenizer_decode(tokenizer_dir: str) -> Callable[[list[int]], str]:
    from tokenizers import Tokenizer  # the Rust tokenizer alone: no transformers import per worker

    tok = Tokenizer.from_file(str(Path(tokenizer_dir) / "tokenizer.json"))
    return lambda ids: tok.decode(list(ids), skip_special_tokens=False)


def _compact(part: pa.Table, whole: pa.Table) -> pa.Table:
    """A bucket as its own table: a slice pickles with the whole batch's buffers, and runners that move
    elements between processes by pickle (Dask) would ship the batch once per bucket."""
    if part.num_rows == whole.num_rows:
        return part
    return part.take(pa.array(np.arange(part.num_rows)))


class PurifyBatches(beam.DoFn):
    """(file, raw Arrow batch) → ((variant, bucket), purified table), and (destination, dead letters).

    One output for both (a tuple key is a group, a str key a destination; see `build`): tagged outputs
    are not kept apart by every runner. A refused part (INVALID_DESTINATION) passes through to staging."""

    def __init__(self, job: PurifyJob, n_buckets: int = BUCKETS) -> None:
        self.job, self.n_buckets = job, n_buckets

    def setup(self) -> None:
        tokenizer_dir = self.job.tokenizer_dir
        self.decode = per_process("tokenizer", (str(Path(tokenizer_dir) / "tokenizer.json"), _files_key(tokenizer_dir)),
                                  lambda: _tokenizer_decode(tokenizer_dir))
        # saar_is scores every rollback with the recompute model (the same one GroupStage uses, once per process)
        self.score = self.job.backend().score if any(m in IS_MODES for m, _ in self.job.variants) else None

    def infer_output_type(self, input_type):
        return KeyedTable

    def process(self, element):
        from purifier.batch import buckets, purify_batch

        filename, raw = element
        if filename == INVALID_DESTINATION:
            yield element
            return
        for variant, (table, dead) in purify_batch(raw, list(self.job.variants), self.decode, str(filename),
                                                   self.job.measure, self.score).items():
            if dead:
                yield destination(variant, "dead"), pa.Table.from_pylist(dead, schema=DEAD_LETTER)
            for bucket, part in buckets(table, self.n_buckets):
                yield (variant, bucket), _compact(part, table)


def _recompute_backend(recompute: str, checkpoint: str | None, temperature: float, sglang_url: str,
                       vllm_urls: tuple[str, ...] = ()):
    if recompute == "cpu" and checkpoint:
        from purifier.recompute import CPURecompute

        return CPURecompute(Path(checkpoint), temperature)
    if recompute == "sglang":
        from purifier.recompute import SGLangRecompute

        return SGLangRecompute(sglang_url, temperature)
    if recompute == "vllm" and checkpoint:
        from purifier.recompute import VLLMRecompute

        return VLLMRecompute(list(vllm_urls), Path(checkpoint), temperature)
    return None


class GroupStage(beam.DoFn):
    """Advantages + dynamic filtering + log-prob recompute for the prompt groups of one bucket →
    (purified destination, table) and (COUNTS_DESTINATION, counts)."""

    def __init__(self, job: PurifyJob) -> None:
        self.job = job

    def setup(self) -> None:
        self.backend = self.job.backend()  # once per process and checkpoint: Dask calls setup for every bundle

    def infer_output_type(self, input_type):
        return DestinedTable

    def process(self, element):
        import pyarrow.compute as pc

        from purifier.batch import recompute_groups, with_advantages

        (variant, _), parts = element
        job = self.job
        table, filtered = with_advantages(pa.concat_tables(list(parts)), job.estimator, job.dynamic_filter,
                                          job.roc_group_size if variant[0] == "roc" else None)
        counts = {}
        if filtered:
            counts[f"filtered_groups/{variant_name(*variant)}"] = filtered
        if table.num_rows:
            if self.backend is not None:
                table = recompute_groups(table, self.backend)
            counts["tokens_forwarded"] = int(pc.sum(table["tokens_forwarded"]).as_py() or 0)
            yield destination(variant, "purified"), table
        if counts:
            yield COUNTS_DESTINATION, pa.table({"name": list(counts), "value": list(counts.values())}, schema=COUNTS)


class WriteStaged(beam.DoFn):
    """(destination, its tables) → one Parquet file in staging, then (destination, rows written).

    Written to a hidden temporary name and renamed: a retried or re-executed bundle (a worker lost
    mid-run) rewrites the same complete file, never a second copy of its rows."""

    def __init__(self, staging: str) -> None:
        self.staging = staging

    def process(self, element):
        dest, tables = element
        schema = schema_of(dest)
        table = pa.concat_tables([t.select(schema.names).cast(schema) for t in tables])
        atomic_write_parquet(staged_file(Path(self.staging), dest), table)
        yield dest, table.num_rows


class WriteSummary(beam.DoFn):
    """All (destination, rows) of the run → SUMMARY, the pipeline's own account of what it staged."""

    def __init__(self, staging: str) -> None:
        self.staging = staging

    def process(self, element):
        _, written = element
        summary = {dest: rows for dest, rows in written if dest}
        path = Path(self.staging) / SUMMARY
        tmp = path.with_name(f".{SUMMARY}.{uuid.uuid4().hex[:8]}.tmp")
        tmp.write_text(json.dumps(summary, sort_keys=True))
        os.replace(tmp, path)
        yield len(summary)


def _is_destined(record) -> bool:
    return isinstance(record[0], str)


def _is_group(record) -> bool:
    return not isinstance(record[0], str)


def build(p: beam.Pipeline, job: PurifyJob) -> None:
    staging = job.staging
    purified = (p | "RawParts" >> beam.Create(list(job.raw_parts))
                | "ReadRaw" >> beam.ParDo(ReadRawParts())
                | "Purify" >> beam.ParDo(PurifyBatches(job)))
    grouped = (
        purified
        | "Groups" >> beam.Filter(_is_group).with_output_types(KeyedTable)
        | "ByPromptBucket" >> beam.GroupByKey()
        | "GroupStage" >> beam.ParDo(GroupStage(job))
    )
    letters = purified | "DeadAndRefused" >> beam.Filter(_is_destined).with_output_types(DestinedTable)
    written = (
        (grouped, letters)
        | "ToStage" >> beam.Flatten()
        | "ByDestination" >> beam.GroupByKey()
        | "WriteStaged" >> beam.ParDo(WriteStaged(str(staging))).with_output_types(beam.typehints.Tuple[str, int])
    )
    # the last transform depends on every branch (Dask computes only what the last one needs); the
    # empty record makes a summary even when nothing was staged
    (
        (written, p | "Nothing" >> beam.Create([("", 0)]).with_output_types(beam.typehints.Tuple[str, int]))
        | "AllWritten" >> beam.Flatten()
        | "OneKey" >> beam.Map(lambda record: (0, record)).with_output_types(
            beam.typehints.Tuple[int, beam.typehints.Tuple[str, int]])
        | "Together" >> beam.GroupByKey()
        | "WriteSummary" >> beam.ParDo(WriteSummary(str(staging)))
    )


def staged_counts(staging: Path) -> dict[str, int]:
    """The counts of what a finished pipeline staged, from its summary and counts destination:
    "purified/<variant>", "dead/<variant>", "invalid_parts", "filtered_groups[/<variant>]", "tokens_forwarded"."""
    try:
        summary = json.loads((Path(staging) / SUMMARY).read_text())
    except FileNotFoundError:
        raise StagingIncomplete(
            f"{staging}: the pipeline finished but its summary {SUMMARY} is not there: its workers wrote "
            "somewhere the driver cannot see (on a cluster, storage.root must be a file system every worker "
            "and the driver share at the same path); nothing was committed") from None
    counters: dict[str, int] = {}
    for dest, rows in summary.items():
        if dest == INVALID_DESTINATION:
            counters["invalid_parts"] = rows
        elif dest != COUNTS_DESTINATION:
            name, kind = dest.rsplit(".", 1)
            counters[f"{kind}/{name}"] = rows
    if summary.get(COUNTS_DESTINATION):
        try:
            counts = pq.read_table(staged_file(staging, COUNTS_DESTINATION)).to_pylist()
        except FileNotFoundError:
            raise StagingIncomplete(f"{staged_file(staging, COUNTS_DESTINATION)}: staged by the pipeline but not "
                                    "there; nothing was committed") from None
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
        release_per_process()  # an in-process runner built the model here: do not keep it past the stage
    return staged_counts(Path(job.staging))
