"""Decoded text of raw and purified shards, written beside their parts at commit, so SQL users read
trajectories as text without knowing which tokenizer a run used.

One Parquet file per part (`text-NNNNN.parquet`), like the row summaries (storage/summaries.py): decoded
column-wise from the part's Arrow table with the run's own tokenizer, written before the manifest and listed in
it (`Manifest.extra["texts"]`: name, rows, crc32), so a committed shard's text is as trustworthy as its parts,
and the shard schema keeps its version (readers of the parts never see a new column).

Why at commit, beside the shard, and not another way (benchmarks/bench_viewer.py measures it): the Rust
tokenizer decodes a 64 × 8,192-token raw shard (lived sequence and every attempt) in a fraction of a second,
which a rollout or purification stage of that size does not notice, and the text costs a fraction of the
token ids' bytes on disk (zstd); decoding at query time instead would need a Python UDF the duckdb CLI does
not have, or a vocabulary join in SQL that breaks on a byte-level token cut inside a UTF-8 character.

The tokenizer is the one the shard's manifest records as its input, never a guess: a raw shard's input is
the checkpoint that sampled it, a purified shard's is the raw shard's manifest (whose input is that
checkpoint). A shard whose recorded checkpoint has no `tokenizer.json` (a synthetic store, a checkpoint
removed before the commit) is committed without text, and the text views have no rows for it.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Callable

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from storage.layout import resolve_recorded
from storage.schemas import IDENTITY, SCHEMA_META_KEY, _versioned
from storage.summaries import list_values

ATTEMPT_TEXT = pa.struct(
    [
        ("position_idx", pa.int32()),
        ("attempt_idx", pa.int32()),
        ("turn_text", pa.string()),  # the attempt's turn_ids decoded (the whole sampled turn, stop token included)
        ("feedback_text", pa.string()),  # its feedback_ids decoded (the tool-response turn the model was shown)
    ]
)
RAW_TEXT = _versioned(
    "raw_text",
    1,
    [
        *IDENTITY,
        ("response_text", pa.string()),  # lived_ids decoded: the response as the model lived it
        ("final_text", pa.string()),  # final_turn's turn_ids decoded (NULL without a final turn)
        ("attempts", pa.list_(ATTEMPT_TEXT)),
    ],
)
PURIFIED_TEXT = _versioned(
    "purified_text",
    1,
    [
        *IDENTITY,
        ("mode", pa.string()),
        ("gamma", pa.float64()),
        ("response_text", pa.string()),  # response_ids decoded: the sequence this partition trains
    ],
)
TOKENIZER_FILE = "tokenizer.json"

Decode = Callable[[list[list[int]]], list[str]]  # many id lists -> their texts, in order
_DECODERS: dict[tuple[str, int, int], Decode] = {}  # tokenizer.json path, mtime, size -> decoder (one per process)


def load_decoder(tokenizer_json: Path) -> Decode:
    """The tokenizer's batch decode (the Rust `tokenizers` library alone, special tokens kept: exactly what
    `pipeline.chat.ChatFormat.decode` returns), loaded once per process and file version."""
    st = os.stat(tokenizer_json)
    key = (str(tokenizer_json), st.st_mtime_ns, st.st_size)
    decode = _DECODERS.get(key)
    if decode is None:
        from tokenizers import Tokenizer

        tok = Tokenizer.from_file(str(tokenizer_json))
        decode = _DECODERS[key] = lambda batch: tok.decode_batch(batch, skip_special_tokens=False)
    return decode


def store_root(directory: Path) -> Path | None:
    """The storage root a shard folder lies in (root/runs/<run>/iteration=N/...), or None elsewhere."""
    directory = Path(directory).resolve()
    for p in (directory, *directory.parents):
        if p.name.startswith("iteration=") and p.parent.parent.name == "runs":
            return p.parent.parent.parent
    return None


def checkpoint_of(root: Path, inputs: list[str]) -> Path | None:
    """The checkpoint a shard's recorded inputs name: a raw shard's first input, or, for a purified shard whose
    first input is a raw manifest, that manifest's first input. None when nothing is recorded."""
    if not inputs:
        return None
    first = resolve_recorded(root, inputs[0])
    if first.name == "_MANIFEST.json":  # a purified shard: the raw shard's manifest
        try:
            raw_inputs = json.loads(first.read_text()).get("inputs") or []
        except (OSError, ValueError, AttributeError):
            return None
        return resolve_recorded(root, raw_inputs[0]) if raw_inputs else None
    return first


def _texts(decode: Decode, column: pa.Array) -> pa.Array:
    """Each row's id list decoded (NULL where the list is NULL)."""
    lists = column.to_pylist()
    decoded = iter(decode([ids for ids in lists if ids is not None]))
    return pa.array([None if ids is None else next(decoded) for ids in lists], pa.string())


def raw_texts(table: pa.Table, decode: Decode) -> pa.Table:
    positions, pos_row = list_values(table["positions"])
    attempts, att_pos = list_values(positions.field("attempts"))
    # each row's attempts, over all its positions, in order: offsets from the number of attempts per row
    offsets = np.concatenate([[0], np.cumsum(np.bincount(pos_row[att_pos], minlength=table.num_rows))])
    structs = pa.StructArray.from_arrays(
        [
            pc.take(positions.field("position_idx"), att_pos),
            attempts.field("attempt_idx"),
            _texts(decode, attempts.field("turn_ids")),
            _texts(decode, attempts.field("feedback_ids")),
        ],
        fields=list(ATTEMPT_TEXT),
    )
    return pa.table(
        [
            *(table[name] for name, _ in IDENTITY),
            _texts(decode, table["lived_ids"].combine_chunks()),
            _texts(decode, pc.struct_field(table["final_turn"].combine_chunks(), "turn_ids")),
            pa.ListArray.from_arrays(pa.array(offsets, pa.int32()), structs, type=pa.list_(ATTEMPT_TEXT)),
        ],
        schema=RAW_TEXT,
    )


def purified_texts(table: pa.Table, decode: Decode) -> pa.Table:
    return pa.table(
        [
            *(table[name] for name, _ in IDENTITY),
            table["mode"],
            table["gamma"],
            _texts(decode, table["response_ids"].combine_chunks()),
        ],
        schema=PURIFIED_TEXT,
    )


TEXTERS = {b"raw": raw_texts, b"purified": purified_texts}


def texter(schema: pa.Schema, directory: Path, inputs: list[str]) -> Callable[[pa.Table], pa.Table] | None:
    """The function that decodes a part of this shard to its text table, or None: a schema without text (dead
    letters, metrics) or a shard whose recorded checkpoint (`checkpoint_of`) has no tokenizer.json."""
    kind = TEXTERS.get(schema.metadata[SCHEMA_META_KEY].split(b"/")[0])
    root = store_root(directory) if kind is not None else None
    checkpoint = checkpoint_of(root, inputs) if root is not None else None
    if checkpoint is None or not (checkpoint / TOKENIZER_FILE).is_file():
        return None
    decode = load_decoder(checkpoint / TOKENIZER_FILE)
    return lambda part: kind(part, decode)
