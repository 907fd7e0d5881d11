"""Purification over Arrow batches: the pure core the Beam pipeline applies per batch and per group
bucket (and that a plain loop can call directly).

`purify_batch`: raw rows → purified rows per variant (pipeline.modes.Variant) plus dead letters; rows
with nothing to splice are built column-wise (purifier/unspliced.py), the others go through `purify()`
one by one.
`with_advantages`: whole prompt groups → GRPO advantages (`group_plan`), dynamic filtering; for `roc`,
GRPO-RoC's down-sampling first (purifier/roc.py), so advantages are those of the kept group.
`buckets`: split a batch by a stable hash of the prompt, so one prompt's rows always meet in one group.
"""

from __future__ import annotations

import zlib
from typing import Callable

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from pipeline.trajectory import purified_from_row, purified_to_row, row_key, trajectory_from_row
from pipeline.modes import Variant
from purifier.advantages import group_plan
from purifier.roc import ROC_PENALTY, roc_plan, roc_seed, with_roc_penalty
from purifier.saar import LIVED_COLUMNS, PurifyError, Scorer, purify, with_splice_ratios
from purifier.unspliced import UNSPLICED_MODES, purified_table, unspliced_mask
from storage.schemas import PURIFIED

SORT = [("prompt_id", "ascending"), ("sample_idx", "ascending")]


def _dead(key: str, source_file: str, reason: str) -> dict:
    return {"raw_key": key, "source_file": source_file, "reason": reason}


def purify_batch(
    raw: pa.Table,
    variants: list[Variant],
    decode: Callable[[list[int]], str],
    source_file: str = "",
    score: Scorer | None = None,
) -> dict[Variant, tuple[pa.Table, list[dict]]]:
    """Every variant of every row of a raw batch: (purified table, dead letters) per variant, each spliced
    under its own measure (rows with nothing to splice do not depend on it); `score` for saar_is."""
    columnar = [v for v in variants if v.mode in UNSPLICED_MODES]
    others = [v for v in variants if v.mode not in UNSPLICED_MODES]
    mask = unspliced_mask(raw) if columnar else np.zeros(raw.num_rows, dtype=bool)
    lean = raw.drop_columns([c for c in LIVED_COLUMNS if c in raw.column_names])  # purify() rebuilds them
    tables: dict[Variant, list[pa.Table]] = {v: [] for v in variants}
    rows: dict[Variant, list[dict]] = {v: [] for v in variants}
    dead: dict[Variant, list[dict]] = {v: [] for v in variants}

    def one_by_one(raw_rows: list[dict], wanted: list[Variant]) -> None:
        for row in raw_rows:
            try:
                traj = trajectory_from_row(row)
            except (KeyError, TypeError, ValueError) as e:
                key = row_key(row.get("run_id"), row.get("iteration"), row.get("prompt_id"), row.get("sample_idx"))
                for v in wanted:
                    dead[v].append(_dead(key, source_file, f"unreadable raw row: {type(e).__name__}: {e}"))
                continue
            for v in wanted:
                try:
                    rows[v].append(purified_to_row(purify(traj, v.gamma, v.mode, decode, v.measure, score, tau=v.tau)))
                except PurifyError as e:
                    dead[v].append(_dead(traj.key, source_file, str(e)))

    if mask.any():
        unspliced = raw.filter(pa.array(mask))
        for v in columnar:
            tables[v].append(purified_table(unspliced, v.mode, v.threshold))
        if others:
            one_by_one(lean.filter(pa.array(mask)).to_pylist(), others)
    one_by_one(lean.filter(pa.array(~mask)).to_pylist(), variants)
    for v in variants:
        if rows[v]:
            tables[v].append(pa.Table.from_pylist(rows[v], schema=PURIFIED))
    out = {v: (pa.concat_tables(tables[v]) if tables[v] else PURIFIED.empty_table(), dead[v]) for v in variants}
    for v in variants:  # RoC selects per group by a penalty read from the attempt tree, which only this batch has
        if v.mode == "roc" and out[v][0].num_rows:
            out[v] = (with_roc_penalty(out[v][0], raw), dead[v])
    return out


def token_slices(raw: pa.Table, budget: int, tokens: str = "lived_ids") -> list[pa.Table]:
    """A raw batch as consecutive slices of at most `budget` lived tokens each (at least one row each), so the
    Python objects purification builds per row (`purify_batch`) are bounded by the budget, not by the part:
    a raw part holds up to storage.rows_per_part rows of up to 32k tokens. (`tokens`: the column counted; a
    purified table's is response_ids.)"""
    if raw.num_rows == 0:
        return []
    sizes = pc.fill_null(pc.list_value_length(raw[tokens]), 0).to_numpy(zero_copy_only=False)
    slices, start, total = [], 0, 0
    for r, size in enumerate(sizes):
        if r > start and total + size > budget:
            slices.append(raw.slice(start, r - start))
            start, total = r, 0
        total += int(size)
    slices.append(raw.slice(start))
    return slices


