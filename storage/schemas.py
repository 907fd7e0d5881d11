"""Versioned Arrow schemas of every shard kind. Bump the version when a field changes meaning.

The version is stored twice: in the Parquet schema metadata of every part and in the manifest,
so a reader can refuse a file written by an incompatible cleaner before it reads a row.
"""

from __future__ import annotations

from typing import Any

import pyarrow as pa
import pyarrow.compute as pc

from storage.modes import IS_MODES, sql_list

SCHEMA_META_KEY = b"cleaner.schema"

ids = pa.list_(pa.int32())
mask = pa.list_(pa.int8())
logprobs = pa.list_(pa.float32())

TOOL_RESULT = pa.struct(
    [
        ("status", pa.string()),
        ("text", pa.string()),
        ("error_label", pa.string()),
        ("error_class", pa.string()),
        ("exit_code", pa.int32()),
        ("duration_s", pa.float64()),
        ("timed_out", pa.bool_()),
    ]
)

ATTEMPT = pa.struct(
    [
        ("attempt_idx", pa.int32()),
        ("turn_ids", ids),
        ("logprobs", logprobs),
        ("call_start", pa.int32()),
        ("call_status", pa.string()),
        ("context_len", pa.int32()),
        ("context_fingerprint", pa.string()),
        ("code", pa.string()),
        ("result", TOOL_RESULT),
        ("feedback_ids", ids),
        ("finish_reason", pa.string()),
    ]
)

POSITION = pa.struct(
    [
        ("position_idx", pa.int32()),
        ("attempts", pa.list_(ATTEMPT)),
        ("outcome", pa.string()),
    ]
)

STATS = pa.struct(
    [
        (name, pa.int32())
        for name in (
            "turns",
            "tool_calls",
            "first_attempt_failures",
            "model_failures",
            "infra_failures",
            "retries",
            "recovered",
            "exhausted",
            "gave_up",
            "live_shallow",
            "live_deep",
            "response_tokens",
            "generated_tokens",
        )
    ]
)

SPLICE_V1 = pa.struct(
    [
        ("position_idx", pa.int32()),
        ("attempt_idx", pa.int32()),
        ("kind", pa.string()),
        ("similarity", pa.float64()),
        ("tokens_removed", pa.int32()),
        ("first_recomputed", pa.int32()),
        ("split_failed", pa.bool_()),
    ]
)
# v2: the moved retry's importance ratio π(retry | purified context) / π_b(retry | sampled context), as
# log Σ over its `moved_tokens` tokens from `first_recomputed` on (NaN until the log-probs are recomputed)
SPLICE = pa.struct(list(SPLICE_V1) + [("moved_tokens", pa.int32()), ("log_is_ratio", pa.float64())])


def _versioned(name: str, version: int, fields: list[tuple[str, pa.DataType]]) -> pa.Schema:
    return pa.schema(fields, metadata={SCHEMA_META_KEY: f"{name}/{version}".encode()})


# A trajectory's identity, the first columns of every row kind that describes one trajectory.
IDENTITY = [("run_id", pa.string()), ("iteration", pa.int32()), ("prompt_id", pa.string()), ("sample_idx", pa.int32())]
_KEY_SEPARATOR = "/"


# A raw row's key, its identity joined (`run/iteration/prompt/sample`): the `raw_key` of its purified and dead-letter
# rows. One rule in two forms, side by side: per row, and column-wise for whole tables (purifier/unspliced.py).
def row_key(run_id: Any, iteration: Any, prompt_id: Any, sample_idx: Any) -> str:
    return _KEY_SEPARATOR.join(map(str, (run_id, iteration, prompt_id, sample_idx)))


def row_keys(table: pa.Table) -> pa.ChunkedArray:
    """`row_key` of every row of a table holding the IDENTITY columns."""
    return pc.binary_join_element_wise(*(pc.cast(table[name], pa.string()) for name, _ in IDENTITY), _KEY_SEPARATOR)


_RAW_V1_FIELDS = [
    *IDENTITY,
    ("policy_version", pa.string()),
    ("seed", pa.int64()),
    ("task_source", pa.string()),
    ("question", pa.string()),
    ("ground_truth", pa.string()),
    ("saar_gate", pa.bool_()),
    ("gate_p", pa.float64()),
    ("live_mode", pa.string()),
    ("gamma_live", pa.float64()),
    ("max_retries", pa.int32()),
    ("prompt_ids", ids),
    ("lived_ids", ids),
    ("lived_mask", mask),
    ("lived_logprobs", logprobs),
    ("positions", pa.list_(POSITION)),
    ("final_turn", ATTEMPT),
    ("final_answer", pa.string()),
    ("reward", pa.float64()),
    ("finish_reason", pa.string()),
    ("stats", STATS),
]
RAW_V1 = _versioned("raw", 1, _RAW_V1_FIELDS)
# v2: why a reward is not full marks when the scorer says (a code task's first failed test, tests that cannot be
# decoded, output over the limit); "" when it has nothing to say, NULL in rows written before
RAW = _versioned("raw", 2, _RAW_V1_FIELDS + [("reward_reason", pa.string())])

