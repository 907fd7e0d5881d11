"""`cleaner report`: per-iteration numbers from the DuckDB catalog, PNG plots and one HTML page that states
the token-level hypothesis (flows/premise.py TOKEN_RULE) per purification mode of the run, with the coarse rule marked
as disproved, the tables the rules read, and links to `cleaner view`'s pages (HTML pieces:
flows/report_tables.py)."""

from __future__ import annotations

import html
import json
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator
from urllib.parse import quote

from flows.premise import cell, premise_rows
from flows.report_tables import (
    STYLE,
    by_partition,
    iteration_href,
    link,
    partition_label,
    rule_section,
    table,
    viewer_note,
)
from pipeline.config import upgrade_frozen
from pipeline.modes import IS_MODES, SPLICING_MODES
from storage.catalog import Catalog
from storage.layout import DEFAULT_MEASURE_KEY, RunLayout, missing_run
from storage.shards import ShardError, ShardMissing

ITERATIONS_SQL = """
WITH raw AS (
  SELECT iteration, count(*) AS trajectories, avg(reward) AS mean_reward, avg((reward > 0)::INT) AS accuracy,
         avg(stats.first_attempt_failures) AS first_call_failures_per_trajectory, avg(stats.tool_calls) AS tool_calls,
         avg(response_tokens) AS response_tokens, sum(stats.generated_tokens) AS generated_tokens,
         sum(failed_attempt_tokens) AS failed_attempt_tokens
  FROM raw_summary WHERE run_id = $run GROUP BY iteration
), upd AS (
  SELECT iteration, avg(value) FILTER (WHERE name = 'loss') AS update_loss,
         avg(value) FILTER (WHERE name = 'clip_ratio') AS clip_ratio,
         avg(value) FILTER (WHERE name = 'entropy') AS entropy,
         avg(value) FILTER (WHERE name = 'correction_filtered') AS correction_filtered,
         avg(value) FILTER (WHERE name = 'behaviour_kl') AS behaviour_kl,
         avg(value) FILTER (WHERE name = 'dpo_loss') AS dpo_loss,
         sum(value) FILTER (WHERE name = 'dpo_pairs') AS dpo_pairs,
         avg(value) FILTER (WHERE name = 'dpo_capped') AS dpo_capped
  FROM metrics WHERE run_id = $run AND stage = 'update' GROUP BY iteration
)
SELECT raw.* EXCLUDE (failed_attempt_tokens),
       raw.failed_attempt_tokens / raw.generated_tokens AS failed_tokens_per_generated,
       upd.* EXCLUDE (iteration)
FROM raw LEFT JOIN upd USING (iteration)
ORDER BY iteration
"""
# update metrics written only when their option was on (trainer/inputs.py OPTIONAL_METRICS, train.log_entropy): a
# column no iteration has is left out of the table
OPTIONAL_COLUMNS = ("entropy", "correction_filtered", "behaviour_kl", "dpo_loss", "dpo_pairs", "dpo_capped")


def _q(cat: Catalog, sql: str, run_id: str) -> list[dict]:
    return cat.con.sql(sql, params={"run": run_id}).to_arrow_table().to_pylist()


def iteration_table(root: Path, run_id: str) -> list[dict]:
    with Catalog(root) as cat:
        return iteration_rows(cat, run_id)


def iteration_rows(cat: Catalog, run_id: str) -> list[dict]:
    """One row per iteration: the rollout's figures and the update's means (optional ones when measured)."""
    rows = _q(cat, ITERATIONS_SQL, run_id)
    absent = [c for c in OPTIONAL_COLUMNS if all(r[c] is None for r in rows)]
    return [{k: v for k, v in r.items() if k not in absent} for r in rows]


