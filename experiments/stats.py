"""Between-seed summaries and per-arm off-policy diagnostics for an experiment's page.

../shared/docs/EXPERIMENTS.md asks for the standard error *between training seeds* (not a binomial error over
tasks). The contrasts between arms, paired across seeds and corrected across a result, are experiments/contrasts.py.
"""

from __future__ import annotations

from math import sqrt
from pathlib import Path
from statistics import mean, stdev


def final_by_seed(results: list[dict], arm: str, metric: str, saar: bool, first: bool = False) -> dict[int, float]:
    """Seed → the metric at the arm's last (or first) evaluated checkpoint in that test mode; seeds whose
    evaluation did not record the metric (an older run, or a rate with nothing to count) are left out."""
    out = {}
    for r in results:
        if r["arm"] != arm:
            continue
        evals = sorted((e for e in r["evals"] if e["saar_at_test"] == saar), key=lambda e: e["iteration"])
        if evals and evals[0 if first else -1].get(metric) is not None:
            out[r["seed"]] = evals[0 if first else -1][metric]
    return out


def mean_se(values: list[float]) -> tuple[float, float]:
    """Mean and its standard error between seeds (nan with one seed: nothing to estimate it from)."""
    return mean(values), (stdev(values) / sqrt(len(values)) if len(values) > 1 else float("nan"))


def seeds_table(results: list[dict], arms: list[str], metrics: dict[str, str]) -> list[str]:
    """Per arm and metric (name → label), both test modes: the final checkpoint's mean ± between-seed s.e."""
    cols = [(m, saar) for m in metrics for saar in (False, True)]
    lines = [
        "| arm | seeds | " + " | ".join(f"{metrics[m]}, SAAR {'on' if saar else 'off'}" for m, saar in cols) + " |",
        "|---|---|" + "---|" * len(cols),
    ]
    for arm in arms:
        cells = []
        for metric, saar in cols:
            vals = list(final_by_seed(results, arm, metric, saar).values())
            if not vals:  # e.g. retry success with SAAR off at test: no retry to count
                cells.append("—")
                continue
            m, se = mean_se(vals)
            cells.append(f"{m:.3f}" + (f" ± {se:.3f}" if len(vals) > 1 else ""))
        seeds = sorted(r["seed"] for r in results if r["arm"] == arm)
        lines.append(f"| {arm} | {seeds} | " + " | ".join(cells) + " |")
    return lines


# Per run, over all iterations of the partition it trained on (its train.mode; each arm purifies only that).
_OFF_POLICY_SQL = """
WITH o AS (
    SELECT run_id, sum(tokens)::DOUBLE AS trained,
           (sum(tokens) FILTER (WHERE origin <> 'in_place'))::DOUBLE AS moved,
           sum(tokens * mean_abs_delta) FILTER (WHERE origin <> 'in_place') AS moved_abs,
           sum(tokens * kl_k3) FILTER (WHERE origin <> 'in_place') AS moved_kl,
           sum(tokens * beyond_bounds) AS beyond,
           sum(tokens * mean_abs_delta) FILTER (WHERE origin = 'in_place') AS in_place_abs,
           (sum(tokens) FILTER (WHERE origin = 'in_place'))::DOUBLE AS in_place,
           count(DISTINCT iteration) AS iterations
    FROM off_policy WHERE list_contains($runs, run_id) AND mode = $mode GROUP BY ALL
), s AS (
    SELECT run_id, count(*) AS splices FROM splices WHERE list_contains($runs, run_id) AND mode = $mode GROUP BY ALL
), r AS (  -- retries that carry a call after a model error: the rollbacks a SAAR-family mode decides
    SELECT a.run_id, count(*) AS rollbacks FROM raw_attempts a
    JOIN raw_attempts f ON f.run_id = a.run_id AND f.iteration = a.iteration AND f.prompt_id = a.prompt_id
         AND f.sample_idx = a.sample_idx AND f.position_idx = a.position_idx AND f.attempt_idx = 0
    WHERE list_contains($runs, a.run_id) AND a.attempt_idx > 0 AND a.code IS NOT NULL AND f.error_class = 'model'
    GROUP BY ALL
), f AS (
    SELECT run_id, sum(trained)::DOUBLE AS failed_trained FROM failed_call_advantage
    WHERE list_contains($runs, run_id) AND mode = $mode GROUP BY ALL
), k AS (  -- trajectories whose first call failed: their mean GRPO advantage and share with a positive one
    SELECT run_id, avg(advantage) AS failed_first_advantage, avg((advantage > 0)::INT) AS failed_first_positive
    FROM raw_kinds WHERE list_contains($runs, run_id) AND kind IN ('recovered', 'not_recovered') GROUP BY ALL
), m AS (
    SELECT run_id, avg(value) FILTER (WHERE name = 'correction_filtered') AS filtered
    FROM metrics WHERE list_contains($runs, run_id) AND stage = 'update' GROUP BY ALL
)
SELECT o.*, coalesce(s.splices, 0) AS splices, r.rollbacks, f.failed_trained, k.failed_first_advantage,
       k.failed_first_positive, m.filtered
FROM o LEFT JOIN s USING (run_id) LEFT JOIN r USING (run_id) LEFT JOIN f USING (run_id)
LEFT JOIN k USING (run_id) LEFT JOIN m USING (run_id)
"""

