"""Each rule has one owner: the mode vocabulary on the floor storage reads it from, the importance-ratio rule beside
SAAR's γ rule in pipeline/splice.py, and the raw-row rules, the unspliced purified row and the row key each declared
once, with the column-wise twin of each built from, or held to, that declaration."""

from __future__ import annotations

import ast
import copy
import math
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pytest

from pipeline import modes
from pipeline.splice import decide_by_ratio, log_importance_ratio
from pipeline.trajectory import purified_to_row, trajectory_from_row, trajectory_to_row
from purifier.saar import (
    ATTEMPT_RULES,
    POSITION_RULES,
    ROW_RULES,
    PurifyError,
    attempt_facts,
    attempt_facts_columns,
    purify,
    row_facts,
    row_facts_columns,
    validate_raw,
)
from purifier.unspliced import UNSPLICED_ROW, purified_table, unspliced_mask
from storage import modes as vocabulary
from storage.schemas import PURIFIED, RAW, row_key, row_keys
from tests.synthetic import synthetic_trajectories

ROOT = Path(__file__).resolve().parent.parent
PRODUCT = ("storage", "pipeline", "rollout_gen", "purifier", "trainer", "flows")


def decode(ids: list[int]) -> str:
    return " ".join(map(str, ids))


def _assigned(names: set[str]) -> list[str]:
    """Where product code assigns one of these names at a module's top level."""
    found = []
    for package in PRODUCT:
        for path in sorted((ROOT / package).rglob("*.py")):
            for node in ast.parse(path.read_text()).body:
                targets = (
                    node.targets
                    if isinstance(node, ast.Assign)
                    else [node.target]
                    if isinstance(node, ast.AnnAssign)
                    else []
                )
                found += [
                    f"{path.relative_to(ROOT)}:{node.lineno}"
                    for t in targets
                    if isinstance(t, ast.Name) and t.id in names
                ]
    return found


# ---- the mode vocabulary ----------------------------------------------------------------------------------------


def test_the_mode_vocabulary_is_defined_once_where_storage_reads_it():
    where = _assigned({"Mode", "MODES", "IS_MODES", "SPLICING_MODES"})
    assert len(where) == 4 and {w.split(":")[0] for w in where} == {"storage/modes.py"}, where
    for name in ("Mode", "MODES", "IS_MODES", "SPLICING_MODES"):
        assert getattr(modes, name) is getattr(vocabulary, name)
    assert set(vocabulary.IS_MODES) <= set(vocabulary.MODES) and set(vocabulary.SPLICING_MODES) <= set(vocabulary.MODES)
    assert vocabulary.sql_list(("saar_is",)) == "('saar_is')"


# ---- the importance-ratio rule ----------------------------------------------------------------------------------


def test_the_ratio_rule_is_one_function_called_live_and_offline():
    for path in ("rollout_gen/agent.py", "purifier/saar.py"):
        calls = [
            n
            for n in ast.walk(ast.parse((ROOT / path).read_text()))
            if isinstance(n, ast.Call) and getattr(n.func, "id", None) == "decide_by_ratio"
        ]
        assert len(calls) == 1, path
    tau = math.exp(-1.0)
    assert decide_by_ratio([-1.5, -0.5], [-0.5, -0.5], tau).kind == "replace"  # IS = τ exactly
    assert decide_by_ratio([-1.5, -0.5 - 2.0**-40], [-0.5, -0.5], tau).kind == "append"
    assert decide_by_ratio([math.nan], [0.0], tau).kind == "append"
    target, behaviour = [-1.5, -0.5], [-0.5, -0.5]
    assert decide_by_ratio(target, behaviour, tau).log_ratio == log_importance_ratio(target, behaviour)


# ---- raw-row validation: one declared list, evaluated per row and column-wise --------------------------------------


@pytest.fixture(scope="module")
def raws():
    rows = synthetic_trajectories(24, seed=11, run_id="rules")
    assert any(all(len(p.attempts) == 1 for p in t.positions) for t in rows), "fixture needs unspliced rows"
    return rows


def _table(rows) -> pa.Table:
    return pa.Table.from_pylist([trajectory_to_row(t) for t in rows], schema=RAW)


