"""An iteration's trajectory table and its filters, as SQL on the iteration's catalog (flows/viewer/store.py).

Every filter value reaches DuckDB as a bound parameter, never as SQL text. Kinds and advantages are the
catalog's `raw_kinds` (each row's GRPO advantage in its prompt group; every mode's but roc's); with a
partition chosen, its rows' own advantage and splices are used instead.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from flows.report_tables import partition_key, partition_label
from flows.viewer.store import Scope

KINDS = ("clean", "recovered", "not_recovered", "infra")
ADVANTAGES = ("positive", "negative", "zero")
SPLICED = ("yes", "no")
MAX_ROWS = 2000


@dataclass
class Filters:
    kind: str = ""
    label: str = ""
    partition: str = ""
    spliced: str = ""  # "yes" | "no" | ""
    reward_min: float | None = None
    reward_max: float | None = None
    advantage: str = ""  # positive | negative | zero | ""
    q: str = ""


def filters(
    parts: list[dict[str, Any]],
    *,
    kind: str = "",
    label: str = "",
    partition: str = "",
    spliced: str = "",
    reward_min: str = "",
    reward_max: str = "",
    advantage: str = "",
    q: str = "",
) -> Filters:
    """The table's filters from a page's query string: ValueError naming the first value the table does not know
    (a value ignored would show rows the page says it filtered). An error label unseen in this iteration is no
    error: no row has it."""
    for name, value, known in (
        ("kind", kind, KINDS),
        ("spliced", spliced, SPLICED),
        ("advantage", advantage, ADVANTAGES),
        ("partition", partition, [p["key"] for p in parts]),
    ):
        if value and value not in known:
            raise ValueError(f"unknown {name} {value!r}: one of {', '.join(known) or '(none in this iteration)'}")
    bounds: dict[str, float | None] = {}
    for name, value in (("reward_min", reward_min), ("reward_max", reward_max)):
        try:
            bound = float(value) if value.strip() else None
        except ValueError:
            bound = math.nan
        if bound is not None and not math.isfinite(bound):
            raise ValueError(f"{name} {value!r} is not a number")
        bounds[name] = bound
    return Filters(kind=kind, label=label, partition=partition, spliced=spliced, advantage=advantage, q=q, **bounds)


def named(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Rows of partitions (mode, gamma, is_threshold, measure, …) with the partition's URL key and label."""
    return [{"key": partition_key(r), "label": partition_label(r), **r} for r in rows]


def partitions(scope: Scope) -> list[dict[str, Any]]:
    return named(scope.rows("SELECT DISTINCT mode, gamma, is_threshold, measure FROM purified_summary ORDER BY ALL"))


def labels(scope: Scope) -> list[str]:
    return [
        r["error_label"]
        for r in scope.rows("SELECT DISTINCT error_label FROM raw_attempts WHERE error_label IS NOT NULL ORDER BY 1")
    ]


TABLE_SQL = """
WITH att AS (
    SELECT prompt_id, sample_idx, count(*) AS attempts, count(*) FILTER (WHERE status = 'failure') AS failures,
           string_agg(DISTINCT error_label, ', ' ORDER BY error_label) AS labels,
           bool_or(error_label = $label) AS has_label
    FROM raw_attempts GROUP BY ALL
), part AS (
    -- one row per trajectory in a chosen partition; with none chosen, the most splices any partition made
    SELECT prompt_id, sample_idx, max(splices)::BIGINT AS splices, any_value(advantage) AS advantage
    FROM purified_summary
    WHERE $partition = '' OR (mode = $mode AND gamma = $gamma AND is_threshold IS NOT DISTINCT FROM $tau
                              AND measure IS NOT DISTINCT FROM $measure)
    GROUP BY ALL
), hits AS (
    SELECT DISTINCT prompt_id, sample_idx FROM (
        SELECT prompt_id, sample_idx FROM raw_trajectories WHERE contains(lower(question), $q)
        UNION ALL SELECT prompt_id, sample_idx FROM raw_attempts
            WHERE contains(lower(code), $q) OR contains(lower(tool_text), $q)
        UNION ALL SELECT prompt_id, sample_idx FROM raw_attempt_texts
            WHERE contains(lower(turn_text), $q) OR contains(lower(feedback_text), $q)
        UNION ALL SELECT prompt_id, sample_idx FROM raw_texts WHERE contains(lower(response_text), $q)
        UNION ALL SELECT prompt_id, sample_idx FROM purified_texts WHERE contains(lower(response_text), $q)
            AND ($partition = '' OR (mode = $mode AND gamma = $gamma AND is_threshold IS NOT DISTINCT FROM $tau
                                     AND measure IS NOT DISTINCT FROM $measure)))
    WHERE $q <> ''
), rows AS (
    SELECT k.prompt_id, k.sample_idx, k.kind, k.reward,
           CASE WHEN $partition = '' THEN k.advantage ELSE p.advantage END AS advantage,
           coalesce(a.attempts, 0) AS attempts, coalesce(a.failures, 0) AS failures, a.labels,
           coalesce(a.has_label, false) AS has_label, coalesce(p.splices, 0) AS splices,
           p.prompt_id IS NOT NULL AS in_part,
           s.response_tokens
    FROM raw_kinds k LEFT JOIN att a USING (prompt_id, sample_idx) LEFT JOIN part p USING (prompt_id, sample_idx)
    LEFT JOIN raw_summary s USING (prompt_id, sample_idx)
    LEFT JOIN (SELECT *, true AS hit FROM hits) h USING (prompt_id, sample_idx)
    WHERE $q = '' OR h.hit
)
SELECT * EXCLUDE (has_label, in_part), count(*) OVER () AS matching FROM rows
WHERE ($kind = '' OR kind = $kind)
  AND ($label = '' OR has_label)
  AND ($partition = '' OR in_part)
  AND ($spliced = '' OR ($spliced = 'yes') = (splices > 0))
  AND ($reward_min IS NULL OR reward >= $reward_min)
  AND ($reward_max IS NULL OR reward <= $reward_max)
  AND ($advantage = '' OR ($advantage = 'positive' AND advantage > 0) OR ($advantage = 'negative' AND advantage < 0)
       OR ($advantage = 'zero' AND advantage = 0))
ORDER BY prompt_id, sample_idx
LIMIT $limit
"""


def trajectories(scope: Scope, f: Filters, parts: list[dict[str, Any]]) -> tuple[list[dict[str, Any]], int]:
    """(rows matching the filters, at most MAX_ROWS; how many match in all)."""
    chosen = next((p for p in parts if p["key"] == f.partition), None)
    rows = scope.rows(
        TABLE_SQL,
        kind=f.kind,
        label=f.label,
        partition=f.partition if chosen else "",
        mode=chosen["mode"] if chosen else "",
        gamma=chosen["gamma"] if chosen else 0.0,
        tau=chosen["is_threshold"] if chosen else None,
        measure=chosen["measure"] if chosen else None,
        spliced=f.spliced,
        reward_min=f.reward_min,
        reward_max=f.reward_max,
        advantage=f.advantage,
        q=f.q.lower().strip(),
        limit=MAX_ROWS,
    )
    return rows, (rows[0]["matching"] if rows else 0)
