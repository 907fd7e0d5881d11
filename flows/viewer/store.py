"""What the viewer reads, and how: the published catalog for the store-wide pages, a catalog of one iteration
for the pages about it.

Runs and iterations come from the published `catalog.duckdb` (opened read-only, reopened when a commit
publishes a new one), whose summary views read a few dozen bytes per trajectory: the index costs the same at
iteration 200 as at 2. An iteration's table and a trajectory page need the rows themselves (attempt trees,
token lists), so they use an in-memory catalog of that iteration's committed shards alone (storage.catalog's
views and validation, scanned under `runs/R/iteration=N`): its cost does not grow with the store, it sees a
shard as soon as it is committed, and it names a shard that fails validation while the others are shown.
Only committed shards are read either way, so the viewer works while a flow writes.
"""

from __future__ import annotations

import os
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import duckdb

from flows.viewer.sql_box import cursor, sandboxed
from storage.catalog import Catalog, Problem, scan
from storage.layout import RunLayout
from storage.schemas import row_key

SCOPES = 8  # iteration catalogs kept (a few views each): the pages a person moves between
FALLBACK_TTL_S = 5.0  # the in-memory catalog of a root nothing published yet, rebuilt at most this often


def rows_of(cur: duckdb.DuckDBPyConnection, sql: str, params: dict[str, Any]) -> list[dict[str, Any]]:
    """The query's rows on `cur`, a cursor of its own (pages run on several threads), closed after."""
    try:
        return cur.sql(sql, params=params or None).to_arrow_table().to_pylist()
    finally:
        cur.close()


class NotFound(Exception):
    """An unknown run, iteration or trajectory: a 404 page that says which and links back."""

    status, heading = 404, "Not found"

    def __init__(self, message: str, back: str, back_label: str) -> None:
        super().__init__(message)
        self.back, self.back_label = back, back_label


class BadFilter(NotFound):
    """A filter value a table does not know: a 400 page that says which and links to the table unfiltered."""

    status, heading = 400, "Bad filter"


@dataclass
class Scope:
    """One iteration's committed shards as a catalog, and the shards of it left out."""

    catalog: Catalog
    problems: list[Problem]

    def rows(self, sql: str, **params: Any) -> list[dict[str, Any]]:
        return rows_of(self.catalog.con.cursor(), sql, params)