_PURIFIED_V1_FIELDS = [
    *IDENTITY,
    ("mode", pa.string()),
    ("gamma", pa.float64()),
    ("raw_key", pa.string()),
    ("prompt_ids", ids),
    ("response_ids", ids),
    ("loss_mask", mask),
    ("old_logprobs", logprobs),
    ("logprob_valid", mask),
    ("reward", pa.float64()),
    ("advantage", pa.float64()),
    ("splices", pa.list_(SPLICE_V1)),
    ("recompute_from", pa.int32()),
    ("tokens_forwarded", pa.int32()),
    ("gate", pa.bool_()),
]
PURIFIED_V1 = _versioned("purified", 1, _PURIFIED_V1_FIELDS)
# v2 (off-policy-aware purification, docs/saar.md): per response token the log-prob it was sampled with and
# where it was sampled (pipeline.trajectory.TokenOrigin), per splice its importance ratio, and τ of saar_is.
_PURIFIED_V2_FIELDS = [
    (name, pa.list_(SPLICE) if name == "splices" else kind) for name, kind in _PURIFIED_V1_FIELDS
] + [
    ("behaviour_logprobs", logprobs),
    ("token_origin", mask),
    ("is_threshold", pa.float64()),
]
PURIFIED_V2 = _versioned("purified", 2, _PURIFIED_V2_FIELDS)
# v3, the same columns: each threshold in its own column. `gamma` is SAAR's similarity threshold γ of a splicing
# mode's row, 0.0 in every other row; `is_threshold` is the importance-ratio threshold τ of an importance-ratio mode's
# row, NULL in every other row. A v2 row of an importance-ratio mode holds its τ in `gamma` too: `gamma_alone` reads
# it as v3.
PURIFIED = _versioned("purified", 3, _PURIFIED_V2_FIELDS)

DEAD_LETTER = _versioned(
    "dead_letter",
    1,
    [
        ("raw_key", pa.string()),
        ("source_file", pa.string()),
        ("reason", pa.string()),
    ],
)

METRICS = _versioned(
    "metrics",
    1,
    [
        ("run_id", pa.string()),
        ("iteration", pa.int32()),
        ("stage", pa.string()),
        ("step", pa.int32()),
        ("name", pa.string()),
        ("value", pa.float64()),
    ],
)

# Earlier versions readers still accept, by the version they are read as; `upgrade` brings their rows to it.
EARLIER: dict[str, dict[str, pa.Schema]] = {
    "purified/3": {"purified/1": PURIFIED_V1, "purified/2": PURIFIED_V2},
    "raw/2": {"raw/1": RAW_V1},
}


# `gamma` holds γ alone (purified v3): in a row of an importance-ratio mode it is 0.0, its τ in `is_threshold`. The
# one rule that reads rows of any version so, in two forms side by side: column-wise on an Arrow table (`upgrade`,
# storage.shards' readers) and in SQL over rows that carry `mode` and `gamma` (the catalog's purified views, which read
# every version's files together, their summaries and texts too). Both leave v3 rows as they are.
GAMMA_ALONE_SQL = f"CASE WHEN mode IN {sql_list(IS_MODES)} THEN 0.0 ELSE gamma END"


def gamma_alone(table: pa.Table) -> pa.Table:
    """`table` with γ alone in `gamma`, and the τ of its importance-ratio rows in `is_threshold` (taken from `gamma`
    where a row has none there)."""
    if "gamma" not in table.column_names or "mode" not in table.column_names:
        return table
    if "is_threshold" not in table.column_names:
        table = table.append_column("is_threshold", pa.nulls(table.num_rows, pa.float64()))
    ratio_rows = pc.is_in(table["mode"], value_set=pa.array(IS_MODES, pa.string()))
    tau = pc.if_else(ratio_rows, pc.coalesce(table["is_threshold"], table["gamma"]), table["is_threshold"])
    gamma = pc.if_else(ratio_rows, pa.scalar(0.0, pa.float64()), table["gamma"])
    table = table.set_column(table.schema.get_field_index("is_threshold"), "is_threshold", tau)
    return table.set_column(table.schema.get_field_index("gamma"), "gamma", gamma)


def upgrade_inputs(want: pa.Schema) -> list[str]:
    """The columns `upgrade` reads to give `want`'s (a reader of some columns reads these from an earlier version)."""
    return list(dict.fromkeys([*want.names, *(["mode", "is_threshold"] if "gamma" in want.names else [])]))


def readable_as(found: str, want: pa.Schema) -> pa.Schema | None:
    """The schema a part of version `found` was written with, if it can be read as `want` (else None)."""
    if found == schema_id(want):
        return want
    return EARLIER.get(schema_id(want), {}).get(found)


def upgrade(table: pa.Table, want: pa.Schema) -> pa.Table:
    """Rows of an earlier version as `want`'s: columns it lacks are null (a v1 purified row has no behaviour
    log-probs: what needs them says so), nested structs gain their new fields as nulls, and `gamma` holds γ alone
    (`gamma_alone`). `table` may hold more columns than `want` (`upgrade_inputs`): they are read, not kept."""
    table = gamma_alone(table)
    columns = []
    for field in want:
        if field.name not in table.column_names:
            columns.append(pa.nulls(table.num_rows, field.type))
        elif not table.schema.field(field.name).type.equals(field.type):
            columns.append(_widen(table[field.name], field.type))
        else:
            columns.append(table[field.name])
    return pa.table(columns, schema=want)


def _widen(column: pa.ChunkedArray, kind: pa.DataType) -> pa.ChunkedArray:
    # list<struct> with fewer fields -> list<struct> with more: rebuild the structs with null new fields
    chunks = []
    for chunk in column.chunks:
        values = chunk.flatten()
        fields = [
            values.field(f.name) if values.type.get_field_index(f.name) >= 0 else pa.nulls(len(values), f.type)
            for f in kind.value_type
        ]
        structs = pa.StructArray.from_arrays(fields, fields=list(kind.value_type))
        chunks.append(pa.ListArray.from_arrays(chunk.offsets, structs, type=kind, mask=chunk.is_null()))
    return pa.chunked_array(chunks, type=kind)


def schema_id(schema: pa.Schema) -> str:
    return schema.metadata[SCHEMA_META_KEY].decode()
