"""The DuckDB catalog: views over the committed Parquet parts of every run under a project root.

Views read the Parquet files in place; only files listed in a manifest are included, so a stage that
crashed mid-way never shows up half-written, and every part is validated against its manifest first
(size, crc32, schema version, columns, rows; storage.shards.check_part; found through the root's scan index,
storage/shard_index.py). A shard that fails, or one with parts but no manifest, is left out of the views and
listed in `Catalog.problems`, which `cleaner inspect` prints and `cleaner report` refuses. The default tables'
small files (row summaries, metrics) are read from packs (storage/packs.py). `refresh()` rebuilds the views.

The catalog file users open (`<root>/catalog.duckdb`) is published, never edited: `publish` builds a
new file beside it and renames it over the old one after every stage commit (and `cleaner inspect`),
unless it was built from the same scan. Nothing ever opens the published file for writing, so a duckdb CLI
or notebook holding it open (read-only or not) blocks no flow and no command, and the next open sees every
committed shard. Views list absolute paths, so the file works from any working directory.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
from pathlib import Path
from typing import Callable

import duckdb
import pyarrow as pa

from storage.errors import first_line
from storage.layout import DEFAULT_MEASURE_KEY
from storage.locks import turn
from storage.modes import IS_MODES, SPLICING_MODES, sql_list
from storage.packs import KINDS
from storage.schemas import GAMMA_ALONE_SQL, schema_id
from storage.shard_index import SOURCES, Problem, Scan, ShardFiles, identity, scan  # noqa: F401 - re-exported
from storage.shards import atomic_write_json
from storage.summaries import PURIFIED_SUMMARY, RAW_SUMMARY
from storage.texts import PURIFIED_TEXT, RAW_TEXT

CLI_STORAGE_VERSION = "v1.5.0"

_SQL_TYPES = {
    pa.string(): "VARCHAR",
    pa.int8(): "TINYINT",
    pa.int32(): "INTEGER",
    pa.int64(): "BIGINT",
    pa.float32(): "FLOAT",
    pa.float64(): "DOUBLE",
    pa.bool_(): "BOOLEAN",
}


def _sql_type(kind: pa.DataType) -> str:
    if pa.types.is_list(kind):
        return _sql_type(kind.value_type) + "[]"
    if pa.types.is_struct(kind):
        return "STRUCT(" + ", ".join(f'"{f.name}" {_sql_type(f.type)}' for f in kind) + ")"
    return _SQL_TYPES[kind]


def _empty_table(con: duckdb.DuckDBPyConnection, name: str, schema: pa.Schema, temporary: bool = False) -> str:
    # DuckDB cannot read an empty file list: a typed empty table (kept inside the catalog, so nothing is
    # written beside the shards) gives the view its columns. Declared in SQL: handing DuckDB an Arrow table
    # makes it import pandas, most of a small catalog's build time.
    table = f"_{'stand_in' if temporary else 'empty'}_{name}"
    columns = ", ".join(f'"{f.name}" {_sql_type(f.type)}' for f in schema)
    con.execute(f"CREATE OR REPLACE {'TEMP ' if temporary else ''}TABLE {table} ({columns})")
    return table


def _sql_list(paths: list[str]) -> str:
    """The paths as one SQL list expression. One string split at newlines: DuckDB parses a list literal of
    thousands of strings slowly (about 20 ms per view of 2,000 paths, paid when the view is created and again
    whenever a query binds it, 8 times less as one string); a path with a newline in it gets the literal."""
    if any("\n" in p for p in paths):
        return "[" + ", ".join("'" + p.replace("'", "''") + "'" for p in paths) + "]"
    return "string_split('" + "\n".join(paths).replace("'", "''") + "', chr(10))"


# The premise of purification (docs/saar.md; the kinds are pipeline/kinds.py's rule, tested equal row for row):
# raw_kinds: one row per raw trajectory, its kind and its GRPO advantage in its prompt group, computed
#   from raw rewards exactly as purifier/advantages.py `group_norm` does: (r - mean) / (std + 1e-6), std
#   over the group (population). No mode changes a reward, so this is every mode's advantage except roc's,
#   whose groups are smaller; and every estimator gives it the same sign.
# trajectory_kinds: per run, iteration and kind: trajectories, mean reward, share correct, mean advantage.
# failed_call_advantage: per purified partition, the failed-call tokens (the call segments of failed
#   attempts, raw_attempts.turn_tokens from call_start) that stay trained in its rows, split by the sign of
#   the advantage they are trained with. A failed call stays unless a later retry at its position was
#   spliced over it (every splice takes the retry's call; saar_is's replaces only the turn just before its retry,
#   a turn it appended to stays), its row trains no token (void_turn), or its row is
#   recovered and correct in mode mask_failed; rows a mode left out (roc, dead letters, filtered groups)
#   train nothing. Shares are of all failed-call tokens of the iteration's raw rows, the same for every mode.
PREMISE_SQL = f"""
CREATE OR REPLACE VIEW raw_kinds AS
WITH positions AS (
    SELECT run_id, iteration, prompt_id, sample_idx, position_idx,
           bool_or(error_class = 'infra') AS infra,
           bool_or(status = 'failure' AND error_class = 'model') AS failed,
           arg_max(coalesce(status = 'success', false), attempt_idx) AS last_ran
    FROM raw_attempts GROUP BY ALL
), kinds AS (
    SELECT run_id, iteration, prompt_id, sample_idx,
           CASE WHEN bool_or(infra) THEN 'infra' WHEN bool_or(failed AND NOT last_ran) THEN 'not_recovered'
                WHEN bool_or(failed) THEN 'recovered' ELSE 'clean' END AS kind
    FROM positions GROUP BY ALL
), groups AS (
    SELECT run_id, iteration, prompt_id, sum(reward) / count(*) AS mean FROM raw_trajectories GROUP BY ALL
), spread AS (
    SELECT t.run_id, t.iteration, t.prompt_id, g.mean, sqrt(sum((t.reward - g.mean) ** 2) / count(*)) AS std
    FROM raw_trajectories t JOIN groups g USING (run_id, iteration, prompt_id) GROUP BY ALL
)
SELECT t.run_id, t.iteration, t.prompt_id, t.sample_idx, coalesce(k.kind, 'clean') AS kind, t.reward,
       (t.reward - s.mean) / (s.std + 1e-6) AS advantage
