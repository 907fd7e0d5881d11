"""Per-row summaries of raw and purified shards, written beside their parts at commit: what the default
`cleaner inspect` tables and the report need (counts, rewards, statistics, lengths, splices), a few dozen
bytes per trajectory instead of its token lists, so those tables cost the same at iteration 2,000 as at 20.

A summary is one Parquet file per part (`summary-NNNNN.parquet`), computed column-wise from the part's
Arrow table, written before the manifest and listed in it (`Manifest.extra["summaries"]`: name, rows,
crc32), so a committed shard's summaries are as trustworthy as its parts. Shards committed without them
(by an earlier cleaner) are summarised by the catalog from their parts, in SQL (storage/catalog.py).
"""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from storage.schemas import IDENTITY, RAW, SCHEMA_META_KEY, _versioned

RAW_SUMMARY = _versioned(
    "raw_summary",
    1,
    [
        *IDENTITY,
        ("reward", pa.float64()),
        ("stats", RAW.field("stats").type),
        ("response_tokens", pa.int64()),  # len(lived_ids)
        ("failed_attempt_tokens", pa.int64()),  # turn + feedback tokens of every attempt whose tool call failed
    ],
)
PURIFIED_SUMMARY = _versioned(
    "purified_summary",
    1,
    [
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
    ],
)


def _lengths(column: pa.ChunkedArray | pa.Array) -> pa.Array:
    return pc.cast(pc.fill_null(pc.list_value_length(column), 0), pa.int64())


def list_values(column: pa.ChunkedArray | pa.Array) -> tuple[pa.Array, np.ndarray]:
    """A list column's values, and the row of each."""
    arr = column.combine_chunks() if isinstance(column, pa.ChunkedArray) else column
    return pc.list_flatten(arr), pc.list_parent_indices(arr).to_numpy()


def _per_row(rows: int, row: np.ndarray, weights: np.ndarray | None = None) -> pa.Array:
    """Σ of the weights (without: the count) of the values of each of `rows` rows, `row` naming each one's row."""
    return pa.array(np.bincount(row, weights=weights, minlength=rows).astype(np.int64))


def raw_summary(table: pa.Table) -> pa.Table:
    positions, pos_row = list_values(table["positions"])
    attempts, att_pos = list_values(positions.field("attempts"))
    failed = pc.fill_null(pc.equal(attempts.field("result").field("status"), "failure"), False).to_numpy(
        zero_copy_only=False
    )
    tokens = _lengths(attempts.field("turn_ids")).to_numpy() + _lengths(attempts.field("feedback_ids")).to_numpy()
    return pa.table(
        [
            *(table[name] for name, _ in IDENTITY),
            table["reward"],
            table["stats"],
            _lengths(table["lived_ids"]),
            _per_row(table.num_rows, pos_row[att_pos][failed], tokens[failed]),
        ],
        schema=RAW_SUMMARY,
    )


def purified_summary(table: pa.Table) -> pa.Table:
    n = table.num_rows
    splices, row = list_values(table["splices"])
    kind = splices.field("kind").to_numpy(zero_copy_only=False)
    mask, mask_row = list_values(table["loss_mask"])
    return pa.table(
        [
            *(table[name] for name, _ in IDENTITY),
            table["mode"],
            table["gamma"],
            table["reward"],
            table["advantage"],
            _lengths(table["response_ids"]),
            _per_row(n, mask_row, mask.to_numpy(zero_copy_only=False)),
            _per_row(n, row),
            _per_row(n, row[kind == "shallow"]),
            _per_row(n, row[kind == "deep"]),
            _per_row(n, row, pc.fill_null(splices.field("tokens_removed"), 0).to_numpy()),
            table["tokens_forwarded"],
        ],
        schema=PURIFIED_SUMMARY,
    )


SUMMARIZERS = {b"raw": raw_summary, b"purified": purified_summary}


def summarizer(schema: pa.Schema):
    """The summary function of a shard schema (None: its shards carry no summary)."""
    name = schema.metadata[SCHEMA_META_KEY].split(b"/")[0]
    return SUMMARIZERS.get(name)