def test_the_facts_a_row_is_checked_on_are_the_same_read_per_row_and_column_wise(raws):
    table = _table(raws)
    columns = row_facts_columns(table)
    assert [tuple(int(np.asarray(f)[i]) for f in columns) for i in range(len(raws))] == [row_facts(t) for t in raws]
    positions = table["positions"].combine_chunks().flatten()
    attempts = positions.field("attempts")
    outcome = positions.field("outcome").to_numpy(zero_copy_only=False)[pc.list_parent_indices(attempts).to_numpy()]
    columns = attempt_facts_columns(attempts.flatten(), outcome)
    per_row = [attempt_facts(a, p.outcome) for t in raws for p in t.positions for a in p.attempts]
    assert [tuple(np.asarray(f)[i].item() for f in columns) for i in range(len(per_row))] == per_row


# One way to break each declared rule, on the first attempt of a row with nothing to splice. A rule added to the
# declarations without one here fails the test below: every rule is tested both ways.
BREAKS = {
    "lived_mask/lived_logprobs length differs from lived_ids": lambda t: t.lived_mask.pop(),
    "no attempts": lambda t: t.positions[0].attempts.clear(),
    "no turn_ids": lambda t: setattr(t.positions[0].attempts[0], "turn_ids", None),
    "logprobs length": lambda t: t.positions[0].attempts[0].logprobs.pop(),
    "call_start": lambda t: setattr(t.positions[0].attempts[0], "call_start", 10_000),
    "missing context_len/context_fingerprint": lambda t: setattr(t.positions[0].attempts[0], "context_len", None),
    "a call without a tool result": lambda t: setattr(t.positions[0].attempts[0], "result", None),
}


def _problems() -> list[str]:
    return [
        next(k for k in BREAKS if rule.problem(_Any()).startswith(k))
        for rule in (*ROW_RULES, *POSITION_RULES, *ATTEMPT_RULES)
    ]


class _Any:
    """Facts that format into any rule's problem."""

    def __getattr__(self, name: str) -> int:
        return 0


@pytest.mark.parametrize("problem", sorted(BREAKS))
def test_a_row_breaking_a_rule_is_refused_by_both_paths(raws, problem):
    assert sorted(_problems()) == sorted(BREAKS)  # each declared rule has its break, and no break is left over
    row = next(
        i
        for i, t in enumerate(raws)
        if all(len(p.attempts) == 1 for p in t.positions) and t.positions[0].attempts[0].has_call
    )
    broken = [copy.deepcopy(t) for t in raws]
    BREAKS[problem](broken[row])
    with pytest.raises(PurifyError, match=problem):
        validate_raw(broken[row])
    mask, before = unspliced_mask(_table(broken)), unspliced_mask(_table(raws))
    assert before[row] and not mask[row] and mask.sum() == before.sum() - 1
    for t in raws:  # the others pass the per-row checks as the column-wise ones pass them
        validate_raw(t)


# ---- the unspliced purified row ---------------------------------------------------------------------------------


@pytest.mark.parametrize("mode", ["saar", "raw", "saar_correct", "mask_failed", "roc"])
def test_the_unspliced_row_is_declared_once_and_purify_keeps_it(raws, mode):
    table = _table(raws)
    mask = unspliced_mask(table)
    fast = purified_table(table.filter(pa.array(mask)), mode, 0.5).to_pylist()
    slow = [purified_to_row(purify(t, 0.5, mode, decode)) for t, m in zip(raws, mask) if m]
    rows = [r for r, m in zip(table.to_pylist(), mask) if m]
    assert len(fast) == len(slow) == len(rows) > 0
    for raw, a, b in zip(rows, fast, slow):
        for field, column in UNSPLICED_ROW:
            assert a[field] == b[field] == raw[column], field
        assert repr(a) == repr(b)  # the other fields too (repr: NaN advantages compare equal)
    assert {f for f, _ in UNSPLICED_ROW} <= set(PURIFIED.names)


# ---- the row key ------------------------------------------------------------------------------------------------


def test_the_row_key_is_one_rule_per_row_and_column_wise(raws):
    from pipeline import trajectory

    assert trajectory.row_key is row_key
    table = _table(raws)
    assert (
        row_keys(table).to_pylist()
        == [t.key for t in raws]
        == [row_key(t.run_id, t.iteration, t.prompt_id, t.sample_idx) for t in raws]
    )
    assert [trajectory_from_row(r).key for r in table.to_pylist()] == [t.key for t in raws]