class Store:
    def __init__(self, root: Path, catalog_file: Path) -> None:
        self.root = Path(root).resolve()
        self.catalog_file = Path(catalog_file).resolve()
        self._lock = threading.Lock()
        self._published: tuple[tuple[int, int], duckdb.DuckDBPyConnection] | None = None
        self._fallback: tuple[float, Catalog] | None = None
        self._scopes: OrderedDict[tuple[str, int], tuple[tuple, Scope]] = OrderedDict()

    # ---- the published catalog -----------------------------------------------------------------------------
    def published(self) -> duckdb.DuckDBPyConnection | None:
        """The published catalog as it is now, attached read-only on a connection that cannot read outside the
        root (the SQL box's too: flows/viewer/sql_box.py), or None when none was published yet."""
        try:
            st = os.stat(self.catalog_file)
        except OSError:
            return None
        identity = (st.st_ino, st.st_mtime_ns)
        with self._lock:
            if self._published is None or self._published[0] != identity:
                # a new file was renamed over the old one: the old connection keeps its file until collected
                self._published = (identity, sandboxed(self.catalog_file, self.root))
            return self._published[1]

    def connection(self) -> duckdb.DuckDBPyConnection:
        """A cursor on the published catalog; on an in-memory catalog of the root when none was published yet (a
        root no stage committed to since catalogs were published)."""
        con = self.published()
        if con is not None:
            return cursor(con)
        with self._lock:
            # rebuilt every few seconds: built once, it showed a run committed since with no iteration
            if self._fallback is None or time.monotonic() - self._fallback[0] > FALLBACK_TTL_S:
                self._fallback = (time.monotonic(), Catalog(self.root))
            return self._fallback[1].con.cursor()

    def query(self, sql: str, **params: Any) -> list[dict[str, Any]]:
        return rows_of(self.connection(), sql, params)

    def problems(self) -> list[dict[str, Any]]:
        """The shards the published catalog left out (a catalog published before that table: none known)."""
        try:
            return self.query("SELECT path, message, committed FROM catalog_problems ORDER BY path")
        except duckdb.CatalogException:
            return []

    def runs(self) -> list[dict[str, Any]]:
        rows = {
            r["run_id"]: r
            for r in self.query(
                "SELECT run_id, count(DISTINCT iteration) AS iterations, max(iteration) AS last_iteration, "
                "count(*) AS trajectories, avg(reward) AS mean_reward, avg((reward > 0)::INT) AS accuracy "
                "FROM raw_summary GROUP BY run_id"
            )
        }
        runs_dir = self.root / "runs"
        for name in sorted(os.listdir(runs_dir)) if runs_dir.is_dir() else []:
            if name not in rows and not name.startswith(".") and (runs_dir / name).is_dir():
                rows[name] = {
                    "run_id": name,
                    "iterations": 0,
                    "last_iteration": None,
                    "trajectories": 0,
                    "mean_reward": None,
                    "accuracy": None,
                }
        return [rows[k] for k in sorted(rows)]

    def check_run(self, run_id: str) -> RunLayout:
        if not run_id or "/" in run_id or run_id.startswith(".") or not (self.root / "runs" / run_id).is_dir():
            raise NotFound(f"unknown run {run_id!r}: there is no runs/{run_id} under {self.root}", "/", "all runs")
        return RunLayout(self.root, run_id)

    def iterations(self, run_id: str) -> list[dict[str, Any]]:
        its = self.query(
            "SELECT iteration, count(*) AS trajectories, avg(reward) AS mean_reward, avg((reward > 0)::INT) AS "
            "accuracy, avg(stats.first_attempt_failures) AS first_call_failures_per_trajectory, "
            "sum(stats.recovered)::BIGINT AS recovered, avg(response_tokens) AS response_tokens FROM raw_summary "
            "WHERE run_id = $run GROUP BY iteration ORDER BY iteration",
            run=run_id,
        )
        parts = self.query(
            "SELECT iteration, mode, gamma, is_threshold, measure, count(*) AS rows, sum(splices)::BIGINT AS splices "
            "FROM purified_summary WHERE run_id = $run GROUP BY ALL ORDER BY ALL",
            run=run_id,
        )
        for it in its:
            it["partitions"] = [p for p in parts if p["iteration"] == it["iteration"]]
        return its

    def spliced_examples(self, run_id: str, limit: int = 20) -> list[dict[str, Any]]:
        return self.query(
            "SELECT iteration, prompt_id, sample_idx, mode, gamma, is_threshold, measure, splices, shallow, deep "
            "FROM purified_summary WHERE run_id = $run AND splices > 0 ORDER BY iteration DESC, prompt_id, sample_idx, "
            "mode LIMIT $n",
            run=run_id,
            n=limit,
        )

    # ---- one iteration ---------------------------------------------------------------------------------------
    def scope(self, run_id: str, iteration: int) -> Scope:
        layout = self.check_run(run_id)
        folder = layout.iteration_dir(iteration)
        if iteration < 0 or not (layout.raw_dir(iteration) / "_MANIFEST.json").is_file():
            raise NotFound(
                f"unknown iteration {iteration} of run {run_id!r}: "
                + (f"{folder} holds no committed raw shard yet" if folder.is_dir() else f"there is no {folder.name}"),
                f"/runs/{run_id}",
                f"run {run_id}",
            )
        key = (run_id, iteration)
        signature = self._signature(folder)
        with self._lock:
            cached = self._scopes.get(key)
            if cached is not None and cached[0] == signature:
                self._scopes.move_to_end(key)
                return cached[1]
        scanned = scan(self.root, iterations=str(folder.relative_to(self.root)))
        scope = Scope(Catalog(self.root, scanned=scanned), list(scanned.problems))
        with self._lock:
            self._scopes[key] = (signature, scope)
            while len(self._scopes) > SCOPES:
                self._scopes.popitem(last=False)  # its catalog goes when no page uses it any more
        return scope

    @staticmethod
    def _signature(folder: Path) -> tuple:
        """What changes when a shard of the iteration is committed, removed or rewritten: its manifests' identities."""
        out = []
        for dirpath, _dirs, files in os.walk(folder):
            for name in files:
                if name == "_MANIFEST.json" or name.startswith("part-"):
                    st = os.stat(os.path.join(dirpath, name))
                    out.append((dirpath, name, st.st_ino, st.st_mtime_ns, st.st_size, st.st_ctime_ns))
        return tuple(sorted(out))

    def trajectory(
        self, run_id: str, iteration: int, prompt_id: str, sample_idx: int
    ) -> tuple[Scope, dict[str, Any], list[dict[str, Any]], list[dict[str, Any]]]:
        """(scope, raw row, purified rows of every partition, dead letters) of one trajectory."""
        scope = self.scope(run_id, iteration)
        raw = scope.rows(
            "SELECT * FROM raw_trajectories WHERE prompt_id = $p AND sample_idx = $s", p=prompt_id, s=sample_idx
        )
        if not raw:
            raise NotFound(
                f"unknown trajectory: run {run_id!r} iteration {iteration} has no prompt {prompt_id!r} "
                f"sample {sample_idx}",
                f"/runs/{run_id}/{iteration}",
                f"iteration {iteration}",
            )
        purified = scope.rows(
            "SELECT * FROM purified WHERE prompt_id = $p AND sample_idx = $s "
            "ORDER BY mode = 'raw', mode, gamma, is_threshold, measure",
            p=prompt_id,
            s=sample_idx,
        )
        dead = scope.rows(
            "SELECT * FROM dead_letters WHERE raw_key = $k", k=row_key(run_id, iteration, prompt_id, sample_idx)
        )
        return scope, raw[0], purified, dead
