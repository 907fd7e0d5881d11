"""`cleaner inspect`: the catalog's numbers as tables, or the user's own SQL."""
from __future__ import annotations

import duckdb
import pyarrow as pa
from rich.console import Console
from rich.table import Table

from pipeline.config import CleanerConfig
from storage.errors import InspectError, WorkspaceError
from storage.catalog import Catalog, publish_quietly

EXAMPLE_QUERIES = {
    "tool-error rate per iteration": (
        "SELECT run_id, iteration, avg(stats.first_attempt_failures) AS first_failures_per_traj, "
        "avg(reward) AS mean_reward FROM raw_trajectories GROUP BY ALL ORDER BY ALL"
    ),
    "failures by label and class": (
        "SELECT error_label, error_class, count(*) AS n FROM raw_attempts WHERE status = 'failure' "
        "GROUP BY ALL ORDER BY n DESC"
    ),
    "raw vs purified per γ": "SELECT * FROM purify_compare",
    "does purification help here? (recovered mean advantage > 0 predicts yes)": (
        "SELECT * FROM trajectory_kinds ORDER BY ALL"
    ),
    "failed-call tokens trained under negative vs positive advantage, per mode": (
        "SELECT * FROM failed_call_advantage ORDER BY ALL"
    ),
    "similarity of splices": (
        "SELECT mode, gamma, kind, count(*) AS n, avg(similarity) AS mean_similarity FROM splices GROUP BY ALL ORDER BY ALL"
    ),
}

SUMMARY_SQL = {
    "raw trajectories": (
        "SELECT run_id, iteration, count(*) AS trajectories, avg(reward) AS mean_reward, "
        "avg(stats.tool_calls) AS tool_calls, avg(stats.first_attempt_failures) AS first_failures, "
        "sum(stats.recovered) AS recovered, avg(response_tokens) AS response_tokens "
        "FROM raw_summary {where} GROUP BY ALL ORDER BY ALL"
    ),
    "purified shards": "SELECT * FROM purify_compare {where} ORDER BY ALL",
}
RECENT = 10  # iterations per run the default tables show: their length does not grow with the run's history
# the rows of a run's last RECENT iterations (the tables' {where}); --all drops it
RECENT_SQL = ("iteration > (SELECT max(iteration) FROM raw_summary r WHERE r.run_id = {table}.run_id) - {n}")


def print_table(console: Console, title: str, table: pa.Table) -> None:
    # its own line: a table's title is wrapped to the table's width, a query to a column of 5 characters
    console.print(title, style="italic", markup=False, highlight=False)
    out = Table()
    for name in table.column_names:
        out.add_column(name)
    for row in table.to_pylist():
        out.add_row(*(f"{v:.4g}" if isinstance(v, float) else str(v) for v in row.values()))
    console.print(out)


def _duckdb_error(e: Exception, db) -> InspectError:
    first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
    if isinstance(e, duckdb.IOException):
        return InspectError(f"{db}: cannot open the catalog ({first})")
    return InspectError(f"SQL error: {first}")


def run_inspect(cfg: CleanerConfig, sql: str | None = None, run_id: str | None = None, print_queries: bool = False,
                verify: bool = False, show_all: bool = False) -> int:
    try:
        if verify:
            return _verify(cfg)
        return _inspect(cfg, sql, run_id, print_queries, show_all)
    except duckdb.Error as e:
        raise _duckdb_error(e, cfg.storage.root / cfg.storage.catalog) from None


def _verify(cfg: CleanerConfig) -> int:
    """Every committed part checked in full; each bad shard named with what is wrong."""
    import sys

    if not cfg.storage.root.is_dir():
        raise WorkspaceError(f"storage.root {cfg.storage.root} does not exist (check storage.root or --config)")
    from storage import shards

    before = shards.FULL_READS
    with Catalog(cfg.storage.root, verify=True) as cat:
        bad = [p for p in cat.problems if p.committed]
        for problem in cat.problems:
            print(f"cleaner inspect --verify: {'BAD' if problem.committed else 'uncommitted'} {problem}", file=sys.stderr)
    print(f"verified {cfg.storage.root}: {shards.FULL_READS - before} parts read in full, {len(bad)} bad shard(s)")
    return 1 if bad else 0


def _inspect(cfg: CleanerConfig, sql: str | None, run_id: str | None, print_queries: bool,
             show_all: bool = False) -> int:
    import sys

    console = Console(width=None if sys.stdout.isatty() else 220)  # pipes and logs get whole columns
    db = (cfg.storage.root / cfg.storage.catalog).resolve()
    if print_queries:
        console.print(f"duckdb -readonly {db}")
        for title, q in EXAMPLE_QUERIES.items():
            console.print(f"-- {title}\n{q};\n")
        return 0
    if not cfg.storage.root.is_dir():  # a mistyped root must not become a new, empty one
        raise WorkspaceError(f"storage.root {cfg.storage.root} does not exist (no run has written there; check "
                             "storage.root or --config)")
    from storage.catalog import scan

    scanned = scan(cfg.storage.root)  # once, for the published file and the in-memory catalog alike
    publish_quietly(cfg.storage.root, db, lambda m: print(f"cleaner inspect: {m}", file=sys.stderr), scanned)
    with Catalog(cfg.storage.root, scanned=scanned) as cat:  # in memory: a process holding the file blocks nothing
        for problem in cat.problems:  # named, never silently dropped; the tables below leave them out
            print(f"cleaner inspect: skipped {problem}", file=sys.stderr)
        if sql:
            print_table(console, sql, cat.query(sql))
            return 0
        conditions = ["run_id = '{}'".format(run_id.replace("'", "''"))] if run_id else []
        longest = cat.query("SELECT coalesce(max(n), 0) AS n FROM (SELECT count(DISTINCT iteration) AS n "
                            "FROM raw_summary GROUP BY run_id)").to_pylist()[0]["n"]
        cut = not show_all and longest > RECENT
        for title, q in SUMMARY_SQL.items():
            table = "raw_summary" if "raw_summary" in q else "purify_compare"
            where = conditions + ([RECENT_SQL.format(table=table, n=RECENT)] if cut else [])
            print_table(console, title, cat.query(q.format(where=("WHERE " + " AND ".join(where)) if where else "")))
        from flows.report import ITERATIONS_SQL

        runs = [run_id] if run_id else [r["run_id"] for r in cat.query(
            "SELECT DISTINCT run_id FROM raw_summary ORDER BY 1").to_pylist()]
        for run in runs:  # the numbers `cleaner report` plots
            its = cat.con.sql(ITERATIONS_SQL, params={"run": run}).to_arrow_table()
            print_table(console, f"per iteration: {run}", its.slice(max(0, its.num_rows - RECENT)) if cut else its)
        if cut:
            console.print(f"(the last {RECENT} iterations of each run; `cleaner inspect --all` shows every one)",
                          style="italic", highlight=False)
    console.print(f"catalog: duckdb -readonly {db}  (views: raw_trajectories, raw_attempts, raw_summary, purified, "
                  "purified_summary, splices, purify_compare, dead_letters, metrics, raw_kinds, trajectory_kinds, "
                  "failed_call_advantage, off_policy)")
    return 0