FROM raw_trajectories t JOIN spread s USING (run_id, iteration, prompt_id)
LEFT JOIN kinds k USING (run_id, iteration, prompt_id, sample_idx);

CREATE OR REPLACE VIEW trajectory_kinds AS
SELECT run_id, iteration, kind, count(*) AS trajectories, avg(reward) AS mean_reward,
       avg((reward > 0)::INT) AS correct, avg(advantage) AS mean_advantage
FROM raw_kinds GROUP BY ALL ORDER BY ALL;

CREATE OR REPLACE VIEW failed_call_advantage AS
WITH failed AS (
    SELECT run_id, iteration, prompt_id, sample_idx, position_idx, attempt_idx,
           turn_tokens - greatest(call_start, 0) AS call_tokens
    FROM raw_attempts WHERE status = 'failure' AND error_class = 'model'
), totals AS (
    SELECT t.run_id, t.iteration, coalesce(sum(f.call_tokens), 0)::BIGINT AS failed_call_tokens
    FROM raw_trajectories t LEFT JOIN failed f USING (run_id, iteration, prompt_id, sample_idx) GROUP BY ALL
), partitions AS (
    SELECT DISTINCT run_id, iteration, mode, gamma, is_threshold, measure FROM purified
), trained AS (
    SELECT p.run_id, p.iteration, p.mode, p.gamma, p.is_threshold, p.measure, f.call_tokens, p.advantage
    FROM purified p JOIN failed f USING (run_id, iteration, prompt_id, sample_idx)
    JOIN raw_kinds k USING (run_id, iteration, prompt_id, sample_idx)
    WHERE NOT coalesce(list_bool_or(list_transform(p.splices, lambda s: s.position_idx = f.position_idx
              AND (s.attempt_idx > f.attempt_idx AND p.mode NOT IN {sql_list(IS_MODES)}
                   OR s.attempt_idx = f.attempt_idx + 1))), false)
      AND list_sum(p.loss_mask) > 0
      AND NOT (p.mode = 'mask_failed' AND k.kind = 'recovered' AND p.reward > 0)
), sums AS (
    SELECT run_id, iteration, mode, gamma, is_threshold, measure, sum(call_tokens) AS trained,
           coalesce(sum(call_tokens) FILTER (WHERE advantage < 0), 0) AS on_negative,
           coalesce(sum(call_tokens) FILTER (WHERE advantage > 0), 0) AS on_positive
    FROM trained GROUP BY ALL
)
SELECT p.run_id, p.iteration, p.mode, p.gamma, p.is_threshold, p.measure, t.failed_call_tokens,
       coalesce(s.trained, 0)::BIGINT AS trained, coalesce(s.on_negative, 0)::BIGINT AS on_negative,
       coalesce(s.on_positive, 0)::BIGINT AS on_positive,
       coalesce(s.on_negative, 0) / nullif(t.failed_call_tokens, 0) AS share_negative,
       coalesce(s.on_positive, 0) / nullif(t.failed_call_tokens, 0) AS share_positive
