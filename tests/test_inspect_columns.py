"""`cleaner inspect` in a terminal 100 columns wide (issue #32 §4): no value is cut, the default tables show
fewer columns than `--wide`, and every column of the summary tables is explained."""
from __future__ import annotations

from pathlib import Path

import pytest

from tests.flow_helpers import ROOT, copy_runs, on_terminal, run_cleaner


@pytest.fixture()
def store(uninterrupted, tmp_path) -> Path:
    """A copy of the 2-iteration tiny run (inspect republishes the catalog: the shared run stays untouched)."""
    return copy_runs(uninterrupted, tmp_path / "ws")


def test_tables_at_100_columns_cut_no_value_and_say_what_surprises(store):
    out = on_terminal(["inspect", f"storage.root={store}"], store, columns=100)
    assert "…" not in out, out  # rich's ellipsis: a value or a header cut
    assert max(map(len, out.splitlines())) <= 100, out
    assert "raw trajectories" in out and "purified shards" in out and "per iteration: tiny" in out
    # the raw mode's purified tokens exceed the raw tokens: said under the table
    assert "every attempt" in out, out
    wide = on_terminal(["inspect", "--wide", f"storage.root={store}"], store, columns=100)
    assert "…" not in wide, wide
    assert "forwarded" in wide and "forwarded" not in out  # --wide: every column


def test_help_explains_every_column_of_the_summary_tables(store):
    from flows.inspect import SUMMARY_SQL
    from flows.report import ITERATIONS_SQL
    from storage.catalog import Catalog

    with Catalog(store) as cat:
        names = {name for sql in SUMMARY_SQL.values() for name in cat.query(sql.format(where="")).column_names}
        names |= set(cat.con.sql(ITERATIONS_SQL, params={"run": "tiny"}).to_arrow_table().column_names)
    text = run_cleaner(["inspect", "--help"], env={"COLUMNS": "100", "PATH": "/usr/bin:/bin",
                                                   "PYTHONPATH": str(ROOT)}).stdout
    missing = sorted(n for n in names if n not in text)
    assert not missing, f"not explained in `cleaner inspect --help`: {missing}\n{text}"
    assert "purified_response_tokens" in text and "every attempt" in text
