"""`cleaner report`: per-iteration numbers from the DuckDB catalog, PNG plots and one HTML page."""
from __future__ import annotations

import html
from pathlib import Path

from storage.catalog import Catalog
from storage.layout import RunLayout
from storage.shards import ShardError, ShardMissing

ITERATIONS_SQL = """
WITH raw AS (
  SELECT iteration, count(*) AS trajectories, avg(reward) AS mean_reward, avg((reward > 0)::INT) AS accuracy,
         avg(stats.first_attempt_failures) AS tool_errors_per_traj, avg(stats.tool_calls) AS tool_calls,
         avg(len(lived_ids)) AS response_tokens, sum(stats.generated_tokens) AS generated_tokens
  FROM raw_trajectories WHERE run_id = $run GROUP BY iteration
), failed AS (
  SELECT iteration, sum(turn_tokens + feedback_tokens) AS failed_attempt_tokens
  FROM raw_attempts WHERE run_id = $run AND status = 'failure' GROUP BY iteration
), upd AS (
  SELECT iteration, avg(value) FILTER (WHERE name = 'loss') AS update_loss,
         avg(value) FILTER (WHERE name = 'clip_ratio') AS clip_ratio
  FROM metrics WHERE run_id = $run AND stage = 'update' GROUP BY iteration
)
SELECT raw.*, coalesce(failed.failed_attempt_tokens, 0) / raw.generated_tokens AS failed_token_share,
       upd.update_loss, upd.clip_ratio
FROM raw LEFT JOIN failed USING (iteration) LEFT JOIN upd USING (iteration)
ORDER BY iteration
"""


def _q(cat: Catalog, sql: str, run_id: str) -> list[dict]:
    return cat.con.sql(sql, params={"run": run_id}).to_arrow_table().to_pylist()


def iteration_table(root: Path, run_id: str) -> list[dict]:
    with Catalog(root) as cat:
        return _q(cat, ITERATIONS_SQL, run_id)


