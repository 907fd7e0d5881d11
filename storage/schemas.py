"""Versioned Arrow schemas of every shard kind. Bump the version when a field changes meaning.

The version is stored twice: in the Parquet schema metadata of every part and in the manifest,
so a reader can refuse a file written by an incompatible cleaner before it reads a row.
"""
from __future__ import annotations

import pyarrow as pa

SCHEMA_META_KEY = b"cleaner.schema"

ids = pa.list_(pa.int32())
mask = pa.list_(pa.int8())
logprobs = pa.list_(pa.float32())

TOOL_RESULT = pa.struct([
    ("status", pa.string()),
    ("text", pa.string()),
    ("error_label", pa.string()),
    ("error_class", pa.string()),
    ("exit_code", pa.int32()),
    ("duration_s", pa.float64()),
    ("timed_out", pa.bool_()),
])

ATTEMPT = pa.struct([
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
])

POSITION = pa.struct([
    ("position_idx", pa.int32()),
    ("attempts", pa.list_(ATTEMPT)),
    ("outcome", pa.string()),
])

STATS = pa.struct([(name, pa.int32()) for name in (
    "turns", "tool_calls", "first_attempt_failures", "model_failures", "infra_failures", "retries",
    "recovered", "exhausted", "gave_up", "live_shallow", "live_deep", "response_tokens",
    "generated_tokens",
)])

SPLICE_V1 = pa.struct([
    ("position_idx", pa.int32()),
    ("attempt_idx", pa.int32()),
    ("kind", pa.string()),
    ("similarity", pa.float64()),
    ("tokens_removed", pa.int32()),
    ("first_recomputed", pa.int32()),
    ("split_failed", pa.bool_()),
])
# v2: the moved retry's importance ratio π(retry | purified context) / π_b(retry | sampled context), as
# log Σ over its `moved_tokens` tokens from `first_recomputed` on (NaN until the log-probs are recomputed)
SPLICE = pa.struct(list(SPLICE_V1) + [("moved_tokens", pa.int32()), ("log_is_ratio", pa.float64())])


def _versioned(name: str, version: int, fields: list[tuple[str, pa.DataType]]) -> pa.Schema:
    return pa.schema(fields, metadata={SCHEMA_META_KEY: f"{name}/{version}".encode()})


# A trajectory's identity, the first columns of every row kind that describes one trajectory.
IDENTITY = [("run_id", pa.string()), ("iteration", pa.int32()), ("prompt_id", pa.string()), ("sample_idx", pa.int32())]

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
PURIFIED = _versioned("purified", 2, [
    (name, pa.list_(SPLICE) if name == "splices" else kind) for name, kind in _PURIFIED_V1_FIELDS
] + [
    ("behaviour_logprobs", logprobs),
    ("token_origin", mask),
    ("is_threshold", pa.float64()),
])

DEAD_LETTER = _versioned("dead_letter", 1, [
    ("raw_key", pa.string()),
    ("source_file", pa.string()),
    ("reason", pa.string()),
])

METRICS = _versioned("metrics", 1, [
    ("run_id", pa.string()),
    ("iteration", pa.int32()),
    ("stage", pa.string()),
    ("step", pa.int32()),
    ("name", pa.string()),
    ("value", pa.float64()),
])

# Earlier versions readers still accept, by the version they are read as; `upgrade` brings their rows to it.
EARLIER: dict[str, dict[str, pa.Schema]] = {"purified/2": {"purified/1": PURIFIED_V1}, "raw/2": {"raw/1": RAW_V1}}


def readable_as(found: str, want: pa.Schema) -> pa.Schema | None:
    """The schema a part of version `found` was written with, if it can be read as `want` (else None)."""
    if found == schema_id(want):
        return want
    return EARLIER.get(schema_id(want), {}).get(found)


def upgrade(table: pa.Table, want: pa.Schema) -> pa.Table:
    """Rows of an earlier version as `want`'s: columns it lacks are null (a v1 purified row has no behaviour
    log-probs: what needs them says so), nested structs gain their new fields as nulls."""
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
        fields = [values.field(f.name) if values.type.get_field_index(f.name) >= 0 else pa.nulls(len(values), f.type)
                  for f in kind.value_type]
        structs = pa.StructArray.from_arrays(fields, fields=list(kind.value_type))
        chunks.append(pa.ListArray.from_arrays(chunk.offsets, structs, type=kind, mask=chunk.is_null()))
    return pa.chunked_array(chunks, type=kind)


def schema_id(schema: pa.Schema) -> str:
    return schema.metadata[SCHEMA_META_KEY].decode()
