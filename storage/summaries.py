"""Per-row summaries of raw and purified shards, written beside their parts at commit: what the default
`cleaner inspect` tables and the report need (counts, rewards, statistics, lengths, splices), a few dozen
bytes per trajectory instead of its token lists, so those tables cost the same at iteration 2,000 as at 20.

A summary is one Parquet file per part (`part-NNNNN.summary.parquet`), computed column-wise from the part's
Arrow table, written before the manifest and listed in it (`Manifest.extra["summaries"]`: name, rows,
crc32), so a committed shard's summaries are as trustworthy as its parts. Shards committed without them
(by an earlier cleaner) are summarised by the catalog from their parts, in SQL (storage/catalog.py).
"""
from __future__ import annotations

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from storage.schemas import IDENTITY, RAW, SCHEMA_META_KEY, _versioned

RAW_SUMMARY = _versioned("raw_summary", 1, [
    *IDENTITY,
    ("reward", pa.float64()),
    ("stats", RAW.field("stats").type),
    ("response_tokens", pa.int64()),  # len(lived_ids)
    ("failed_attempt_tokens", pa.int64()),  # turn + feedback tokens of every attempt whose tool call failed
])
PURIFIED_SUMMARY = _versioned("purified_summary", 1, [
    *IDENTITY,
    ("mode", pa.string()),
    ("gamma", pa.float64()),
    ("reward", pa.float64()),
    ("advantage", pa.float64()),
    ("response_tokens", pa.int64()),
    ("trained_tokens", pa.int64()),
    ("splices", pa.int64()),
    ("shallow", pa.int64()),
    ("deep", pa.int64()),
    ("tokens_removed", pa.int64()),
    ("tokens_forwarded", pa.int32()),
])


def _lengths(column: pa.ChunkedArray | pa.Array) -> pa.Array:
    return pc.cast(pc.fill_null(pc.list_value_length(column), 0), pa.int64())


def _sum_lists(column: pa.ChunkedArray | pa.Array, rows: int) -> np.ndarray:
    """Σ of each row's list (int8/int32 lists): one pass over the flattened values."""
    arr = column.combine_chunks() if isinstance(column, pa.ChunkedArray) else column
    values = pc.list_flatten(arr).to_numpy(zero_copy_only=False).astype(np.int64)
    parents = pc.list_parent_indices(arr).to_numpy()
    return np.bincount(parents, weights=values, minlength=rows).astype(np.int64)


def raw_summary(table: pa.Table) -> pa.Table:
    n = table.num_rows
    positions = table["positions"].combine_chunks()
    pos_row = pc.list_parent_indices(positions).to_numpy()
    attempts = pc.list_flatten(positions).field("attempts")
    att_row = pos_row[pc.list_parent_indices(attempts).to_numpy()]
    flat = pc.list_flatten(attempts)
    failed = pc.fill_null(pc.equal(flat.field("result").field("status"), "failure"), False).to_numpy(zero_copy_only=False)
    tokens = (_lengths(flat.field("turn_ids")).to_numpy() + _lengths(flat.field("feedback_ids")).to_numpy())
    failed_tokens = np.bincount(att_row[failed], weights=tokens[failed], minlength=n).astype(np.int64)
    return pa.table([table["run_id"], table["iteration"], table["prompt_id"], table["sample_idx"], table["reward"],
                     table["stats"], _lengths(table["lived_ids"]), pa.array(failed_tokens)], schema=RAW_SUMMARY)


def purified_summary(table: pa.Table) -> pa.Table:
    n = table.num_rows
    splices = table["splices"].combine_chunks()
    flat = pc.list_flatten(splices)
    parent = pc.list_parent_indices(splices).to_numpy()
    kind = flat.field("kind").to_numpy(zero_copy_only=False) if len(flat) else np.array([], dtype=object)
    removed = pc.fill_null(flat.field("tokens_removed"), 0).to_numpy() if len(flat) else np.array([], dtype=np.int64)

    def count(mask: np.ndarray, weights: np.ndarray | None = None) -> pa.Array:
        w = None if weights is None else weights[mask]
        return pa.array(np.bincount(parent[mask], weights=w, minlength=n).astype(np.int64))

    every = np.ones(len(parent), dtype=bool)
    return pa.table([table["run_id"], table["iteration"], table["prompt_id"], table["sample_idx"], table["mode"],
                     table["gamma"], table["reward"], table["advantage"], _lengths(table["response_ids"]),
                     pa.array(_sum_lists(table["loss_mask"], n)), count(every), count(kind == "shallow"),
                     count(kind == "deep"), count(every, removed.astype(np.float64)), table["tokens_forwarded"]],
                    schema=PURIFIED_SUMMARY)


SUMMARIZERS = {b"raw": raw_summary, b"purified": purified_summary}


def summarizer(schema: pa.Schema):
    """The summary function of a shard schema (None: its shards carry no summary)."""
    name = schema.metadata[SCHEMA_META_KEY].split(b"/")[0]
    return SUMMARIZERS.get(name)