def markdown_table(rows: list[dict]) -> str:
    if not rows:
        return "(no rows)"
    cols = list(rows[0])
    fmt = lambda v: f"{v:.4g}" if isinstance(v, float) else ("" if v is None else str(v))  # noqa: E731
    return "\n".join(["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
                     + ["| " + " | ".join(fmt(r[c]) for c in cols) + " |" for r in rows])


def write_report(root: Path, run_id: str, gamma: float = 0.5, out: Path | None = None) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    run_dir = RunLayout(root, run_id).run_dir
    if not run_dir.is_dir():
        raise ShardMissing(f"run {run_id!r} does not exist under {root} (no {run_dir}); check --run and storage.root")
    out = out or run_dir / "report"
    with Catalog(root) as cat:
        corrupt = [p for p in cat.problems if p.committed and run_dir in p.path.parents]
        if corrupt:  # plots without a damaged shard would misreport the run
            raise ShardError(f"{corrupt[0]} (the report would leave this shard out; restore or remove it)")
        its = _q(cat, ITERATIONS_SQL, run_id)
        sims = _q(cat, "SELECT gamma, kind, similarity FROM splices WHERE run_id = $run AND mode = 'saar'", run_id)
        compare = _q(cat, "SELECT * FROM purify_compare WHERE run_id = $run ORDER BY iteration, mode, gamma", run_id)
        for r in compare:  # DuckDB sums come back as decimals
            r.update({k: float(v or 0) for k, v in r.items() if k in ("splices", "shallow", "deep", "tokens_removed")})
    if not its:
        raise ShardMissing(f"run {run_id!r} has no committed raw shards under {root}")
    out.mkdir(parents=True, exist_ok=True)  # only once there is something to write: a refusal leaves nothing
    x = [r["iteration"] for r in its]
    figs = {}

    def save(name: str, fig) -> None:
        fig.tight_layout()
        fig.savefig(out / f"{name}.png", dpi=90)
        plt.close(fig)
        figs[name] = f"{name}.png"

    fig, ax = plt.subplots(figsize=(5, 3.2))
    ax.plot(x, [r["mean_reward"] for r in its], "o-", label="mean reward")
    ax.plot(x, [r["accuracy"] for r in its], "s-", label="accuracy")
    ax.set_xlabel("iteration"), ax.legend(), ax.set_title("reward and accuracy")
    save("reward_accuracy", fig)
    fig, ax = plt.subplots(figsize=(5, 3.2))
    ax.plot(x, [r["tool_errors_per_traj"] for r in its], "o-", color="tab:red")
    ax.set_xlabel("iteration"), ax.set_ylabel("first-attempt failures / trajectory"), ax.set_title("tool-error rate")
    save("tool_error_rate", fig)
    fig, ax = plt.subplots(figsize=(5, 3.2))
    at_gamma = [s["similarity"] for s in sims if abs(s["gamma"] - gamma) < 1e-9]
    ax.hist(at_gamma or [0], bins=20, range=(0, 1))
    ax.axvline(gamma, color="k", linestyle="--", label=f"γ = {gamma:g}")
    ax.set_xlabel("similarity of call segments"), ax.legend(), ax.set_title("splice similarity")
    save("similarity_hist", fig)
    gammas = sorted({s["gamma"] for s in sims})
    fig, ax = plt.subplots(figsize=(5, 3.2))
    for offset, kind in ((-0.2, "shallow"), (0.2, "deep")):
        ax.bar([i + offset for i in range(len(gammas))], [sum(s["kind"] == kind and s["gamma"] == g for s in sims)
                                                          for g in gammas], width=0.4, label=kind)
    ax.set_xticks(range(len(gammas)), [f"{g:g}" for g in gammas]), ax.set_xlabel("γ"), ax.legend()
    ax.set_title("shallow / deep splices per γ")
    save("shallow_deep", fig)
    fig, ax = plt.subplots(figsize=(5, 3.2))
    labels = [f"it{r['iteration']} {r['mode']} {r['gamma']:g}" for r in compare]
    ax.barh(labels, [r["raw_response_tokens"] for r in compare], alpha=0.5, label="raw")
    ax.barh(labels, [r["purified_response_tokens"] for r in compare], alpha=0.7, label="purified")
    ax.set_xlabel("mean response tokens"), ax.legend(), ax.set_title("raw vs purified length")
    save("lengths", fig)
    fig, ax = plt.subplots(figsize=(5, 3.2))
    ax.plot(x, [r["failed_token_share"] for r in its], "o-", color="tab:purple")
    ax.set_xlabel("iteration"), ax.set_ylabel("share of generated tokens"), ax.set_title("tokens spent on failed attempts")
    save("failed_tokens", fig)

    def table(rows: list[dict]) -> str:
        if not rows:
            return "<p>(none)</p>"
        head = "".join(f"<th>{html.escape(c)}</th>" for c in rows[0])
        body = "".join("<tr>" + "".join(f"<td>{v:.4g}</td>" if isinstance(v, float) else f"<td>{html.escape(str(v))}</td>"
                                        for v in r.values()) + "</tr>" for r in rows)
        return f"<table><tr>{head}</tr>{body}</table>"

    page = f"""<!doctype html><html><head><meta charset="utf-8"><title>cleaner report: {html.escape(run_id)}</title>
<style>body{{font-family:sans-serif;margin:2em}}table{{border-collapse:collapse}}td,th{{border:1px solid #ccc;padding:3px 6px}}
img{{margin:6px;border:1px solid #eee}}</style></head><body>
<h1>cleaner run <code>{html.escape(run_id)}</code></h1>
<h2>Per iteration</h2>{table(its)}
<h2>Plots</h2>{''.join(f'<img src="{f}" alt="{n}">' for n, f in figs.items())}
<h2>Raw vs purified (per mode and γ)</h2>{table(compare)}
</body></html>"""
    (out / "index.html").write_text(page)
    return out / "index.html"