# Example trajectories per purified partition and advantage sign (two each) whose failed calls the partition
# stops training: a splice over a failed call, or mask_failed's recovered correct rows (the conditions of
# storage/catalog.py failed_call_advantage).
EXAMPLES_SQL = """
SELECT * EXCLUDE (n) FROM (
  SELECT p.iteration, p.mode, p.gamma, p.is_threshold, p.measure, p.prompt_id, p.sample_idx, p.advantage,
         row_number() OVER (PARTITION BY p.mode, p.gamma, p.is_threshold, p.measure, p.advantage < 0
                            ORDER BY p.iteration, p.prompt_id, p.sample_idx) AS n
  FROM purified_summary p JOIN raw_kinds k USING (run_id, iteration, prompt_id, sample_idx)
  WHERE p.run_id = $run AND k.kind IN ('recovered', 'not_recovered') AND p.advantage <> 0 AND p.trained_tokens > 0
    AND (p.splices > 0 OR (p.mode = 'mask_failed' AND k.kind = 'recovered' AND p.reward > 0))
) WHERE n <= 2 ORDER BY ALL
"""
EVAL_SQL = "SELECT iteration, name, value FROM metrics WHERE run_id = $run AND stage = 'eval' ORDER BY ALL"


def eval_curves(rows: list[dict]) -> list[dict]:
    """Per evaluated checkpoint (flow.eval_every; metric names in rollout_gen/eval_stage.py), over all held-out
    tasks: avg@k pass@1 with its standard error, the largest pass@k, tool failures per trajectory; SAAR at test
    time on and off. Every row has every column (None where a setting was not evaluated)."""
    by_it: dict[int, dict[str, float | None]] = {}
    for r in rows:
        by_it.setdefault(r["iteration"], {})[r["name"]] = r["value"]
    out = []
    for it, m in sorted(by_it.items()):
        ks = sorted({int(n.rsplit("@", 1)[1]) for n in m if "/all/pass@" in n and not n.endswith("_se")})
        row: dict = {"iteration": it, "largest k": ks[-1] if ks else None}
        for s in ("saar_on", "saar_off"):
            row[f"{s} pass@1"] = m.get(f"{s}/all/pass@1")
            row[f"{s} pass@1 se"] = m.get(f"{s}/all/pass@1_se")
            row[f"{s} pass@largest k"] = m.get(f"{s}/all/pass@{ks[-1]}") if ks else None
            row[f"{s} tool failures/traj"] = m.get(f"{s}/all/tool_failures_per_trajectory")
        out.append(row)
    return out


def markdown_table(rows: list[dict]) -> str:
    if not rows:
        return "(no rows)"
    cols = list(rows[0])
    return "\n".join(
        ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
        + ["| " + " | ".join(cell(r[c]) for c in cols) + " |" for r in rows]
    )


CAPTIONS = {
    "reward_accuracy": "Mean reward and accuracy (reward > 0) of the iteration's rollouts, sampled from the "
    "policy the previous update produced.",
    "tool_error_rate": "Failed first attempts per trajectory (tool calls whose code raised or timed out).",
    "similarity_hist": "Similarity of failed and retried call segments at every splice, per similarity measure; "
    "the dashed line is the trained γ (splices at or above it are shallow).",
    "shallow_deep": "Shallow and deep splices per purified iteration, for every γ and measure purified "
    "(counts averaged over the iterations purified at that γ, so replays of one iteration "
    "compare with training at every iteration).",
    "lengths": "Mean response tokens per iteration: raw (as lived, with failed attempts and errors) and after "
    "each purification variant.",
    "failed_tokens": (
        "Failed attempts' tokens (the whole failed turn, reasoning and call, and its error feedback) per generated "
        "token; above 1 "
        "when error messages are longer than what the model wrote."
    ),
    "eval_pass1": "Held-out avg@k pass@1 of checkpoint i (the policy iteration i rolls out from; flow.eval_every), "
    "SAAR at test time on and off; bars: ± one standard error over tasks.",
    "eval_tool_errors": "Failed tool executions (retries included) per held-out trajectory of checkpoint i, SAAR at "
    "test time on and off.",
    "update_options": "What the update's options did, per iteration (means over its optimizer steps): "
    "train.rollout_correction's share of trained tokens masked or clipped and log(π_behaviour / π_old) over them "
    "(k1, may be < 0); train.use_dpo_on_tool_calls' side loss −log σ(β·Δ) and the share of pairs at its cap.",
    "is_ratio": "Importance ratio of every splice: π(moved retry | purified context) / π_b(retry | as sampled), "
    "log10; left of the dashed line a splice trains its retry at less than half the probability it "
    "was sampled with (Plan B, mode saar_is, would append it at τ = 0.5; the dashed line is the run's τ).",
}


