"""The SQL box: a person's query on the published catalog, on a connection that can read the store and nothing else.

Four locks, each DuckDB's own or the parser's, none a check on the query's text:
- the catalog file is attached read-only (nothing can be written into it);
- `enable_external_access = false` with `allowed_directories = [storage root]`: every file function
  (read_csv, read_text, glob, ATTACH, INSTALL …) is refused outside the root, `..` included, so
  `SELECT * FROM read_csv('/etc/passwd')` fails with DuckDB's permission error; the views' Parquet files are
  inside the root;
- `lock_configuration = true`: the query cannot SET those back;
- only SELECT statements run (DuckDB's own parser classifies them): COPY … TO could otherwise write inside the
  root, which external access allows; EXPLAIN is refused too, since EXPLAIN ANALYZE runs the statement it explains.
A query is interrupted after `timeout_s` and returns at most `max_rows` rows.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import duckdb

from storage.errors import first_line

ALLOWED = (duckdb.StatementType.SELECT,)
CATALOG = "catalog"  # the name the published file is attached under


class SqlRefused(Exception):
    """A query the box does not run, or that DuckDB refused; the message is shown on the page."""


@dataclass
class SqlResult:
    columns: list[str]
    rows: list[tuple[Any, ...]]
    truncated: bool
    notes: list[str] = field(default_factory=list)


def sandboxed(database: Path, root: Path) -> duckdb.DuckDBPyConnection:
    """A connection to `database`, attached read-only, whose file access is limited to `root`.

    Attached to a fresh in-memory instance rather than opened by path: DuckDB keeps one instance per path and
    process, so a second `connect` of a catalog renamed over by a publish would return the old file's views."""
    con = duckdb.connect(":memory:", config={"autoinstall_known_extensions": False, "autoload_known_extensions": False})
    try:
        con.execute(f"ATTACH {_quote(str(database))} AS {CATALOG} (READ_ONLY)")
        con.execute(f"USE {CATALOG}")
        con.execute(f"SET allowed_directories = [{_quote(str(Path(root).resolve()).rstrip('/') + '/')}]")
        con.execute("SET enable_external_access = false")
        con.execute("SET lock_configuration = true")
    except BaseException:
        con.close()
        raise
    return con


def cursor(con: duckdb.DuckDBPyConnection) -> duckdb.DuckDBPyConnection:
    """A connection of its own (pages run on several threads) on the attached catalog."""
    cur = con.cursor()
    cur.execute(f"USE {CATALOG}")
    return cur


def _quote(text: str) -> str:
    return "'" + text.replace("'", "''") + "'"


def run_sql(con: duckdb.DuckDBPyConnection, sql: str, max_rows: int = 1000, timeout_s: float = 20.0) -> SqlResult:
    """`sql` on a cursor of a `sandboxed` connection: its last statement's rows."""
    cur = cursor(con)
    timer = threading.Timer(timeout_s, cur.interrupt)
    try:
        try:
            statements = cur.extract_statements(sql)
        except duckdb.Error as e:
            raise SqlRefused(first_line(e)) from None
        if not statements:
            raise SqlRefused("no statement to run")
        for s in statements:
            if s.type not in ALLOWED:
                raise SqlRefused(
                    f"only SELECT queries run here: the catalog is read-only; this is a {s.type.name} statement"
                )
        timer.start()
        try:
            for s in statements:  # the last statement's rows are shown
                cur.execute(s.query)
            rows = cur.fetchmany(max_rows + 1) if cur.description else []
            columns = [d[0] for d in cur.description or []]
        except duckdb.InterruptException:
            raise SqlRefused(f"query stopped after {timeout_s:g} s") from None
        except duckdb.Error as e:
            raise SqlRefused(first_line(e)) from None
        return SqlResult(columns, rows[:max_rows], len(rows) > max_rows)
    finally:
        timer.cancel()
        cur.close()
