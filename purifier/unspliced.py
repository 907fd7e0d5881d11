"""Raw rows with nothing to splice, purified as whole Arrow columns: the column-wise twin of purifier/saar.py's
`purify()` for them, built from the same declarations (saar.py's validation rules, UNSPLICED_ROW below).

A raw row in which every position has exactly one attempt gives SAAR nothing to splice: in `saar`
and in `raw` mode its purified sequence is the lived sequence, and every token was sampled in the
context it has there, so every old log-prob stands (tests/test_unspliced.py checks this row for row
against `purify()` on real rollouts). The same holds for `saar_correct` (saar or raw, both the lived
sequence here), `saar_is` (no rollback to decide), `roc` (the raw sequence; its selection is per group, later)
and `mask_failed` (it masks only rows with a recovered failure, which have a retry; tests/test_new_modes.py
checks these). That is about two thirds of an iteration's rows; building them column-wise skips the Python
objects per row that dominate the stage's time. A row that breaks any rule `validate_raw` checks stays on the
`purify()` path, whose dead letter names the reason.
"""

from __future__ import annotations

import math

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from pipeline.modes import Mode, Variant
from purifier.saar import (
    ATTEMPT_RULES,
    POSITION_RULES,
    ROW_RULES,
    PositionFacts,
    all_hold,
    attempt_facts_columns,
    row_facts_columns,
)
from storage.schemas import PURIFIED, SPLICE, row_keys

__all__ = ["UNSPLICED_MODES", "UNSPLICED_ROW", "purified_table", "row_keys", "unspliced_mask"]

UNSPLICED_MODES = ("saar", "raw", "saar_correct", "mask_failed", "roc", "saar_is")

# The purified row of a raw row with nothing to splice, field by field, for the fields a raw column gives: the lived
# sequence as it is, every token sampled in place (its mask: 1 = sampled where it stands, as the loss mask says).
# `purified_table` is built from it; tests/test_unspliced.py holds purify() to it row for row. The other fields:
# raw_key (storage.schemas.row_keys), mode and the thresholds (the variant's), and what no row has yet (advantage
# NaN, no splices, nothing to recompute or forwarded).
UNSPLICED_ROW: tuple[tuple[str, str], ...] = (
    ("run_id", "run_id"),
    ("iteration", "iteration"),
    ("prompt_id", "prompt_id"),
    ("sample_idx", "sample_idx"),
    ("prompt_ids", "prompt_ids"),
    ("response_ids", "lived_ids"),
    ("loss_mask", "lived_mask"),
    ("old_logprobs", "lived_logprobs"),
    ("reward", "reward"),
    ("gate", "saar_gate"),
    ("behaviour_logprobs", "lived_logprobs"),
    ("token_origin", "lived_mask"),  # TokenOrigin.IN_PLACE = 1
)


def _any_per_row(flags: np.ndarray, row_of: np.ndarray, n: int) -> np.ndarray:
    out = np.zeros(n, dtype=bool)
    out[row_of[flags]] = True
    return out


def _lengths(lists: pa.Array) -> np.ndarray:
    return pc.list_value_length(lists).fill_null(-1).to_numpy()


def unspliced_mask(table: pa.Table) -> np.ndarray:
    """True for rows with one attempt per position and a complete lived sequence that keep every rule purify()
    checks (purifier.saar's ROW_RULES, POSITION_RULES, ATTEMPT_RULES, evaluated column-wise)."""
    n = table.num_rows
    if n == 0:
        return np.zeros(0, dtype=bool)
    ok = (_lengths(table["lived_ids"].combine_chunks()) >= 0) & all_hold(ROW_RULES, row_facts_columns(table))
    positions = table["positions"].combine_chunks()
    ok &= positions.is_valid().to_numpy(zero_copy_only=False)
    pos_row = pc.list_parent_indices(positions).to_numpy()
    pos = pc.list_flatten(positions)
    attempts = pos.field("attempts")
    per_position = _lengths(attempts)
    ok &= ~_any_per_row((per_position != 1) | ~all_hold(POSITION_RULES, PositionFacts(per_position)), pos_row, n)
    att_pos = pc.list_parent_indices(attempts).to_numpy()
    outcome = pos.field("outcome").fill_null("").to_numpy(zero_copy_only=False)[att_pos]
    facts = attempt_facts_columns(pc.list_flatten(attempts), outcome)
    ok &= ~_any_per_row(~all_hold(ATTEMPT_RULES, facts), pos_row[att_pos], n)
    return ok


def purified_table(raw: pa.Table, mode: Mode, threshold: float) -> pa.Table:
    """The purified rows (PURIFIED schema, advantage not yet set) of rows `unspliced_mask` accepted, as the variant
    of `mode` at `threshold` (its γ, or its τ for an importance-ratio mode) writes them."""
    if mode not in UNSPLICED_MODES:
        raise ValueError(f"mode {mode!r} needs purify() (only {UNSPLICED_MODES} are the lived sequence as is)")
    variant = Variant.of(mode, threshold)
    n = raw.num_rows
    lived = raw["lived_ids"].combine_chunks()
    ones = pa.ListArray.from_arrays(
        pa.array(np.concatenate([[0], np.cumsum(_lengths(lived))]), pa.int32()),
        pa.array(np.ones(len(pc.list_flatten(lived)), dtype=np.int8)),
    )
    columns = {field: raw[column] for field, column in UNSPLICED_ROW}
    columns.update(
        {
            "mode": pa.array([mode] * n, pa.string()),
            "gamma": pa.array(np.full(n, variant.gamma)),
            "raw_key": row_keys(raw),
            "logprob_valid": ones,
            "advantage": pa.array(np.full(n, math.nan)),
            "splices": pa.array([[]] * n, pa.list_(SPLICE)),
            "recompute_from": pa.array(np.full(n, -1, dtype=np.int32)),
            "tokens_forwarded": pa.array(np.zeros(n, dtype=np.int32)),
            "is_threshold": pa.nulls(n, pa.float64()) if variant.tau is None else pa.array(np.full(n, variant.tau)),
        }
    )
    return pa.table([columns[f.name] for f in PURIFIED], schema=PURIFIED)