FROM partitions p JOIN totals t USING (run_id, iteration)
LEFT JOIN sums s ON s.run_id = p.run_id AND s.iteration = p.iteration AND s.mode = p.mode AND s.gamma = p.gamma
                AND s.is_threshold IS NOT DISTINCT FROM p.is_threshold AND s.measure IS NOT DISTINCT FROM p.measure
ORDER BY ALL;
"""

VIEWS_SQL = (
    """
CREATE OR REPLACE VIEW raw_attempts AS
WITH pos AS (
    SELECT run_id, iteration, prompt_id, sample_idx, saar_gate, live_mode, UNNEST(positions) AS p
    FROM raw_trajectories
), att AS (
    SELECT run_id, iteration, prompt_id, sample_idx, saar_gate, live_mode,
           p.position_idx AS position_idx, p.outcome AS position_outcome, UNNEST(p.attempts) AS a
    FROM pos
)
SELECT run_id, iteration, prompt_id, sample_idx, saar_gate, live_mode, position_idx, position_outcome,
       a.attempt_idx AS attempt_idx, a.call_status AS call_status, a.code AS code,
       a.result.status AS status, a.result.error_label AS error_label, a.result.error_class AS error_class,
       a.result.exit_code AS exit_code, a.result.duration_s AS duration_s, a.result.timed_out AS timed_out,
       a.result.text AS tool_text, len(a.turn_ids) AS turn_tokens, len(a.feedback_ids) AS feedback_tokens,
       a.call_start AS call_start, a.context_len AS context_len
FROM att;

CREATE OR REPLACE VIEW splices AS
SELECT run_id, iteration, prompt_id, sample_idx, mode, gamma, is_threshold, measure, s.position_idx AS position_idx,
       s.attempt_idx AS attempt_idx, s.kind AS kind, s.similarity AS similarity,
       s.tokens_removed AS tokens_removed, s.first_recomputed AS first_recomputed, s.split_failed AS split_failed,
       s.moved_tokens AS moved_tokens, s.log_is_ratio AS log_is_ratio, exp(s.log_is_ratio) AS is_ratio
FROM (SELECT run_id, iteration, prompt_id, sample_idx, mode, gamma, is_threshold, measure, UNNEST(splices) AS s
      FROM purified);

