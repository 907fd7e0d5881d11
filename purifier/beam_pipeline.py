"""The purification stage as an Apache Beam pipeline (thin adapters around purifier/batch.py).

ReadRawParts(the raw manifest's parts, each validated: size, crc32, schema, rows) → PurifyBatches (Arrow batches: one purified table per (mode, γ),
cut into buckets by a stable hash of the prompt) → GroupByKey((mode, γ), bucket) → GroupStage
(advantages, dynamic filter, batched log-prob recompute with the model loaded once per worker in
`setup`) → WriteToFiles (Parquet, one destination per variant; dead letters likewise) into a
staging folder; the driver (purifier/stage.py) checks the staged row counts
against the pipeline's counters, then sorts and commits each partition through storage/. Bad rows go
to the dead-letter destination with the reason instead of failing the whole stage. Arrow tables,
not rows, cross every stage boundary, so Beam's per-element cost is paid per batch.

Runs in-process on FnApiRunner by default; any runner and its options can be passed through
(e.g. `--runner=FlinkRunner --flink_master=…`, `--runner=SparkRunner`, `--runner=DataflowRunner
--project=… --region=… --temp_location=gs://…`). The bucket count bounds the group stage's
parallelism on a distributed runner.
"""
from __future__ import annotations

import logging
from pathlib import Path

import apache_beam as beam
import pyarrow as pa
from apache_beam.io import fileio
from apache_beam.metrics import Metrics
from apache_beam.options.pipeline_options import PipelineOptions

from pipeline.similarity import DEFAULT_MEASURE, Measure
from storage.schemas import DEAD_LETTER, PURIFIED, RAW

Variant = tuple[str, float]
BUCKETS = 8
# Parts that failed validation, with the reason: the driver refuses the shard when any is staged.
INVALID = pa.schema([("reason", pa.string())])
INVALID_DESTINATION = "invalid-parts"


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


class ParquetTableSink(fileio.FileSink):
    """WriteToFiles sink: the (destination, table) records of one destination as one Parquet file."""

    def __init__(self, schema: pa.Schema) -> None:
        self.schema = schema

    def open(self, fh) -> None:
        import pyarrow.parquet as pq

        self.writer = pq.ParquetWriter(fh, self.schema)

    def write(self, record: tuple[str, pa.Table]) -> None:
        self.writer.write_table(record[1].cast(self.schema))

    def flush(self) -> None:
        self.writer.close()


class ReadRawParts(beam.DoFn):
    """(shard folder, manifest part entry) → (part path, validated raw table).

    A plain DoFn over the manifest's parts rather than Beam's Parquet source: every part is checked
    against the manifest (storage.shards.read_part) wherever it is read, and runners without
    splittable reads (Dask) can run it. A part that fails validation is not raised (Beam would log a
    traceback per retry) but tagged "invalid" with the reason; the driver then refuses the whole shard.
    """

    def infer_output_type(self, input_type):
        return beam.typehints.Tuple[str, pa.Table]

    def process(self, element):
        from storage.shards import PartInfo, ShardError, read_part

        directory, part = element
        info = PartInfo(**part)
        try:
            table = read_part(Path(directory), info, RAW)
        except ShardError as e:
            Metrics.counter("purify", "invalid_parts").inc()
            yield beam.pvalue.TaggedOutput("invalid", (INVALID_DESTINATION, pa.table({"reason": [str(e)]},
                                                                                        schema=INVALID)))
            return
        yield str(Path(directory) / info.name), table.select(RAW.names).cast(RAW)


class PurifyBatches(beam.DoFn):
    """(file, raw Arrow batch) → ((variant, bucket), purified table) and tagged dead letters."""

    def __init__(self, variants: list[Variant], tokenizer_dir: str, n_buckets: int = BUCKETS,
                 measure: Measure = DEFAULT_MEASURE) -> None:
        self.variants, self.tokenizer_dir, self.n_buckets = variants, tokenizer_dir, n_buckets
        self.measure = measure  # shallow/deep similarity of this purification (one per stage run)

    def setup(self) -> None:
        from tokenizers import Tokenizer  # the Rust tokenizer alone: no transformers import per worker

        tok = Tokenizer.from_file(str(Path(self.tokenizer_dir) / "tokenizer.json"))
        self.decode = lambda ids: tok.decode(list(ids), skip_special_tokens=False)

    def infer_output_type(self, input_type):
        # the main output is keyed ((variant, bucket), table); inference from the generator would also
        # see the tagged dead letters and refuse the GroupByKey
        return KeyedTable

    def process(self, element):
        from purifier.batch import buckets, purify_batch

        filename, raw = element
        for variant, (table, dead) in purify_batch(raw, self.variants, self.decode, str(filename),
                                                   self.measure).items():
            if dead:
                Metrics.counter("purify", row_counter(variant, "dead")).inc(len(dead))
                yield beam.pvalue.TaggedOutput("dead", (destination(variant, "dead"),
                                                        pa.Table.from_pylist(dead, schema=DEAD_LETTER)))
            for bucket, part in buckets(table, self.n_buckets):
                yield (variant, bucket), part


