"""Phase 2 as a stage: one iteration's raw shard → one purified partition per (mode, γ).

Partitions already committed with the same inputs and settings are skipped, so a rerun after a
crash redoes only what is missing, and a replay under a new γ never touches the raw shard or the
partitions beside it.
"""
from __future__ import annotations

import hashlib
import json
import shutil
import uuid
from dataclasses import dataclass
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from pipeline.config import CleanerConfig
from purifier import beam_pipeline
from purifier.batch import SORT
from purifier.saar import partition_gamma
from storage.layout import RunLayout
from storage.schemas import DEAD_LETTER, PURIFIED, RAW
from storage.shards import ShardError, ShardMissing, is_committed, read_manifest, shard_files, write_shard


class DeadLetterOverflow(RuntimeError):
    """More raw rows than allowed could not be purified; nothing was committed for that variant."""


class StagingMismatch(RuntimeError):
    """The staged files hold other row counts than the pipeline produced; nothing was committed."""


@dataclass
class VariantResult:
    mode: str
    gamma: float
    rows: int
    dead: int
    skipped: bool


def purify_config_hash(cfg: CleanerConfig, mode: str, gamma: float, raw_hash: str) -> str:
    settings = cfg.purify.model_dump(mode="json", exclude={"modes", "gammas", "runner", "beam_options"})
    data = json.dumps({"purify": settings, "temperature": cfg.rollout.temperature, "mode": mode, "gamma": gamma,
                       "raw": raw_hash}, sort_keys=True)
    return hashlib.blake2b(data.encode(), digest_size=8).hexdigest()


def _staged(staging: Path, variant: tuple[str, float], kind: str, schema: pa.Schema,
            counters: dict[str, int]) -> pa.Table:
    """The rows the pipeline wrote for one variant and kind, checked against its own count of them (a
    file sink that lost a file would otherwise look like fewer rows)."""
    dest = beam_pipeline.destination(variant, kind)
    tables = [pq.read_table(f) for f in sorted(staging.glob(dest + "-*.parquet"))]
    table = pa.concat_tables(tables).cast(schema) if tables else schema.empty_table()
    reported = any(k.startswith(("purified/", "dead/")) for k in counters)  # a runner without metrics has none
    expected = counters.get(beam_pipeline.row_counter(variant, kind), 0)
    if reported and table.num_rows != expected:
        raise StagingMismatch(f"{staging}: {table.num_rows} staged rows for {dest}, but the pipeline produced "
                              f"{expected}; nothing was committed")
    return table


def run_purify_stage(cfg: CleanerConfig, run_id: str, iteration: int, modes: list[str] | None = None,
                     gammas: list[float] | None = None, checkpoint: Path | None = None) -> list[VariantResult]:
    layout = RunLayout(cfg.storage.root, run_id)
    raw_dir = layout.raw_dir(iteration)
    raw_manifest = read_manifest(raw_dir)
    if raw_manifest is None:
        raise ShardMissing(f"{raw_dir}: no committed raw shard for iteration {iteration} (run the rollout first)")
    if raw_manifest.schema != RAW.metadata[b"cleaner.schema"].decode():
        raise ShardError(f"{raw_dir / '_MANIFEST.json'}: schema version {raw_manifest.schema}, expected raw/1")
    checkpoint = Path(checkpoint or (raw_manifest.inputs[0] if raw_manifest.inputs else cfg.rollout.policy))
    modes = modes or cfg.purify.modes
    gammas = gammas or cfg.purify.gammas
    variants, results = [], []
    wanted = dict.fromkeys((m, partition_gamma(m, g)) for m in modes for g in gammas)
    for mode, gamma in wanted:
        h = purify_config_hash(cfg, mode, gamma, raw_manifest.config_hash)
        out = layout.purified_dir(iteration, mode, gamma)
        if is_committed(out, h):
            m = read_manifest(out)
            results.append(VariantResult(mode, gamma, m.rows, m.extra.get("dead", 0), True))
        elif is_committed(out):
            raise ShardError(f"{out}: committed with other settings; use a new run id to change them")
        else:
            variants.append((mode, float(gamma), h))
    if not variants:
        return results
    staging = layout.iteration_dir(iteration) / ".staging" / f"purify-{uuid.uuid4().hex[:8]}"
    try:
        staging.mkdir(parents=True)  # before the pipeline runs: an unfinished purification leaves a trace
        counters = beam_pipeline.run(
            [str(f) for f in shard_files(raw_dir)], [(m, g) for m, g, _ in variants], staging, str(checkpoint),
            cfg.purify.advantage, cfg.purify.dynamic_filter, cfg.purify.recompute, str(checkpoint),
            cfg.rollout.temperature, cfg.purify.runner, cfg.purify.beam_options, cfg.rollout.sglang_url)
        for mode, gamma, h in variants:
            name = beam_pipeline.variant_name(mode, gamma)
            table = _staged(staging, (mode, gamma), "purified", PURIFIED, counters).sort_by(SORT)
            dead = _staged(staging, (mode, gamma), "dead", DEAD_LETTER, counters).sort_by([("raw_key", "ascending")])
            fraction = dead.num_rows / max(1, raw_manifest.rows)
            inputs = [str(raw_dir / "_MANIFEST.json")]
            dead_dir = layout.dead_letter_dir(iteration, mode, gamma)
            if not is_committed(dead_dir):
                write_shard(dead_dir, dead, DEAD_LETTER, h, inputs=inputs)
            if fraction > cfg.purify.max_dead_letter_fraction:
                reasons = "; ".join(sorted(set(dead.column("reason").to_pylist()))[:3])
                raise DeadLetterOverflow(
                    f"{raw_dir}: {dead.num_rows}/{raw_manifest.rows} rows could not be purified for mode={mode} "
                    f"γ={gamma} (limit {cfg.purify.max_dead_letter_fraction:.0%}); see {dead_dir}. First reasons: {reasons}")
            extra = {"dead": dead.num_rows, "filtered_groups": counters.get(f"filtered_groups/{name}", 0),
                     "checkpoint": str(checkpoint)}
            write_shard(layout.purified_dir(iteration, mode, gamma), table, PURIFIED, h, inputs=inputs, extra=extra,
                        rows_per_part=cfg.storage.rows_per_part, compression=cfg.storage.compression)
            results.append(VariantResult(mode, gamma, table.num_rows, dead.num_rows, False))
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return results
