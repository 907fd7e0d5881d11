"""The purification stage as an Apache Beam pipeline (thin adapters around purifier/saar.py).

ReadAllFromParquet(raw parts) → ParseRaw → PurifyVariants (one output per (mode, γ)) →
GroupByKey(mode, γ, prompt) → GroupStage (advantages, dynamic filter, batched log-prob recompute
with the model loaded once per worker in `setup`) → WriteToParquet per variant into a staging
folder; the driver (purifier/stage.py) then sorts and commits each partition through storage/.
Bad rows go to a dead-letter output with the reason instead of failing the whole stage.
Runs in-process on FnApiRunner by default; any runner and its options can be passed through
(e.g. `--runner=FlinkRunner --flink_master=…`, `--runner=SparkRunner`, `--runner=DataflowRunner
--project=… --region=… --temp_location=gs://…`).
"""
from __future__ import annotations

from pathlib import Path

import apache_beam as beam
from apache_beam.metrics import Metrics
from apache_beam.options.pipeline_options import PipelineOptions

from pipeline.trajectory import purified_from_row, purified_to_row, trajectory_from_row
from storage.schemas import DEAD_LETTER, PURIFIED, RAW

Variant = tuple[str, float]


def variant_name(mode: str, gamma: float) -> str:
    from storage.layout import format_gamma

    return f"{mode}-{format_gamma(gamma)}"


class ParseRaw(beam.DoFn):
    """A raw Parquet row → Trajectory; unparseable rows become dead letters for every variant."""

    def __init__(self, variants: list[Variant]) -> None:
        self.variants = variants

    def process(self, element):
        filename, row = element
        try:
            yield trajectory_from_row(row)
        except (KeyError, TypeError, ValueError) as e:
            key = f"{row.get('run_id')}/{row.get('iteration')}/{row.get('prompt_id')}/{row.get('sample_idx')}"
            for mode, gamma in self.variants:
                yield beam.pvalue.TaggedOutput("dead", ((mode, gamma), {
                    "raw_key": key, "source_file": str(filename), "reason": f"unreadable raw row: {type(e).__name__}: {e}"}))


class PurifyVariants(beam.DoFn):
    def __init__(self, variants: list[Variant], tokenizer_dir: str) -> None:
        self.variants = variants
        self.tokenizer_dir = tokenizer_dir

    def setup(self) -> None:
        from tokenizers import Tokenizer  # the Rust tokenizer alone: no transformers import per worker

        tok = Tokenizer.from_file(str(Path(self.tokenizer_dir) / "tokenizer.json"))
        self.decode = lambda ids: tok.decode(list(ids), skip_special_tokens=False)

    def process(self, raw):
        from purifier.saar import PurifyError, purify

        for mode, gamma in self.variants:
            try:
                p = purify(raw, gamma, mode, self.decode)
            except PurifyError as e:
                yield beam.pvalue.TaggedOutput("dead", ((mode, gamma), {
                    "raw_key": raw.key, "source_file": "", "reason": str(e)}))
                continue
            yield (mode, gamma, raw.prompt_id), purified_to_row(p)  # plain rows: Beam's fast coder, not pickle


class GroupStage(beam.DoFn):
    """Advantages + dynamic filtering + log-prob recompute for one prompt group of one variant."""

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

    def process(self, element):
        from purifier.advantages import apply_group_rows

        (mode, gamma, _), group = element
        kept = apply_group_rows(list(group), self.estimator, self.dynamic_filter)
        if not kept:
            self.filtered.inc()
            Metrics.counter("purify", f"filtered_groups/{variant_name(mode, gamma)}").inc()
            return
        if self.backend is not None:  # recompute works on the domain objects
            kept = [purified_to_row(t) for t in self.backend.group([purified_from_row(r) for r in kept])]
        for row in kept:
            self.forwarded.inc(row["tokens_forwarded"])
            yield (mode, gamma), row


def build(p: beam.Pipeline, raw_files: list[str], variants: list[Variant], staging: Path, tokenizer_dir: str,
          estimator: str, dynamic_filter: bool, recompute: str, checkpoint: str | None, temperature: float,
          sglang_url: str = "") -> None:
    from purifier.saar import LIVED_COLUMNS

    columns = [n for n in RAW.names if n not in LIVED_COLUMNS]
    rows = (p | "RawFiles" >> beam.Create(raw_files)
            | "ReadRaw" >> beam.io.ReadAllFromParquet(with_filename=True, columns=columns))
    parsed = rows | "Parse" >> beam.ParDo(ParseRaw(variants)).with_outputs("dead", main="ok")
    purified = parsed.ok | "Purify" >> beam.ParDo(PurifyVariants(variants, tokenizer_dir)).with_outputs("dead", main="ok")
    staged = (
        purified.ok
        | "ByPromptGroup" >> beam.GroupByKey()
        | "GroupStage" >> beam.ParDo(GroupStage(estimator, dynamic_filter, recompute, checkpoint, temperature,
                                                sglang_url))
    )
    dead = (parsed.dead, purified.dead) | "DeadLetters" >> beam.Flatten()
    for mode, gamma in variants:
        name = variant_name(mode, gamma)
        (staged
         | f"Select {name}" >> beam.Filter(lambda kv, v=(mode, gamma): kv[0] == v)
         | f"Rows {name}" >> beam.Values()
         | f"Write {name}" >> beam.io.WriteToParquet(str(staging / name / "purified"), PURIFIED, num_shards=1,
                                                      shard_name_template="", file_name_suffix=".parquet"))
        (dead
         | f"SelectDead {name}" >> beam.Filter(lambda kv, v=(mode, gamma): kv[0] == v)
         | f"DeadRows {name}" >> beam.Values()
         | f"WriteDead {name}" >> beam.io.WriteToParquet(str(staging / name / "dead"), DEAD_LETTER, num_shards=1,
                                                          shard_name_template="", file_name_suffix=".parquet"))


def run(raw_files: list[str], variants: list[Variant], staging: Path, tokenizer_dir: str, estimator: str,
        dynamic_filter: bool, recompute: str, checkpoint: str | None, temperature: float, runner: str,
        beam_options: list[str], sglang_url: str = "") -> dict[str, int]:
    options = PipelineOptions([f"--runner={runner}", *beam_options])
    p = beam.Pipeline(options=options)
    build(p, raw_files, variants, staging, tokenizer_dir, estimator, dynamic_filter, recompute, checkpoint,
          temperature, sglang_url)
    result = p.run()
    result.wait_until_finish()
    counters = {}
    for c in result.metrics().query()["counters"]:
        counters[c.key.metric.name] = counters.get(c.key.metric.name, 0) + c.committed
    return counters