_COLUMNS = [  # (header, value of one run's row); each cell is the mean over seeds ± between-seed s.e.
    ("trained tokens / iteration", lambda r: r["trained"] / r["iterations"]),
    ("moved share", lambda r: (r["moved"] or 0) / r["trained"]),
    ("mean abs Δ, moved (nats)", lambda r: r["moved_abs"] / r["moved"] if r["moved"] else None),
    ("KL k3, moved", lambda r: r["moved_kl"] / r["moved"] if r["moved"] else None),
    ("beyond [0.5, 2], all", lambda r: r["beyond"] / r["trained"]),
    ("mean abs Δ, in place", lambda r: r["in_place_abs"] / r["in_place"] if r["in_place"] else None),
    ("replaced / rollbacks", lambda r: r["splices"] / r["rollbacks"] if r["rollbacks"] else None),
    ("failed-call share of trained", lambda r: (r["failed_trained"] or 0) / r["trained"]),
    ("adv. of failed-first", lambda r: r["failed_first_advantage"]),
    ("positive share of failed-first", lambda r: r["failed_first_positive"]),
    ("correction filtered", lambda r: r["filtered"]),
]


# EXPERIMENTS.md's premise figures, per iteration of one run and the mode it trained on (every partition of that mode:
# an experiment's arm purifies the one it trains on): the mean GRPO advantage
# of trajectories whose first call failed, the share of them with a positive one, and the share of trained tokens
# that lie on failed calls. Recorded into each result when its run ends (experiments/run.py): the run's store may
# not outlive the experiment, and the page's all-iteration means hide how they move.
_PREMISE_SQL = """
WITH o AS (
    SELECT iteration, sum(tokens)::DOUBLE AS trained FROM off_policy
    WHERE run_id = $run AND mode = $mode GROUP BY ALL
), f AS (
    SELECT iteration, sum(trained)::DOUBLE AS failed_trained FROM failed_call_advantage
    WHERE run_id = $run AND mode = $mode GROUP BY ALL
), k AS (
    SELECT iteration, avg(advantage) AS failed_first_advantage, avg((advantage > 0)::INT) AS failed_first_positive
    FROM raw_kinds WHERE run_id = $run AND kind IN ('recovered', 'not_recovered') GROUP BY ALL
)
SELECT o.iteration, k.failed_first_advantage, k.failed_first_positive,
       coalesce(f.failed_trained, 0) / o.trained AS failed_call_share_of_trained
FROM o LEFT JOIN f USING (iteration) LEFT JOIN k USING (iteration) ORDER BY o.iteration
"""


def premise_by_iteration(root: Path, run_id: str, mode: str) -> list[dict]:
    """The premise figures of `run_id`, one row per iteration of its `mode` partition."""
    from storage.catalog import Catalog

    with Catalog(root) as cat:
        return cat.con.sql(_PREMISE_SQL, params={"run": run_id, "mode": mode}).to_arrow_table().to_pylist()


PREMISE_FIGURES = (
    ("failed_first_advantage", "adv. of failed-first"),
    ("failed_first_positive", "positive share of failed-first"),
    ("failed_call_share_of_trained", "failed-call share of trained"),
)


def between_seeds(values: list[float | None]) -> str:
    """A table cell: the mean of the seeds' values ± their standard error ("—" when none has one)."""
    vals = [v for v in values if v is not None]
    if not vals:
        return "—"
    m, se = mean_se(vals)
    return f"{m:.4f}" + (f" ± {se:.4f}" if len(vals) > 1 else "")


def premise_table(results: list[dict], arms: list[str]) -> list[str]:
    """The premise figures per arm and iteration, mean ± s.e. between seeds, from what each run recorded."""
    if any("premise" in r for r in results) and not any(r.get("premise") for r in results):
        return ["(recorded, but the catalog held no rows of the partitions the arms trained on)"]
    if not any(r.get("premise") for r in results):
        return [
            "(not recorded: these results predate the per-iteration record, which experiments/run.py keeps with "
            "each result since 2026-12-07; the all-iteration means above are what the run's catalog gave)"
        ]
    lines = [
        "| arm | iteration | seeds | " + " | ".join(h for _, h in PREMISE_FIGURES) + " |",
        "|---|---|---|" + "---|" * len(PREMISE_FIGURES),
    ]
    for arm in arms:
        by_iteration: dict[int, list[dict]] = {}
        for r in results:
            if r["arm"] == arm:
                for row in r.get("premise") or []:
                    by_iteration.setdefault(row["iteration"], []).append(row)
        for iteration, rows in sorted(by_iteration.items()):
            cells = [between_seeds([row.get(key) for row in rows]) for key, _ in PREMISE_FIGURES]
            lines.append(f"| {arm} | {iteration} | {len(rows)} | " + " | ".join(cells) + " |")
    return lines


def off_policy_rows(root: Path, runs: list[str], mode: str) -> list[dict]:
    from storage.catalog import Catalog

    with Catalog(root) as cat:
        return cat.con.sql(_OFF_POLICY_SQL, params={"runs": runs, "mode": mode}).to_arrow_table().to_pylist()


def off_policy_table(results: list[dict], modes: dict[str, str], root: Path) -> list[str]:
    """The §4 diagnostics per arm, from the partitions each arm trained on, over all its iterations."""
    lines = ["| arm | mode | " + " | ".join(h for h, _ in _COLUMNS) + " |", "|---|---|" + "---|" * len(_COLUMNS)]
    for arm, mode in modes.items():
        runs = sorted(r["run_id"] for r in results if r["arm"] == arm)
        try:
            rows = off_policy_rows(root, runs, mode)
        except Exception as e:  # noqa: BLE001 - a diagnostics row is a bonus; say why it is missing
            lines.append(f"| {arm} | {mode} | (unavailable: {e}) |")
            continue
        cells = [between_seeds(list(map(value, rows))) for _, value in _COLUMNS]
        lines.append(f"| {arm} | {mode} | " + " | ".join(cells) + " |")
    return lines
