"""The DuckDB catalog: views over the committed Parquet parts of every run under a project root.

Views read the Parquet files in place; only parts listed in a manifest are included, so a stage
that crashed mid-way never shows up half-written. `refresh()` rebuilds the views after new shards.
"""
from __future__ import annotations

from pathlib import Path

import duckdb
import pyarrow as pa
import pyarrow.parquet as pq

from storage.schemas import DEAD_LETTER, METRICS, PURIFIED, RAW
from storage.shards import shard_files


def _committed(root: Path, pattern: str) -> list[Path]:
    files: list[Path] = []
    for manifest in sorted(Path(root).glob(pattern + "/_MANIFEST.json")):
        files.extend(shard_files(manifest.parent))
    return files


def _empty_parquet(root: Path, name: str, schema: pa.Schema) -> Path:
    # DuckDB cannot read an empty file list: a typed empty file keeps the view's columns.
    path = Path(root) / ".catalog" / f"empty-{name}.parquet"
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        pq.write_table(schema.empty_table(), path)
    return path


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
        self.con = duckdb.connect(self.database)
        self.refresh()

    def refresh(self) -> None:
        sources = {
            "raw_trajectories": ("runs/*/iteration=*/raw", RAW),
            "purified": ("runs/*/iteration=*/purified/mode=*/gamma=*", PURIFIED),
            "dead_letters": ("runs/*/iteration=*/dead_letter/mode=*/gamma=*", DEAD_LETTER),
            "metrics": ("runs/*/iteration=*/metrics/stage=*", METRICS),
        }
        for view, (pattern, schema) in sources.items():
            files = _committed(self.root, pattern) or [_empty_parquet(self.root, view, schema)]
            self.con.execute(
                f"CREATE OR REPLACE VIEW {view} AS SELECT * FROM read_parquet({_sql_list(files)}, union_by_name=true, hive_partitioning=false)"
            )
        self.con.execute(VIEWS_SQL)

    def query(self, sql: str) -> pa.Table:
        return self.con.sql(sql).to_arrow_table()

    def close(self) -> None:
        self.con.close()

    def __enter__(self) -> "Catalog":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