class GroupStage(beam.DoFn):
    """Advantages + dynamic filtering + log-prob recompute for the prompt groups of one bucket."""

    def __init__(self, estimator: str, dynamic_filter: bool, recompute: str, checkpoint: str | None,
                 temperature: float, sglang_url: str = "") -> None:
        self.estimator, self.dynamic_filter = estimator, dynamic_filter
        self.recompute, self.checkpoint, self.temperature, self.sglang_url = recompute, checkpoint, temperature, sglang_url
        self.filtered = Metrics.counter("purify", "filtered_groups")
        self.forwarded = Metrics.counter("purify", "tokens_forwarded")

    def setup(self) -> None:
        self.backend = None
        if self.recompute == "cpu" and self.checkpoint:
            from purifier.recompute import CPURecompute

            self.backend = CPURecompute(Path(self.checkpoint), self.temperature)
        elif self.recompute == "sglang":
            from purifier.recompute import SGLangRecompute

            self.backend = SGLangRecompute(self.sglang_url, self.temperature)

    def infer_output_type(self, input_type):
        return DestinedTable

    def process(self, element):
        import pyarrow.compute as pc

        from purifier.batch import recompute_groups, with_advantages

        (variant, _), parts = element
        table, filtered = with_advantages(pa.concat_tables(list(parts)), self.estimator, self.dynamic_filter)
        if filtered:
            self.filtered.inc(filtered)
            Metrics.counter("purify", f"filtered_groups/{variant_name(*variant)}").inc(filtered)
        if table.num_rows == 0:
            return
        if self.backend is not None:
            table = recompute_groups(table, self.backend)
        self.forwarded.inc(int(pc.sum(table["tokens_forwarded"]).as_py() or 0))
        Metrics.counter("purify", row_counter(variant, "purified")).inc(table.num_rows)
        yield destination(variant, "purified"), table


def build(p: beam.Pipeline, raw_parts: list[tuple[str, dict]], variants: list[Variant], staging: Path, tokenizer_dir: str,
          estimator: str, dynamic_filter: bool, recompute: str, checkpoint: str | None, temperature: float,
          sglang_url: str = "", measure: Measure = DEFAULT_MEASURE) -> None:
    read = (p | "RawParts" >> beam.Create(raw_parts)
            | "ReadRaw" >> beam.ParDo(ReadRawParts()).with_outputs("invalid", main="ok"))
    purified = read.ok | "Purify" >> beam.ParDo(PurifyBatches(variants, tokenizer_dir, measure=measure)).with_outputs("dead", main="ok")
    staged = (
        purified.ok
        | "ByPromptBucket" >> beam.GroupByKey()
        | "GroupStage" >> beam.ParDo(GroupStage(estimator, dynamic_filter, recompute, checkpoint, temperature,
                                                sglang_url))
    )
    # one sink per kind, each fused with its producer; a Flatten of both would be materialised first
    for kind, tables, schema in (("Purified", staged, PURIFIED), ("Dead", purified.dead, DEAD_LETTER),
                                 ("Invalid", read.invalid, INVALID)):
        tables | f"Write{kind}" >> fileio.WriteToFiles(
            str(staging), destination=lambda record: record[0], sink=lambda _, schema=schema: ParquetTableSink(schema),
            file_naming=fileio.destination_prefix_naming(".parquet"))


def run(raw_parts: list[tuple[str, dict]], variants: list[Variant], staging: Path, tokenizer_dir: str, estimator: str,
        dynamic_filter: bool, recompute: str, checkpoint: str | None, temperature: float, runner: str,
        beam_options: list[str], sglang_url: str = "", measure: Measure = DEFAULT_MEASURE) -> dict[str, int]:
    options = PipelineOptions([f"--runner={runner}", *beam_options])
    p = beam.Pipeline(options=options)
    build(p, raw_parts, variants, staging, tokenizer_dir, estimator, dynamic_filter, recompute, checkpoint,
          temperature, sglang_url, measure)
    # Beam logs every failing DoFn's traceback before re-raising it; the exception itself reaches the
    # stage (which turns a full disk into one line) and the CLI (which keeps a bug's traceback).
    beam_log = logging.getLogger("apache_beam.runners.common")
    level = beam_log.level
    beam_log.setLevel(logging.CRITICAL)
    try:
        result = p.run()
        result.wait_until_finish()
    finally:
        beam_log.setLevel(level)
    counters = {}
    for c in result.metrics().query()["counters"]:
        counters[c.key.metric.name] = counters.get(c.key.metric.name, 0) + c.committed
    return counters
