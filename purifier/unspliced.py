"""Raw rows with nothing to splice, purified as whole Arrow columns.

A raw row in which every position has exactly one attempt gives SAAR nothing to splice: in `saar`
and in `raw` mode its purified sequence is the lived sequence, and every token was sampled in the
context it has there, so every old log-prob stands (tests/test_unspliced.py checks this row for row
against `purify()` on real rollouts). The same holds for `saar_correct` (saar or raw, both the lived
sequence here), `saar_is` (no rollback to decide), `roc` (the raw sequence; its selection is per group, later) and `mask_failed` (it
masks only rows with a recovered failure, which have a retry; tests/test_new_modes.py checks these).
That is about two thirds of an iteration's rows; building them column-wise skips the Python objects per row that dominate the stage's time. A row that fails
any structural check `validate_raw` makes stays on the `purify()` path, whose dead letter names
the reason.
"""
from __future__ import annotations

import math

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from pipeline.modes import IS_MODES, partition_gamma
from storage.schemas import PURIFIED, SPLICE

UNSPLICED_MODES = ("saar", "raw", "saar_correct", "mask_failed", "roc", "saar_is")


def _any_per_row(flags: np.ndarray, row_of: np.ndarray, n: int) -> np.ndarray:
    out = np.zeros(n, dtype=bool)
    out[row_of[flags]] = True
    return out


def _lengths(lists: pa.Array) -> np.ndarray:
    return pc.list_value_length(lists).fill_null(-1).to_numpy()


def _bad_attempts(att: pa.StructArray, outcome: np.ndarray) -> np.ndarray:
    """validate_raw's per-attempt checks, vectorised: True where purify() would refuse the attempt."""
    turn = _lengths(att.field("turn_ids"))
    call_start = att.field("call_start").fill_null(-2).to_numpy()
    has_call = pc.not_equal(att.field("call_status"), "no_call").fill_null(True).to_numpy(zero_copy_only=False)
    bad = (turn < 0) | (_lengths(att.field("logprobs")) != turn)
    bad |= ~((call_start == -1) | ((call_start >= 0) & (call_start < turn)))
    bad |= att.field("context_len").is_null().to_numpy(zero_copy_only=False)
    bad |= att.field("context_fingerprint").is_null().to_numpy(zero_copy_only=False)
    bad |= has_call & att.field("result").is_null().to_numpy(zero_copy_only=False) & (outcome != "truncated")
    return bad


def unspliced_mask(table: pa.Table) -> np.ndarray:
    """True for rows with one attempt per position, a complete lived sequence, and valid attempts."""
    n = table.num_rows
    if n == 0:
        return np.zeros(0, dtype=bool)
    lived = _lengths(table["lived_ids"].combine_chunks())
    ok = (lived >= 0) & (_lengths(table["lived_mask"].combine_chunks()) == lived)
    ok &= _lengths(table["lived_logprobs"].combine_chunks()) == lived
    positions = table["positions"].combine_chunks()
    ok &= positions.is_valid().to_numpy(zero_copy_only=False)
    pos_row = pc.list_parent_indices(positions).to_numpy()
    pos = pc.list_flatten(positions)
    attempts = pos.field("attempts")
    ok &= ~_any_per_row(_lengths(attempts) != 1, pos_row, n)
    att_pos = pc.list_parent_indices(attempts).to_numpy()
    outcome = pos.field("outcome").fill_null("").to_numpy(zero_copy_only=False)[att_pos]
    ok &= ~_any_per_row(_bad_attempts(pc.list_flatten(attempts), outcome), pos_row[att_pos], n)
    return ok


def row_keys(raw: pa.Table) -> pa.ChunkedArray:
    """pipeline.trajectory.row_key of every raw row, column-wise."""
    return pc.binary_join_element_wise(raw["run_id"], pc.cast(raw["iteration"], pa.string()), raw["prompt_id"],
                                       pc.cast(raw["sample_idx"], pa.string()), "/")


def purified_table(raw: pa.Table, mode: str, gamma: float) -> pa.Table:
    """The purified rows (PURIFIED schema, advantage not yet set) of rows `unspliced_mask` accepted."""
    if mode not in UNSPLICED_MODES:
        raise ValueError(f"mode {mode!r} needs purify() (only {UNSPLICED_MODES} are the lived sequence as is)")
    n = raw.num_rows
    lived = raw["lived_ids"].combine_chunks()
    ones = pa.ListArray.from_arrays(pa.array(np.concatenate([[0], np.cumsum(_lengths(lived))]), pa.int32()),
                                    pa.array(np.ones(len(pc.list_flatten(lived)), dtype=np.int8)))
    flat_mask = pc.list_flatten(raw["lived_mask"].combine_chunks())
    origin = pa.ListArray.from_arrays(ones.offsets, pc.cast(flat_mask, pa.int8()))  # mask 1: sampled in place
    columns = {
        "run_id": raw["run_id"], "iteration": raw["iteration"], "prompt_id": raw["prompt_id"],
        "sample_idx": raw["sample_idx"], "mode": pa.array([mode] * n, pa.string()),
        "gamma": pa.array(np.full(n, partition_gamma(mode, gamma))), "raw_key": row_keys(raw),
        "prompt_ids": raw["prompt_ids"], "response_ids": lived, "loss_mask": raw["lived_mask"],
        "old_logprobs": raw["lived_logprobs"], "logprob_valid": ones, "reward": raw["reward"],
        "advantage": pa.array(np.full(n, math.nan)), "splices": pa.array([[]] * n, pa.list_(SPLICE)),
        "recompute_from": pa.array(np.full(n, -1, dtype=np.int32)),
        "tokens_forwarded": pa.array(np.zeros(n, dtype=np.int32)), "gate": raw["saar_gate"],
        "behaviour_logprobs": raw["lived_logprobs"], "token_origin": origin,
        "is_threshold": pa.array(np.full(n, float(gamma))) if mode in IS_MODES else pa.nulls(n, pa.float64()),
    }
    return pa.table([columns[f.name] for f in PURIFIED], schema=PURIFIED)
