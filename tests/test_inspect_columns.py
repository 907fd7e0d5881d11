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
    text = run_cleaner(
        ["inspect", "--help"], env={"COLUMNS": "100", "PATH": "/usr/bin:/bin", "PYTHONPATH": str(ROOT)}
    ).stdout
    missing = sorted(n for n in names if n not in text)
    assert not missing, f"not explained in `cleaner inspect --help`: {missing}\n{text}"
    assert "purified_response_tokens" in text and "every attempt" in text


def test_values_print_as_they_are_not_as_markup(store):
    """Cells hold model code, LaTeX and tool output: `[i]`, `\\[`, `:x:` and `[/]` print literally."""
    sql = "SELECT 'print(lst[i] + d[b])' AS code, 'Find \\[x^2\\]' AS q, 'a:x:b' AS e, 'x[/]' AS s"
    out = run_cleaner(["inspect", "--sql", sql, f"storage.root={store}"], store)
    assert out.returncode == 0, out.stderr
    for literal in ("print(lst[i] + d[b])", "Find \\[x^2\\]", "a:x:b", "x[/]"):
        assert out.stdout.count(literal) == 2, out.stdout  # the query echoed, then the cell


def test_an_error_of_the_users_sql_is_an_sql_error_and_an_unknown_run_is_named(store):
    missing = store / "none.parquet"
    out = run_cleaner(["inspect", "--sql", f"SELECT * FROM read_parquet('{missing}')", f"storage.root={store}"], store)
    assert out.returncode != 0 and out.stderr.startswith("cleaner inspect: SQL error:"), out.stderr
    assert "catalog" not in out.stderr, out.stderr
    out = run_cleaner(["inspect", "--run", "nope", f"storage.root={store}"], store)
    assert out.returncode != 0, out.stdout
    assert "run 'nope'" in out.stderr and "tiny" in out.stderr, out.stderr  # the runs there are named
    out = run_cleaner(["inspect", "--sql", "", f"storage.root={store}"], store)
    assert out.returncode != 0 and "--sql" in out.stderr, out.stdout


def test_failed_tokens_are_a_ratio_to_the_generated_tokens_and_say_so(store):
    """Failed attempts' tokens (their call and its error) per generated token: a ratio, not a share (it was
    called a share of the generated tokens and read 1.04; the lived sequence is no denominator either, since
    live SAAR keeps failed turns out of it)."""
    from flows.report import iteration_table
    from storage.catalog import Catalog

    rows = iteration_table(store, "tiny")
    with Catalog(store) as cat:
        want = cat.query(
            "SELECT iteration, sum(failed_attempt_tokens) / sum(stats.generated_tokens) AS ratio FROM "
            "raw_summary WHERE run_id = 'tiny' GROUP BY 1 ORDER BY 1"
        ).to_pylist()
    assert [r["failed_tokens_per_generated"] for r in rows] == pytest.approx([w["ratio"] for w in want])
    assert any(r["failed_tokens_per_generated"] for r in rows), rows
    text = run_cleaner(
        ["inspect", "--help"], env={"COLUMNS": "100", "PATH": "/usr/bin:/bin", "PYTHONPATH": str(ROOT)}
    ).stdout
    assert "failed tokens per generated" in text and "share" not in text.split("failed tokens per generated")[1][:200]


def test_a_missing_value_prints_empty_not_none(store):
    out = run_cleaner(["inspect", "--sql", "SELECT NULL AS nothing, 1 AS one", f"storage.root={store}"], store)
    assert out.returncode == 0, out.stderr
    assert "None" not in out.stdout, out.stdout


def test_query_results_put_text_left_and_numbers_right(store):
    out = run_cleaner(
        [
            "inspect",
            "--sql",
            "SELECT 'ab' AS word, 12345 AS n UNION ALL SELECT 'abcdefgh', 1 ORDER BY n",
            f"storage.root={store}",
        ],
        store,
    )
    assert out.returncode == 0, out.stderr
    rows = [ln for ln in out.stdout.splitlines() if "ab" in ln and "│" in ln]
    assert [ln.split("│")[1:3] for ln in rows] == [[" abcdefgh ", "     1 "], [" ab       ", " 12345 "]], out.stdout


def test_sql_queries_and_verify_are_one_at_a_time(store):
    out = run_cleaner(["inspect", "--verify", "--sql", "SELECT 1", f"storage.root={store}"], store)
    assert out.returncode != 0 and "one at a time" in out.stderr and out.stdout == "", out.stdout + out.stderr
