"""The DuckDB catalog: views over the committed Parquet parts of every run under a project root.

Views read the Parquet files in place; only parts listed in a manifest are included, so a stage
that crashed mid-way never shows up half-written, and every part is validated against its manifest
first (size, crc32, schema version, columns, rows; storage.shards.check_part). A shard that fails, or
one with parts but no manifest, is left out of the views and listed in `Catalog.problems`, which
`cleaner inspect` prints and `cleaner report` refuses. `refresh()` rebuilds the views after new shards.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import duckdb
import pyarrow as pa

from storage.schemas import DEAD_LETTER, METRICS, PURIFIED, RAW
from storage.shards import MANIFEST, PART_GLOB, ShardError, check_part, committed_manifest

# Parts validated by this process, by (path, size, mtime): a flow refreshes the catalog every iteration
# and must not re-read every earlier shard each time. A changed file has another size or mtime.
_VERIFIED: set[tuple[str, int, int]] = set()


@dataclass(frozen=True)
class Problem:
    """A shard left out of the views: corrupt (committed but failing validation) or not committed."""

    path: Path
    message: str
    committed: bool

    def __str__(self) -> str:
        return self.message


def _validated_files(directory: Path, schema: pa.Schema) -> list[Path]:
    manifest = committed_manifest(directory, schema)
    files = []
    for part in manifest.parts:
        path = directory / part.name
        st = path.stat() if path.is_file() else None
        key = (str(path), st.st_size, st.st_mtime_ns) if st else None
        if key not in _VERIFIED:
            check_part(directory, part, schema)
            _VERIFIED.add((str(path), path.stat().st_size, path.stat().st_mtime_ns))
        files.append(path)
    return files


def _scan(root: Path, pattern: str, schema: pa.Schema, problems: list[Problem]) -> list[Path]:
    files: list[Path] = []
    for directory in sorted(p for p in Path(root).glob(pattern) if p.is_dir()):
        if not (directory / MANIFEST).is_file():
            if any(directory.glob(PART_GLOB)) or any(directory.glob(".part-*")):
                problems.append(Problem(directory, f"{directory}: not committed (no {MANIFEST}: its stage is "
                                        "writing it or crashed before committing; rerun the stage)", False))
            continue
        try:
            files.extend(_validated_files(directory, schema))
        except (ShardError, OSError) as e:
            problems.append(Problem(directory, str(e), True))
    return files


def _empty_table(con: duckdb.DuckDBPyConnection, name: str, schema: pa.Schema) -> str:
    # DuckDB cannot read an empty file list: a typed empty table (kept inside the catalog, so nothing is
    # written beside the shards) gives the view its columns.
    table = f"_empty_{name}"
    empty = schema.empty_table()  # noqa: F841 - read by DuckDB through the Python frame
    con.execute(f"CREATE OR REPLACE TABLE {table} AS SELECT * FROM empty")
    return table


def _sql_list(paths: list[Path]) -> str:
    return "[" + ", ".join("'" + str(p).replace("'", "''") + "'" for p in paths) + "]"


VIEWS_SQL = """
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
SELECT run_id, iteration, prompt_id, sample_idx, mode, gamma, s.position_idx AS position_idx,
       s.attempt_idx AS attempt_idx, s.kind AS kind, s.similarity AS similarity,
       s.tokens_removed AS tokens_removed, s.first_recomputed AS first_recomputed, s.split_failed AS split_failed
FROM (SELECT run_id, iteration, prompt_id, sample_idx, mode, gamma, UNNEST(splices) AS s FROM purified);

CREATE OR REPLACE VIEW purify_compare AS
SELECT p.run_id, p.iteration, p.mode, p.gamma,
       count(*) AS trajectories,
       avg(len(r.lived_ids)) AS raw_response_tokens,
       avg(len(p.response_ids)) AS purified_response_tokens,
       avg(list_sum(p.loss_mask)) AS trained_tokens,
       sum(len(p.splices)) AS splices,
       sum(len(list_filter(p.splices, lambda s: s.kind = 'shallow'))) AS shallow,
       sum(len(list_filter(p.splices, lambda s: s.kind = 'deep'))) AS deep,
       sum(list_sum(list_transform(p.splices, lambda s: s.tokens_removed))) AS tokens_removed,
       avg(p.tokens_forwarded) AS tokens_forwarded,
       avg(p.reward) AS mean_reward
FROM purified p JOIN raw_trajectories r
  ON p.run_id = r.run_id AND p.iteration = r.iteration AND p.prompt_id = r.prompt_id AND p.sample_idx = r.sample_idx
GROUP BY ALL
ORDER BY ALL;
"""


class Catalog:
    """A DuckDB file (or in-memory database) whose views read a project root's shards."""

    def __init__(self, root: Path, database: str | Path | None = None) -> None:
        self.root = Path(root)
        self.database = str(database) if database is not None else ":memory:"
        self.problems: list[Problem] = []
        self.con = duckdb.connect(self.database)
        try:
            self.refresh()
        except BaseException:
            self.con.close()
            raise

    def refresh(self) -> None:
        sources = {
            "raw_trajectories": ("runs/*/iteration=*/raw", RAW),
            "purified": ("runs/*/iteration=*/purified/mode=*/gamma=*", PURIFIED),
            "dead_letters": ("runs/*/iteration=*/dead_letter/mode=*/gamma=*", DEAD_LETTER),
            "metrics": ("runs/*/iteration=*/metrics/stage=*", METRICS),
        }
        self.problems = []
        for view, (pattern, schema) in sources.items():
            files = _scan(self.root, pattern, schema, self.problems)
            source = (f"read_parquet({_sql_list(files)}, union_by_name=true, hive_partitioning=false)" if files
                      else _empty_table(self.con, view, schema))
            self.con.execute(f"CREATE OR REPLACE VIEW {view} AS SELECT * FROM {source}")
        self.con.execute(VIEWS_SQL)

    def query(self, sql: str) -> pa.Table:
        return self.con.sql(sql).to_arrow_table()

    def close(self) -> None:
        self.con.close()

    def __enter__(self) -> "Catalog":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