-- How far each purified partition trains tokens from the distribution that sampled them, by where the token
-- was sampled (pipeline.trajectory.TokenOrigin): per trained token, d = old log-prob (the policy in the trained
-- context) − behaviour log-prob (as sampled). kl_k3 estimates KL(π_b ‖ π) (Schulman's k3: e^d − 1 − d);
-- beyond_bounds is the share whose ratio e^d is outside [0.5, 2] (verl's default TIS/MIS bounds). Rows of
-- version-1 shards carry no behaviour log-probs and are left out.
CREATE OR REPLACE VIEW off_policy AS
WITH tokens AS (
    SELECT run_id, iteration, mode, gamma, is_threshold, measure, UNNEST(token_origin) AS origin,
           UNNEST(loss_mask) AS trained,
           UNNEST(old_logprobs) - UNNEST(behaviour_logprobs) AS d
    FROM purified WHERE behaviour_logprobs IS NOT NULL
)
SELECT run_id, iteration, mode, gamma, is_threshold, measure,
       CASE origin WHEN 1 THEN 'in_place' WHEN 2 THEN 'shallow' WHEN 3 THEN 'deep' WHEN 4 THEN 'moved' END AS origin,
       count(*) AS tokens, avg(abs(d)) AS mean_abs_delta, max(abs(d)) AS max_abs_delta,
       avg(exp(d) - 1 - d) AS kl_k3, avg((exp(d) < 0.5 OR exp(d) > 2)::INT) AS beyond_bounds
FROM tokens WHERE trained = 1 AND origin > 0
GROUP BY ALL ORDER BY ALL;

CREATE OR REPLACE VIEW purify_compare AS
SELECT p.run_id, p.iteration, p.mode, p.gamma, p.is_threshold, p.measure,
       count(*) AS trajectories,
       avg(r.response_tokens) AS raw_response_tokens,
       avg(p.response_tokens) AS purified_response_tokens,
       avg(p.trained_tokens) AS trained_tokens,
       sum(p.splices) AS splices,
       sum(p.shallow) AS shallow,
       sum(p.deep) AS deep,
       sum(p.tokens_removed) AS tokens_removed,
       avg(p.tokens_forwarded) AS tokens_forwarded,
       avg(p.reward) AS mean_reward
FROM purified_summary p JOIN raw_summary r
  ON p.run_id = r.run_id AND p.iteration = r.iteration AND p.prompt_id = r.prompt_id AND p.sample_idx = r.sample_idx
GROUP BY ALL
ORDER BY ALL;
"""
    + PREMISE_SQL
)


# The similarity measure of a splicing mode's partition: the name after γ (gamma=0.50-difflib-segment),
# else the default measure; modes without splices have none.
_MEASURE_SQL = (
    f"CASE WHEN regexp_extract(filename, '/mode=([^/]+)/', 1) NOT IN {sql_list(SPLICING_MODES)} THEN NULL "
    f"ELSE coalesce(nullif(regexp_extract(filename, '/gamma=[^/-]+-([^/]+)/[^/]+$', 1), ''), "
    f"'{DEFAULT_MEASURE_KEY}') END"
)
# The τ of an importance-ratio mode's partition (tau=0.50, read back exactly: storage.layout.format_threshold); NULL
# in the others. From the path, as the measure: a purified row's summary and text carry no τ of their own.
_TAU_SQL = "TRY_CAST(nullif(regexp_extract(filename, '/tau=([^/]+)/[^/]+$', 1), '') AS DOUBLE)"


# The row summaries (storage/summaries.py) of a shard committed without them, computed from its parts
# (the select list over its read_parquet).
SUMMARY_SQL = {
    "raw_trajectories": (
        "run_id, iteration, prompt_id, sample_idx, reward, stats, len(lived_ids)::BIGINT AS response_tokens, "
        "coalesce(list_sum(list_transform(flatten(list_transform(positions, lambda p: p.attempts)), lambda a: "
        "CASE WHEN a.result.status = 'failure' THEN len(a.turn_ids) + len(a.feedback_ids) ELSE 0 END)), 0)::BIGINT "
        "AS failed_attempt_tokens"
    ),
    "purified": (
        "run_id, iteration, prompt_id, sample_idx, mode, gamma, reward, advantage, "
        "len(response_ids)::BIGINT AS response_tokens, coalesce(list_sum(loss_mask), 0)::BIGINT AS trained_tokens, "
        "len(splices)::BIGINT AS splices, len(list_filter(splices, lambda s: s.kind = 'shallow'))::BIGINT AS shallow, "
        "len(list_filter(splices, lambda s: s.kind = 'deep'))::BIGINT AS deep, "
        "coalesce(list_sum(list_transform(splices, lambda s: s.tokens_removed)), 0)::BIGINT AS tokens_removed, "
        "tokens_forwarded"
    ),
}


class Catalog:
    """A DuckDB file (or in-memory database) whose views read a project root's shards."""

    def __init__(
        self,
        root: Path,
        database: str | Path | None = None,
        verify: bool = False,
        scanned: Scan | None = None,
        published_as: Path | None = None,
    ) -> None:
        self.root = Path(root).resolve()  # views hold absolute paths: usable from any directory
        self.verify = verify  # check every part in full, whatever the verification records say
        self.database = str(database) if database is not None else ":memory:"
        # A file's views hold the absolute paths of the root it was published for: a copy of the file (a workspace
        # copied or moved) would read the original's shards, or fail on a missing file. Every view of a published
        # file checks that it is opened where it was published, else fails saying how to republish it.
        self._guard = "" if published_as is None else " WHERE cleaner_catalog_in_place()"
        self.published_as = published_as
        self.problems: list[Problem] = []
        # Written in a format the duckdb CLI that set-up installs (duckdb-cli 1.5.x; the registry has no
        # 2.x CLI) can open: the 2.0 client's default storage version is newer than it reads.
        config = {} if self.database == ":memory:" else {"storage_compatibility_version": CLI_STORAGE_VERSION}
        self.con = duckdb.connect(self.database, config=config)
        try:
            self.refresh(scanned)
        except BaseException:
            self.con.close()
            raise

    def refresh(self, scanned: Scan | None = None) -> None:
        """The views rebuilt over `scanned` (by default, a scan of the root now)."""
        scanned = scanned or scan(self.root, self.verify)
        self.problems = list(scanned.problems)
        if self.published_as is not None:
            here, root = (str(p).replace("'", "''") for p in (self.published_as, self.root))
            self.con.execute(
                # any database of the connection: a notebook may ATTACH it under a name of its own
                (
                    "CREATE OR REPLACE MACRO cleaner_catalog_in_place() AS (SELECT CASE WHEN count(*) > 0 THEN true "
                    "ELSE error('this catalog was published as {here}, which no database open here is (a copied or "
                    "moved workspace?): its views read the shards under {root}. Run `cleaner inspect "
                    "storage.root=<the workspace it is in now>` to publish it there') END FROM duckdb_databases() "
                    "WHERE path = '{here}')"
                ).format(here=here, root=root)
            )
        # VIEWS_SQL's views are bound when created, each binding the views they name (thousands of files at 2,000
        # iterations) again: created over empty stand-ins (temporary: never in the file), they cost what they
        # cost over an empty store; every query binds them over the views as they are.
        self._views(Scan({view: [] for view in SOURCES}, []), stand_ins=True)
        self.con.execute(VIEWS_SQL)
        self._views(scanned)
        self._text_views(scanned)
        # The shards left out, in the file too: whoever opens it (cleaner view, a notebook) can name them.
        self.con.execute("CREATE OR REPLACE TABLE catalog_problems (path VARCHAR, message VARCHAR, committed BOOLEAN)")
        if self.problems:
            self.con.executemany(
                "INSERT INTO catalog_problems VALUES (?, ?, ?)",
                [(str(p.path), p.message, p.committed) for p in self.problems],
            )

    def _views(self, scanned: Scan, stand_ins: bool = False) -> None:
        """The views over the shards' files (and their summaries), one per SOURCES view."""
        for view, (_, schema) in SOURCES.items():
            shards = scanned.shards[view]
            files = [(path, shard.version) for shard in shards for path in shard.parts]
            if view in KINDS:  # metrics: the packs of its parts (storage/packs.py) instead of the parts they hold
                files = [f for some in scanned.unpacked(view, files) for f in some]
            partitioned = view in ("purified", "dead_letters")  # one partition per (mode, γ, measure)
            if view in SUMMARY_SQL:
                self._summary_view(view, shards, scanned, stand_ins)
            # One read per schema version, each binding only its first file's footer: union_by_name over every
            # file would read every footer each time a view over it is bound (seconds at 2,000 iterations);
            # versions are combined by column name (older ones get NULL for newer columns).
            versions: dict[str, list[str]] = {}
            for path, version in files:
                versions.setdefault(version, []).append(path)
            self._view(
                view,
                [
                    f"SELECT * FROM read_parquet({_sql_list(paths)}, hive_partitioning=false"
                    + (", filename=true)" if partitioned else ")")
                    for _, paths in sorted(versions.items(), key=lambda kv: kv[0] != schema_id(schema))
                ],
                schema,
                partitioned,
                stand_ins,
            )

    def _view(self, name: str, reads: list[str], schema: pa.Schema, partitioned: bool, stand_in: bool) -> None:
        """View `name` over these reads combined by column name, or over a typed empty table of `schema` when there
        are none. A partitioned view's reads carry each row's file name, which gives it its similarity measure and,
        in views of purified rows (those with `gamma`), its τ (`is_threshold`); their `gamma` holds γ alone, whatever
        version wrote the row (storage.schemas.GAMMA_ALONE_SQL)."""
        if reads:
            source = "(" + " UNION ALL BY NAME ".join(reads) + ")"
        else:
            source = _empty_table(self.con, name, schema, stand_in)
        select = "SELECT *"
        if partitioned:
            rows = "gamma" in schema.names
            excluded = ["filename"] if reads else []
            excluded += ["is_threshold"] if rows and "is_threshold" in schema.names else []
            select = (
                "SELECT *"
                + (f" EXCLUDE ({', '.join(excluded)})" if excluded else "")
                + (f" REPLACE ({GAMMA_ALONE_SQL} AS gamma)" if rows else "")
                + (f", {_MEASURE_SQL} AS measure" if reads else ", CAST(NULL AS VARCHAR) AS measure")
                + (
                    (f", {_TAU_SQL} AS is_threshold" if reads else ", CAST(NULL AS DOUBLE) AS is_threshold")
                    if rows
                    else ""
                )
            )
        self.con.execute(f"CREATE OR REPLACE VIEW {name} AS {select} FROM {source}{self._guard if reads else ''}")

    def _text_views(self, scanned: Scan) -> None:
        """`raw_texts`, `raw_attempt_texts` and `purified_texts`: the decoded text written beside each part at
        commit (storage/texts.py), keyed like the rows they decode; shards committed without text have no rows."""
        raw = [p for s in scanned.shards["raw_trajectories"] for p in s.texts]
        purified = [p for s in scanned.shards["purified"] for p in s.texts]
        raw_source = (
            f"read_parquet({_sql_list(raw)}, hive_partitioning=false)"
            if raw
            else _empty_table(self.con, "raw_texts", RAW_TEXT)
        )
        guard = self._guard if raw else ""
        self.con.execute(f"CREATE OR REPLACE VIEW raw_texts AS SELECT * EXCLUDE (attempts) FROM {raw_source}{guard}")
        self.con.execute(
            "CREATE OR REPLACE VIEW raw_attempt_texts AS SELECT run_id, iteration, prompt_id, sample_idx, "
            "a.position_idx AS position_idx, a.attempt_idx AS attempt_idx, a.turn_text AS turn_text, "
            "a.feedback_text AS feedback_text FROM (SELECT run_id, iteration, prompt_id, sample_idx, UNNEST(attempts) "
            f"AS a FROM {raw_source}{guard})"
        )
        self._view(
            "purified_texts",
            [f"SELECT * FROM read_parquet({_sql_list(purified)}, hive_partitioning=false, filename=true)"]
            if purified
            else [],
            PURIFIED_TEXT,
            True,
            False,
        )

    def _summary_view(self, view: str, shards: list[ShardFiles], scanned: Scan, stand_in: bool) -> None:
        """`<view>_summary`: the row summaries written at commit (their packs, storage/packs.py, and the files no
        pack holds); for shards committed without them, the same columns computed from their parts (SUMMARY_SQL)."""
        # the declared schema (summarizing an empty table to get it imported pandas: a second per process)
        name, summary_schema = (
            ("raw_summary", RAW_SUMMARY) if view == "raw_trajectories" else ("purified_summary", PURIFIED_SUMMARY)
        )
        loose, packed = scanned.unpacked(name, [(p, s.version) for s in shards if s.summaries for p in s.summaries])
        with_files = [p for p, _ in loose]
        parts_only = [p for s in shards if not s.summaries for p in s.parts]
        partitioned = view == "purified"  # its partition's measure, from the file's path as in `purified`
        options = "hive_partitioning=false" + (", filename=true" if partitioned else "")
        # a pack of purified summaries carries each row's file name (packs.FILENAME_KINDS); one read per version
        reads = [
            f"SELECT * FROM read_parquet({_sql_list([p for p, v in packed if v == version])}, hive_partitioning=false)"
            for version in sorted({v for _, v in packed})
        ]
        if with_files:
            reads.append(f"SELECT * FROM read_parquet({_sql_list(with_files)}, {options})")
        if parts_only:
            columns = SUMMARY_SQL[view] + (", filename" if partitioned else "")
            reads.append(f"SELECT {columns} FROM read_parquet({_sql_list(parts_only)}, union_by_name=true, {options})")
        self._view(name, reads, summary_schema, partitioned, stand_in)

    def query(self, sql: str) -> pa.Table:
        return self.con.sql(sql).to_arrow_table()

    def close(self) -> None:
        self.con.close()

    def __enter__(self) -> "Catalog":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _fingerprint(root: Path, scanned: Scan) -> str:
    """What a published file is built from: the root, the scan, this module's code and the schemas."""
    code = [
        Path(__file__).read_text(),
        duckdb.__version__,
        str(root),
        *map(
            str, (RAW_SUMMARY, PURIFIED_SUMMARY, RAW_TEXT, PURIFIED_TEXT, *(schema for _, schema in SOURCES.values()))
        ),
    ]
    return hashlib.blake2b(json.dumps([code, scanned.fingerprint()]).encode(), digest_size=16).hexdigest()


def _dead_publishers_files(database: Path) -> list[Path]:
    """What a publish killed with -9 left (`.catalog.duckdb.PID.tmp` and its `.wal`): the files of pids that no
    longer run. Each publisher removed only its own pid's, so a killed one's stayed for good."""
    out = []
    for path in database.parent.glob(f".{database.name}.*.tmp*"):
        pid = path.name[len(database.name) + 2 :].split(".", 1)[0]
        if not pid.isdigit() or int(pid) == os.getpid():
            continue
        try:
            os.kill(int(pid), 0)
        except ProcessLookupError:
            out.append(path)
        except PermissionError:
            pass  # another user's live process
    return out


def publish(root: Path, database: Path) -> list[Problem]:
    """Rebuild the catalog file: built under a temporary name beside it, then renamed over it (atomic).

    The published file is never opened here, so whoever holds it open keeps working (on the views it opened)
    and blocks nothing; the shards left out are returned. A file built from the same scan is kept: beside it,
    `.<name>.published` holds the identity of the file this function last renamed into place and what it was
    built from; any other file (written to since, renamed over it by another, copied) is rebuilt.

    Publishes of one file take turns (a flock on `.<name>.lock`), and each scans the root in its turn: two that ran
    at once renamed in the order they finished, and one that scanned before the other's commit (even one that had
    scanned before the other began) replaced its newer file, leaving committed shards out or naming files a gc had
    removed."""
    database = Path(database).resolve()
    # a read-only root goes on without its turn, as before turns: its stamp says the file is current
    with turn(database.with_name(f".{database.name}.lock"), at_most_s=PUBLISH_WAIT_S):
        return _publish(root, database, scan(root))


PUBLISH_WAIT_S = 120.0  # a publisher stopped (Ctrl-Z) or hung (a dead mount) holds its turn: then go on without it


def _publish(root: Path, database: Path, scanned: Scan) -> list[Problem]:
    stamp, fingerprint = database.with_name(f".{database.name}.published"), _fingerprint(Path(root).resolve(), scanned)
    with contextlib.suppress(OSError, ValueError):
        if json.loads(stamp.read_bytes()) == {"identity": identity(database), "fingerprint": fingerprint}:
            return list(scanned.problems)
    tmp = database.with_name(f".{database.name}.{os.getpid()}.tmp")
    leftovers = (tmp, tmp.with_name(tmp.name + ".wal"))
    for path in (*leftovers, *_dead_publishers_files(database)):
        path.unlink(missing_ok=True)
    try:
        with Catalog(root, tmp, scanned=scanned, published_as=database) as cat:
            problems = cat.problems
            cat.con.execute("CHECKPOINT")
        built = identity(tmp)
        os.replace(tmp, database)
        # a write-ahead log beside it is the replaced file's (a session that wrote into the catalog and did not
        # close): DuckDB would replay it into the new file and refuse every open ("WAL does not match database file")
        database.with_name(database.name + ".wal").unlink(missing_ok=True)
        published = identity(database)  # the rename changed its ctime; its inode says whether it is still ours
        if published[3] == built[3]:
            with contextlib.suppress(OSError):  # without it, the next publish rebuilds
                atomic_write_json(stamp, {"identity": published, "fingerprint": fingerprint})
    finally:
        for path in leftovers:
            path.unlink(missing_ok=True)
    return problems


def publish_quietly(root: Path, database: Path, warn: Callable[[str], None]) -> None:
    """`publish`, for callers that must not fail because of the catalog (a training flow): a failure is
    one warning, and the next commit or `cleaner inspect` publishes again."""
    try:
        publish(root, database)
    except Exception as e:  # noqa: BLE001 - the shards are committed whatever happens to their catalog
        first = first_line(e)
        warn(f"catalog {database} not refreshed ({first}); `cleaner inspect` rebuilds it")
