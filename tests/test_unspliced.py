"""The column-wise path for rows with nothing to splice equals purify() row for row on real rollouts,
and every row purify() would refuse stays off it."""

from __future__ import annotations

import math

import numpy as np
import pyarrow as pa
import pytest

from pipeline.config import DEFAULT_POLICY
from pipeline.trajectory import purified_to_row, trajectory_from_row
from purifier.saar import PurifyError, purify
from purifier.unspliced import purified_table, unspliced_mask
from pipeline.chat import load_chat
from storage.layout import RunLayout
from storage.schemas import PURIFIED, RAW
from storage.shards import read_shard


@pytest.fixture(scope="module")
def raw(world_rollout) -> pa.Table:
    return read_shard(RunLayout(world_rollout.storage.root, "w").raw_dir(0), RAW)


def _same(a: dict, b: dict) -> bool:
    return all(a[k] == b[k] or (isinstance(a[k], float) and math.isnan(a[k]) and math.isnan(b[k])) for k in a)


@pytest.mark.parametrize("mode,gamma", [("saar", 0.5), ("saar", 0.9), ("raw", 0.5)])
def test_unspliced_rows_equal_purify(raw, mode, gamma):
    decode = load_chat(DEFAULT_POLICY).decode
    mask = unspliced_mask(raw)
    rows = raw.to_pylist()
    with_retries = [any(len(p["attempts"]) > 1 for p in r["positions"]) for r in rows]
    assert list(mask) == [not w for w in with_retries]  # real rows are all well-formed: only retries decide
    assert 0 < mask.sum() < len(rows)
    fast = purified_table(raw.filter(pa.array(mask)), mode, gamma)
    assert fast.schema == PURIFIED
    slow = [purified_to_row(purify(trajectory_from_row(r), gamma, mode, decode)) for r, m in zip(rows, mask) if m]
    assert len(slow) == fast.num_rows
    assert all(_same(a, b) for a, b in zip(fast.to_pylist(), slow))


def _broken(raw: pa.Table, row: int, edit) -> pa.Table:
    rows = raw.to_pylist()
    edit(rows[row])
    return pa.Table.from_pylist(rows, schema=RAW)


def _first_attempt(r):
    return r["positions"][0]["attempts"][0]


BREAKS = {
    "call_start out of range": lambda r: _first_attempt(r).update(call_start=10_000),
    "logprobs length": lambda r: _first_attempt(r).update(logprobs=_first_attempt(r)["logprobs"][:-1]),
    "missing fingerprint": lambda r: _first_attempt(r).update(context_fingerprint=None),
    "call without result": lambda r: _first_attempt(r).update(result=None, call_status="ok"),
    "no attempts": lambda r: r["positions"][0].update(attempts=[]),
}


@pytest.mark.parametrize("what", sorted(BREAKS))
def test_rows_purify_would_refuse_stay_off_the_columnar_path(raw, what):
    decode = load_chat(DEFAULT_POLICY).decode
    row = next(i for i, m in enumerate(unspliced_mask(raw)) if m and raw["positions"][i].as_py())
    broken = _broken(raw, row, BREAKS[what])
    assert not unspliced_mask(broken)[row]
    assert unspliced_mask(broken).sum() == unspliced_mask(raw).sum() - 1
    with pytest.raises(PurifyError):
        purify(trajectory_from_row(broken.slice(row, 1).to_pylist()[0]), 0.5, "saar", decode)


def test_incomplete_lived_sequence_stays_off(raw):
    row = int(np.flatnonzero(unspliced_mask(raw))[0])
    broken = _broken(raw, row, lambda r: r.update(lived_mask=r["lived_mask"][:-1]))
    assert not unspliced_mask(broken)[row]
    assert not unspliced_mask(_broken(raw, row, lambda r: r.update(lived_ids=None)))[row]


def test_void_turn_needs_purify(raw):
    with pytest.raises(ValueError, match="needs purify"):
        purified_table(raw, "void_turn", 0.5)