def buckets(table: pa.Table, n: int) -> list[tuple[int, pa.Table]]:
    """(bucket, rows) by crc32 of the prompt id: stable across processes and runs, unlike hash().
    Buckets are slices of one sorted copy: write them as Parquet or Arrow IPC, which write only a slice's own
    rows (a pickled slice would carry the whole batch's buffers)."""
    if table.num_rows == 0:
        return []
    ids = pc.dictionary_encode(table["prompt_id"]).combine_chunks()  # hash each prompt once, not each sample
    of_prompt = np.fromiter(
        (zlib.crc32(p.encode()) % n for p in ids.dictionary.to_pylist()), dtype=np.int64, count=len(ids.dictionary)
    )
    bucket = of_prompt[ids.indices.to_numpy(zero_copy_only=False)]
    order = np.argsort(bucket, kind="stable")
    table, bucket = table.take(pa.array(order)), bucket[order]
    starts = np.flatnonzero(np.r_[True, bucket[1:] != bucket[:-1]])
    ends = np.r_[starts[1:], len(bucket)]
    return [(int(bucket[s]), table.slice(s, e - s)) for s, e in zip(starts, ends)]


def with_advantages(
    table: pa.Table, estimator: str, dynamic_filter: bool, roc_group_size: int | None = None
) -> tuple[pa.Table, int]:
    """Whole prompt groups → rows in (prompt, sample) order with their advantage; filtered groups dropped.
    With `roc_group_size` (mode roc; rows carry ROC_PENALTY) each group is first down-sampled by
    `roc_plan`. Returns the table (PURIFIED columns) and the number of groups filtered out."""
    if roc_group_size is not None and ROC_PENALTY not in table.column_names and table.num_rows:
        raise ValueError(f"RoC selection needs the {ROC_PENALTY} column purify_batch adds to roc rows")
    if table.num_rows == 0:
        return table, 0
    table = table.sort_by(SORT)
    prompts = table["prompt_id"].to_pylist()
    samples, rewards = table["sample_idx"].to_pylist(), table["reward"].to_pylist()
    roc = roc_group_size is not None
    penalties, iterations = (table[ROC_PENALTY].to_pylist(), table["iteration"].to_pylist()) if roc else ([], [])
    keep, advantages, filtered, start = [], [], 0, 0
    for end in [*np.flatnonzero([a != b for a, b in zip(prompts, prompts[1:])]) + 1, len(prompts)]:
        rows = list(range(start, end))
        if roc:
            rows = [
                start + k
                for k in roc_plan(
                    samples[start:end],
                    rewards[start:end],
                    penalties[start:end],
                    roc_group_size,
                    roc_seed(iterations[start], prompts[start]),
                )
            ]
        plan = group_plan([(samples[i], rewards[i]) for i in rows], estimator, dynamic_filter)
        filtered += not plan
        keep += [rows[k] for k, _ in plan]
        advantages += [a for _, a in plan]
        start = end
    out = table.take(pa.array(keep, pa.int64())).select(PURIFIED.names)
    return out.set_column(
        PURIFIED.get_field_index("advantage"), PURIFIED.field("advantage"), pa.array(advantages, pa.float64())
    ), filtered


def recompute_groups(table: pa.Table, backend) -> pa.Table:
    """Log-prob recompute per prompt group (the backend batches one group). Only rows with a token to
    recompute (recompute_from ≥ 0) become domain objects, one prompt group at a time (a bucket holds
    many groups of long rows); the others stay Arrow rows as they are."""
    needs = pc.greater_equal(table["recompute_from"], 0)
    if not pc.any(needs).as_py():
        return table
    todo = table.filter(needs)
    prompts = todo["prompt_id"]
    done = [table.filter(pc.invert(needs))]
    for prompt in dict.fromkeys(prompts.to_pylist()):
        group = [purified_from_row(row) for row in todo.filter(pc.equal(prompts, prompt)).to_pylist()]
        done.append(
            pa.Table.from_pylist(
                [purified_to_row(with_splice_ratios(t)) for t in backend.group(group)], schema=PURIFIED
            )
        )
    return pa.concat_tables(done)  # GroupStage sorts the bucket it stages