def run_thresholds(run_json: Path) -> tuple[float, float]:
    """(γ, τ) the report marks, from the run's frozen config: the trained threshold for its kind of mode (train.gamma
    is γ for saar / saar_correct, τ for saar_is), else the first purified one; (0.5, 0.5) without run.json."""
    frozen = upgrade_frozen(json.loads(run_json.read_text())) if run_json.is_file() else {}
    train, purify = frozen.get("train", {}), frozen.get("purify", {})
    gamma = train.get("gamma", 0.5) if train.get("mode") in SPLICING_MODES else (purify.get("gammas") or [0.5])[0]
    tau = train.get("tau", 0.5) if train.get("mode") in IS_MODES else (purify.get("is_thresholds") or [0.5])[0]
    return gamma, tau


def _variant(r: dict) -> str:
    return partition_label(r)


# the update_options plot's curves, drawn for the metrics the run measured
UPDATE_CURVES = (
    ("correction_filtered", "correction: tokens filtered"),
    ("behaviour_kl", "correction: behaviour KL (k1)"),
    ("dpo_loss", "DPO side loss"),
    ("dpo_capped", "DPO: pairs at the cap"),
)


def write_report(root: Path, run_id: str, out: Path | None = None) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.axes import Axes
    from matplotlib.ticker import MaxNLocator

    layout = RunLayout(root, run_id)
    run_dir = layout.run_dir
    missing = missing_run(root, run_id)
    if missing:
        raise ShardMissing(missing)
    out = out or run_dir / "report"
    gamma, tau = run_thresholds(layout.run_json)
    with Catalog(root) as cat:
        corrupt = [p for p in cat.problems if p.committed and run_dir in p.path.parents]
        if corrupt:  # plots without a damaged shard would misreport the run
            raise ShardError(f"{corrupt[0]} (the report would leave this shard out; restore or remove it)")
        its = iteration_rows(cat, run_id)
        sims = _q(
            cat,
            "SELECT iteration, gamma, measure, kind, similarity FROM splices WHERE run_id = $run AND mode = 'saar'",
            run_id,
        )
        compare = _q(
            cat,
            "SELECT * FROM purify_compare WHERE run_id = $run ORDER BY iteration, mode, gamma, is_threshold, measure",
            run_id,
        )
        kinds, failed_calls = premise_rows(cat, run_id)
        examples = _q(cat, EXAMPLES_SQL, run_id)
        off_policy = _q(
            cat,
            "SELECT iteration, mode, gamma, is_threshold, measure, origin, tokens, mean_abs_delta, "
            "kl_k3, beyond_bounds FROM off_policy WHERE run_id = $run ORDER BY ALL",
            run_id,
        )
        ratios = _q(
            cat,
            "SELECT mode, gamma, is_threshold, log_is_ratio FROM splices WHERE run_id = $run "
            "AND log_is_ratio IS NOT NULL AND NOT isnan(log_is_ratio)",
            run_id,
        )
        curves = eval_curves(_q(cat, EVAL_SQL, run_id))
        for r in compare:  # DuckDB sums come back as decimals
            r.update({k: float(v or 0) for k, v in r.items() if k in ("splices", "shallow", "deep", "tokens_removed")})
    if not its:
        raise ShardMissing(f"run {run_id!r} has no committed raw shards under {root}")
    out.mkdir(parents=True, exist_ok=True)  # only once there is something to write: a refusal leaves nothing
    x = [r["iteration"] for r in its]
    figs: list[str] = []  # the plots written, in page order

    @contextmanager
    def plot(name: str, title: str, ylabel: str, xlabel: str = "iteration") -> Iterator[Axes]:
        """Axes for the plot `name`, saved as name.png when the block ends."""
        fig, ax = plt.subplots(figsize=(5.5, 3.4))
        ax.set_title(title), ax.set_xlabel(xlabel), ax.set_ylabel(ylabel)
        if xlabel == "iteration":
            ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        yield ax
        fig.tight_layout()
        fig.savefig(out / f"{name}.png", dpi=90)
        plt.close(fig)
        figs.append(name)

    with plot("reward_accuracy", "reward and accuracy", "reward (−1…1) / accuracy (0…1)") as ax:
        ax.plot(x, [r["mean_reward"] for r in its], "o-", label="mean reward")
        ax.plot(x, [r["accuracy"] for r in its], "s-", label="accuracy")
        ax.set_ylim(-1.05, 1.05), ax.legend()  # the whole range: small changes are not blown up
    with plot("tool_error_rate", "tool-error rate", "failed first attempts / trajectory") as ax:
        ax.plot(x, [r["first_call_failures_per_trajectory"] for r in its], "o-", color="tab:red")
        ax.set_ylim(0, max(1.0, max(r["first_call_failures_per_trajectory"] or 0 for r in its) * 1.1))
    with plot("similarity_hist", "splice similarity", "splices", xlabel="similarity of failed and retried calls") as ax:
        for measure in sorted({s["measure"] for s in sims}):
            ax.hist(
                [s["similarity"] for s in sims if s["measure"] == measure and abs(s["gamma"] - gamma) < 1e-9]
                or [s["similarity"] for s in sims if s["measure"] == measure],
                bins=20,
                range=(0, 1),
                alpha=0.6,
                label=measure,
            )
        ax.axvline(gamma, color="k", linestyle="--", label=f"γ = {gamma:g}")
        ax.set_xlim(0, 1), ax.legend(fontsize=8)
    variants = sorted({(s["gamma"], s["measure"]) for s in sims})
    with plot(
        "shallow_deep", "shallow / deep splices per purified iteration", "splices per iteration", xlabel="γ (measure)"
    ) as ax:
        for offset, kind in ((-0.2, "shallow"), (0.2, "deep")):
            means = []
            for g, m in variants:
                iterations = {
                    r["iteration"] for r in compare if r["mode"] == "saar" and r["gamma"] == g and r["measure"] == m
                } or {0}
                means.append(
                    sum(s["kind"] == kind and s["gamma"] == g and s["measure"] == m for s in sims) / len(iterations)
                )
            ax.bar([i + offset for i in range(len(variants))], means, width=0.4, label=kind)
        ax.set_xticks(
            range(len(variants)),
            [f"{g:g}" + ("" if m == DEFAULT_MEASURE_KEY else f"\n{m}") for g, m in variants],
            fontsize=8,
        )
        ax.legend()
    with plot("lengths", "raw vs purified length", "mean response tokens") as ax:
        for name in sorted({_variant(r) for r in compare}):
            rows = [r for r in compare if _variant(r) == name]
            ax.plot(
                [r["iteration"] for r in rows],
                [r["purified_response_tokens"] for r in rows],
                "o-",
                label=name,
                alpha=0.8,
            )
        ax.plot(x, [r["response_tokens"] for r in its], "k--", label="raw (lived)")  # on top: mode=raw equals it
        ax.set_ylim(bottom=0), ax.legend(fontsize=7)
    if ratios:
        import math

        with plot(
            "is_ratio",
            "importance ratio of each splice",
            "splices",
            xlabel="log10 IS (moved retry, as trained vs as sampled)",
        ) as ax:
            for name in sorted({_variant(r) for r in ratios}):
                ax.hist(
                    [r["log_is_ratio"] / math.log(10) for r in ratios if _variant(r) == name],
                    bins=30,
                    alpha=0.6,
                    label=name,
                )
            ax.axvline(math.log10(tau), color="k", linestyle="--", label=f"τ = {tau:g}")
            ax.legend(fontsize=7)
    with plot("failed_tokens", "tokens spent on failed attempts", "per generated token") as ax:
        ax.plot(x, [r["failed_tokens_per_generated"] for r in its], "o-", color="tab:purple")
        ax.set_ylim(0, max(0.1, max(r["failed_tokens_per_generated"] or 0 for r in its) * 1.1))
    trained = [(key, label) for key, label in UPDATE_CURVES if key in its[0]]
    if trained:
        with plot("update_options", "train-time correction and DPO side loss", "per iteration (mean of steps)") as ax:
            for key, label in trained:
                pts = [r for r in its if r[key] is not None]
                ax.plot([r["iteration"] for r in pts], [r[key] for r in pts], "o-", label=label)
            ax.legend(fontsize=8)
    for name, title, ylabel, key in (
        ("eval_pass1", "held-out pass@1 (avg@k)", "pass@1", "pass@1"),
        ("eval_tool_errors", "held-out tool failures", "failed executions / trajectory", "tool failures/traj"),
    ):
        if not curves:
            break
        with plot(name, title, ylabel, xlabel="checkpoint (iteration it rolls out)") as ax:
            for setting, style in (("saar_on", "o-"), ("saar_off", "s--")):
                pts = [r for r in curves if r[f"{setting} {key}"] is not None]
                err = [r[f"{setting} pass@1 se"] or 0.0 for r in pts] if key == "pass@1" else None
                if pts:
                    ax.errorbar(
                        [r["iteration"] for r in pts],
                        [r[f"{setting} {key}"] for r in pts],
                        yerr=err,
                        fmt=style,
                        capsize=3,
                        label=f"SAAR {setting.split('_')[1]} at test",
                    )
            ax.xaxis.set_major_locator(MaxNLocator(integer=True))
            ax.set_ylim(0, 1.05) if key == "pass@1" else ax.set_ylim(bottom=0)  # pass@1: the whole range
            ax.legend(fontsize=8)

    config = layout.run_json.read_text() if layout.run_json.is_file() else "(no run.json)"
    plots = "".join(
        f'<figure><img src="{n}.png" alt="{n}"><figcaption>{html.escape(CAPTIONS[n])}</figcaption></figure>'
        for n in figs
    )
    it_links = {"iteration": lambda r: iteration_href(r["iteration"])}
    per_iteration_links = " · ".join(
        link(iteration_href(i), i) + " (" + link(iteration_href(i, spliced="yes"), "spliced") + ")" for i in x
    )
    page = f"""<!doctype html><html><head><meta charset="utf-8">
<meta name="viewport" content="width=device-width, initial-scale=1"><title>cleaner report: {html.escape(run_id)}</title>
<style>{STYLE}</style></head><body>
<h1>cleaner run <code>{html.escape(run_id)}</code></h1>
{viewer_note(root, run_id)}
<p>In the viewer: {link(f"../../{quote(run_id, safe='')}", "the run's iterations")}; per iteration
{per_iteration_links}.</p>
{rule_section(run_id, kinds, failed_calls, examples)}
<h2>Per iteration</h2>{table(its, it_links, "iterations")}
<h2>Plots</h2>{plots}
<h2>Held-out evaluation (flow.eval_every)</h2>{table(curves, None, "eval")}
<h2>Raw vs purified (per mode, γ and similarity measure)</h2>{table(by_partition(compare), it_links, "compare")}
<h2>Off-policy: how far each partition trains tokens from where they were sampled</h2>
<p>Per trained token, Δ = old log-prob (the policy in the context it is trained in) − behaviour log-prob (as
sampled); origins: in_place (same context), shallow / deep (moved by a splice), moved (a later turn of a row
purified otherwise than lived). kl_k3 estimates KL(π_b‖π); beyond_bounds is the share with e^Δ outside
[0.5, 2]. Plan B (mode saar_is) decides each rollback by the importance ratio (docs/saar.md).</p>
{table(off_policy, None, "off-policy")}
<h2>Run config as the run started (run.json)</h2>
<p>What the run trains on (world, rollout, purify, train) is fixed when it starts; flow.iterations and the other
sections are those of its first start: the iterations it has trained are in the table above.</p>
<pre>{html.escape(config, quote=False)}</pre>
</body></html>"""
    (out / "index.html").write_text(page)
    return out / "index.html"
