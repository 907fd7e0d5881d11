"""Tables and plots of an experiment's results (called by experiments/run.py).

Every error bar on a page is between training seeds: the declared contrasts (experiments/contrasts.py) as per-seed
paired differences with their t-interval, Holm-adjusted p and equivalence verdict, and per-arm means ± the standard
error between seeds. No binomial error over evaluation tasks: it leaves out the seed-to-seed training noise.

Sections read from the runs' catalog (off-policy diagnostics, premise, token-level rule, replay) need the
experiment's workspace; a page regenerated where that workspace is not (from the committed JSON alone) carries
those sections over from the page it replaces, and says so.
"""

from __future__ import annotations

import re
from pathlib import Path
from statistics import mean

from experiments.contrasts import (
    METRICS as METRIC_LABELS,
    Analysis,
    analysis_of,
    contrast_table,
    evaluate,
    paired_t,
    registration_note,
)
from experiments.stats import final_by_seed, mean_se, premise_table

REPO = Path(__file__).resolve().parent.parent
OUT = REPO / "docs" / "results"
# The headline metrics, one protocol across arms and test modes, then what older runs recorded instead
HEADLINE = ["very_first_call_failure_rate", "retry_success_rate", "accuracy"]
LEGACY_FAILURES = "first_call_failure_rate"  # per position: with SAAR off at test a failed call opens a new one
LOWER_IS_BETTER = {"very_first_call_failure_rate", LEGACY_FAILURES}
PLOTTED_EXTRA = [("tool_calls_per_traj", "tool calls / trajectory"), ("response_tokens", "response tokens")]
MIXED_PROTOCOL = (
    "These runs recorded first-call failures per position, which mixes protocols: with SAAR off at "
    "test a failed call closes its position and the next call opens a new one, so it counts calls after "
    "an error as first calls, and with SAAR on it does not. The headline metric with one protocol, the "
    "failure rate of the very first call (position 0, attempt 0), was not recorded; rerunning the "
    "experiment records it."
)


def recorded_metrics(results: list[dict]) -> list[str]:
    """The metrics these results carry, headline first; results from before the headline metric existed carry
    the per-position first-call failure rate instead."""
    have = {k for r in results for e in r["evals"] for k, v in e.items() if v is not None}
    return [m for m in HEADLINE if m in have] + (
        [LEGACY_FAILURES] if "very_first_call_failure_rate" not in have and LEGACY_FAILURES in have else []
    )


def failure_metric(results: list[dict]) -> str:
    return (
        "very_first_call_failure_rate"
        if "very_first_call_failure_rate" in recorded_metrics(results)
        else LEGACY_FAILURES
    )


def _series(results: list[dict], arm: str, metric: str, saar: bool) -> list[list[tuple[int, float]]]:
    """Per seed of the arm: (iteration, value) at every evaluated checkpoint that recorded the metric."""
    runs = sorted((r for r in results if r["arm"] == arm), key=lambda r: r["seed"])
    return [
        [
            (e["iteration"], e[metric])
            for e in sorted(r["evals"], key=lambda e: e["iteration"])
            if e["saar_at_test"] == saar and e.get(metric) is not None
        ]
        for r in runs
    ]


def _mean_curve(series: list[list[tuple[int, float]]]) -> list[tuple[int, float]]:
    return [(pts[0][0], mean(v for _, v in pts)) for pts in zip(*series)] if series else []


def steps_to_reach(curve: list[tuple[int, float]], target: float, higher_is_better: bool = True) -> int | None:
    """First evaluated iteration whose value reaches the target."""
    for it, v in curve:
        if (v >= target) if higher_is_better else (v <= target):
            return it
    return None


def page_sections(text: str) -> dict[str, str]:
    """A generated page's '## ' sections: heading → body (without the heading line)."""
    out, heading, body = {}, None, []
    for line in text.splitlines():
        if line.startswith("## "):
            if heading is not None:
                out[heading] = "\n".join(body).strip("\n")
            heading, body = line[3:], []
        elif heading is not None:
            body.append(line)
    if heading is not None:
        out[heading] = "\n".join(body).strip("\n")
    return out


def _carried(old: dict[str, str], prefix: str) -> tuple[str, str] | None:
    """The previous page's section whose heading starts with `prefix`, minus an earlier carry note; None when
    there is none or it only said that it was not available."""
    for heading, body in old.items():
        if heading.startswith(prefix) and not body.startswith("(Not available"):
            return heading, re.sub(r"^\(Carried over[^\n]*\n\n", "", body)
    return None


CARRY_NOTE = (
    "(Carried over from the page generated at the run: this section reads the runs' catalog, and the "
    "experiment's workspace is not on the machine that regenerated the page.)"
)


def _plot(results: list[dict], arms: list[str], metrics: list[tuple[str, str]], stem: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, len(metrics), figsize=(4.2 * len(metrics), 7.5), squeeze=False)
    for row, saar in enumerate((False, True)):
        for ax, (metric, label) in zip(axes[row], metrics):
            for k, arm in enumerate(arms):
                for j, s in enumerate(_series(results, arm, metric, saar)):
                    ax.plot(
                        [i for i, _ in s],
                        [v for _, v in s],
                        color=f"C{k}",
                        alpha=0.9 if j == 0 else 0.55,
                        linestyle="-" if j == 0 else "--",
                        marker=".",
                        label=arm if j == 0 else None,
                    )
            ax.set_title(f"{label}\n(SAAR {'on' if saar else 'off'} at test time)", fontsize=9)
            ax.set_xlabel("RL iteration")
    axes[0][0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(OUT / f"{stem}.png", dpi=90)
    plt.close(fig)


def _summary_table(results: list[dict], arms: list[str], metrics: list[tuple[str, str]], saar: bool) -> list[str]:
    lines = [
        "| arm | seeds | " + " | ".join(f"{label} it0 → final" for _, label in metrics) + " |",
        "|---|---|" + "---|" * len(metrics),
    ]
    for arm in arms:
        seeds = sorted(r["seed"] for r in results if r["arm"] == arm)
        cells = []
        for metric, _ in metrics:
            c = _mean_curve(_series(results, arm, metric, saar))
            cells.append(f"{c[0][1]:.3f} → {c[-1][1]:.3f}" if c else "—")
        lines.append(f"| {arm} | {seeds} | " + " | ".join(cells) + " |")
    return lines


def _curve_table(results: list[dict], arms: list[str], metric: str, saar: bool) -> list[str]:
    """Iteration × arm: mean over seeds ± the standard error between seeds, each seed's value in brackets."""
    per_arm = {a: _series(results, a, metric, saar) for a in arms}
    iterations = sorted({i for series in per_arm.values() for s in series for i, _ in s})
    lines = ["| iteration | " + " | ".join(arms) + " |", "|---|" + "---|" * len(arms)]
    for it in iterations:
        cells = []
        for a in arms:
            vals = [v for s in per_arm[a] for i, v in s if i == it]
            if not vals:
                cells.append("—")
                continue
            m, se = mean_se(vals)
            cells.append(f"{m:.3f}" + (f" ± {se:.3f} ({', '.join(f'{v:.3f}' for v in vals)})" if len(vals) > 1 else ""))
        lines.append(f"| {it} | " + " | ".join(cells) + " |")
    return lines


def _steps(results: list[dict], metrics: list[tuple[str, str]], arm: str, baseline: str) -> list[str]:
    """Steps to the baseline's final value, on the seed-mean curves (descriptive: no interval; the contrast table
    above carries the inference)."""
    lines = []
    for metric, label in metrics:
        hib = metric not in LOWER_IS_BETTER
        for saar in (False, True):
            a = _mean_curve(_series(results, arm, metric, saar))
            b = _mean_curve(_series(results, baseline, metric, saar))
            if not a or not b:
                continue
            reach, last = steps_to_reach(a, b[-1][1], hib), b[-1][0]
            lines.append(
                f"- {label}, SAAR {'on' if saar else 'off'} at test: {baseline} ends at {b[-1][1]:.3f} "
                f"(iteration {last}); "
                + (
                    f"{arm}'s seed-mean reaches it at iteration {reach}"
                    + (f" (steps ratio {reach}/{last} = {reach / last:.2f})" if last else "")
                    if reach is not None
                    else f"{arm}'s seed-mean does not reach it within {last} iterations"
                )
            )
    return lines


def _replay_section(results: list[dict], root_hint: str) -> str:
    from storage.errors import CleanerError

    try:
        from pipeline.config import load_config
        from pipeline.trajectory import trajectory_from_row
        from purifier.replay import replay_stats
        from flows.replay_cmd import lived_saar
        from pipeline.modes import live_measure
        from pipeline.chat import load_chat
        from storage.layout import RunLayout, resolve_recorded
        from storage.schemas import RAW
        from storage.shards import read_manifest, read_shard

        run = next(r["run_id"] for r in results if r["arm"].startswith("saar"))
        cfg = load_config(None, [f"storage.root={root_hint}"])
        layout = RunLayout(cfg.storage.root, run)
        raw_dir, manifest = layout.raw_dir(0), read_manifest(layout.raw_dir(0))
        if manifest is None:
            raise FileNotFoundError(f"no committed raw shard at {raw_dir}")
        raws = [trajectory_from_row(r) for r in read_shard(raw_dir, RAW).to_pylist()]
        chat = load_chat(resolve_recorded(cfg.storage.root, manifest.inputs[0]))
        live = live_measure(lived_saar(layout.run_json, manifest.extra) or cfg.rollout.saar)
        lines = [
            "| γ | positions | shallow | deep | tokens removed | tokens recomputed | ≠ γ_live | ≠ difflib |",
            "|---|---|---|---|---|---|---|---|",
        ]
        for g in (0.0, 0.3, 0.5, 0.7, 0.9, 0.95, 1.01):
            s = replay_stats(raws, g, chat.decode, live, live)
            lines.append(
                f"| {g:g} | {s.positions} | {s.shallow} | {s.deep} | {s.tokens_removed} | {s.tokens_recomputed} "
                f"| {s.differ_from_live} | {s.differ_from_reference} |"
            )
        return f"Replay of `{run}` iteration 0 ({len(raws)} raw trajectories):\n\n" + "\n".join(lines)
    except (OSError, CleanerError, StopIteration, ValueError, KeyError) as e:  # a bonus: say why it is missing
        return f"(replay statistics unavailable: {str(e) or type(e).__name__})"


def _premise_section(results: list[dict], root: Path) -> list[str]:
    """The premise (issue 19 §1) per run: recovered trajectories' share, correctness and mean GRPO
    advantage at the first and last iteration, from the catalog view trajectory_kinds."""
    try:
        from storage.catalog import Catalog

        with Catalog(root) as cat:
            rows = cat.query(
                "SELECT run_id, iteration, kind, trajectories, correct, mean_advantage "
                "FROM trajectory_kinds ORDER BY ALL"
            ).to_pylist()
    except Exception as e:  # noqa: BLE001 - the table is a bonus; say why it is missing
        return [f"(premise figures unavailable: {e})"]
    runs = {r["run_id"]: r["arm"] for r in results}
    lines = [
        "| run | iteration | recovered / all | recovered correct | recovered mean advantage | "
        "not recovered / all | clean correct |",
        "|---|---|---|---|---|---|---|",
    ]
    for run_id in sorted(runs):
        mine = [r for r in rows if r["run_id"] == run_id]
        if not mine:
            continue
        for it in sorted({min(r["iteration"] for r in mine), max(r["iteration"] for r in mine)}):
            at = {r["kind"]: r for r in mine if r["iteration"] == it}
            n = sum(r["trajectories"] for r in at.values())
            rec, nrec, clean = at.get("recovered"), at.get("not_recovered"), at.get("clean")
            cells = [
                run_id,
                str(it),
                f"{rec['trajectories'] if rec else 0}/{n}",
                f"{rec['correct']:.2f}" if rec else "—",
                f"{rec['mean_advantage']:+.3f}" if rec else "—",
                f"{nrec['trajectories'] if nrec else 0}/{n}",
                f"{clean['correct']:.2f}" if clean else "—",
            ]
            lines.append("| " + " | ".join(cells) + " |")
    return lines


def _arm_mode(exp: dict, arm: str) -> str | None:
    return next((o.split("=", 1)[1] for o in exp["arms"][arm]["overrides"] if o.startswith("train.mode=")), None)


TOKEN_RULE_HEADER = (
    "| arm | mode | removed at iteration 0 (neg / pos) | removed, all iterations (neg / pos) | predicted |"
)


def _token_rule_rows(results: list[dict], exp: dict, root: Path) -> list[tuple[str, str, str, str, bool]] | str:
    """(arm, mode, removed at iteration 0, removed over all iterations, predicted slower) per arm the rule
    applies to, from the raw arm's shards in the catalog; a string when there is nothing to say."""
    try:
        from flows.premise import predicts_slower, removed_by_sign
        from storage.catalog import Catalog

        raw_runs = sorted(r["run_id"] for r in results if r["arm"] == "raw")
        with Catalog(root) as cat:
            rows = (
                cat.con.sql(
                    "SELECT run_id, iteration, mode, on_negative, on_positive FROM failed_call_advantage "
                    "WHERE list_contains($runs, run_id)",
                    params={"runs": raw_runs},
                )
                .to_arrow_table()
                .to_pylist()
            )
    except Exception as e:  # noqa: BLE001 - the table is a bonus; say why it is missing
        return f"(token-level figures unavailable: {e})"

    def removed(mode: str, first_only: bool) -> tuple[int, int]:
        pick = [r for r in rows if not first_only or r["iteration"] == 0]
        sums = {
            m: {k: sum(r[k] for r in pick if r["mode"] == m) for k in ("on_negative", "on_positive")}
            for m in ("raw", mode)
        }
        return removed_by_sign(sums["raw"], sums[mode])

    out = []
    for arm in (a for a in dict.fromkeys(r["arm"] for r in results) if a != "raw"):
        mode = _arm_mode(exp, arm)
        if mode not in {r["mode"] for r in rows} or mode == "raw":
            continue
        (n0, p0), (n, p) = removed(mode, True), removed(mode, False)
        out.append((arm, mode, f"{n0} / {p0}", f"{n} / {p}", predicts_slower(n, p)))
    if not out:  # the raw arm's shards were purified under no other mode
        return (
            "(not measured: the raw arm purified only its own partition; `cleaner replay --mode …` on its "
            "stored raw shards adds the other modes)"
        )
    return out


def token_rule_rows_of_page(body: str) -> list[tuple[str, str, str, str, bool]] | None:
    """The prediction columns of a previous page's token-rule table (a page generated at the run, with the
    catalog), so that a page regenerated without the workspace restates them with today's statistics."""
    lines = body.splitlines()
    start = next((i for i, ln in enumerate(lines) if ln.startswith("| arm | mode | removed at iteration 0")), None)
    if start is None:
        return None
    out = []
    for ln in lines[start + 2 :]:
        if not ln.startswith("| "):
            break
        cells = [c.strip() for c in ln.strip("|").split("|")]
        out.append((cells[0], cells[1], cells[2], cells[3], cells[4] == "slower"))
    return out


def _token_rule_table(
    results: list[dict], rows: list[tuple[str, str, str, str, bool]], analysis: Analysis, metric: str
) -> list[str]:
    """The token-level rule's predictions against each arm's paired final gap to raw (SAAR off at test), one
    descriptive interval each (not in the corrected family): 'slower' is borne out only by an interval above 0,
    'not slower' only by one whose upper end is below the declared margin (non-inferiority)."""
    margin = analysis.margins.get(metric)
    level = f"{100 * (1 - analysis.alpha):g}%"
    raw_runs = ", ".join(sorted(r["run_id"] for r in results if r["arm"] == "raw"))
    lines = [
        f"Prediction from the raw arm's shards only ({raw_runs}): "
        "failed-call tokens each mode would stop training, compared with raw, by the sign of their advantage "
        f"(negative / positive). Checked against the arm's paired final gap to raw in {METRIC_LABELS[metric]}, "
        f"SAAR off at test (positive = slower error reduction): mean ± s.e. between seeds, {level} t-interval, n "
        "seeds; unadjusted, outside the corrected family. The arms' predictions share the raw arm and, for "
        "modes that remove the same tokens, each other: they are not independent tests of the rule.",
        "",
        TOKEN_RULE_HEADER + f" paired gap to raw, mean ± s.e. [{level} t-interval] (n) | borne out? |",
        "|---|---|---|---|---|---|---|",
    ]
    for arm, mode, first, total, slower in rows:
        a, b = final_by_seed(results, arm, metric, False), final_by_seed(results, "raw", metric, False)
        diffs = {s: a[s] - b[s] for s in a.keys() & b.keys()}
        if len(diffs) < 2:
            gap, verdict = "— (fewer than 2 paired seeds)", "not estimable"
        else:
            t = paired_t(diffs, analysis.alpha, margin)
            gap = f"{t.mean:+.3f} ± {t.se:.3f} [{t.low:+.3f}, {t.high:+.3f}] (n={t.n})"
            if slower:
                verdict = (
                    "yes: interval above 0"
                    if t.low > 0
                    else ("no: interval below 0" if t.high < 0 else "undecided: interval includes 0")
                )
            elif margin is None:
                verdict = "undecided: no margin declared"
            else:
                verdict = (
                    f"yes: upper end below +{margin:g}"
                    if t.high < margin
                    else "no: interval above 0"
                    if t.low > 0
                    else f"undecided: interval reaches +{margin:g}"
                )
        lines.append(
            f"| {arm} | {mode} | {first} | {total} | {'slower' if slower else 'not slower'} | {gap} | {verdict} |"
        )
    return lines


def _policy(exp: dict) -> str:
    return next(
        (o.split("=", 1)[1] for o in exp["base"] if o.startswith("rollout.policy=")), "policies/tiny-tool-policy"
    )


def _pairs(analysis: Analysis) -> list[tuple[str, str]]:
    return list(dict.fromkeys((c.arm, c.baseline) for c in analysis.contrasts))


def write(results: list[dict], exp: dict, stem: str, wall_s: float, where: str | None = None) -> Path:
    """The experiment's page docs/results/<stem>.md and its plot, from the results and the experiment file."""
    from experiments.stats import off_policy_table, seeds_table

    OUT.mkdir(parents=True, exist_ok=True)
    page = OUT / f"{stem}.md"
    old = page_sections(page.read_text()) if page.exists() else {}
    analysis = analysis_of(exp, where or f"configs/experiments/{stem}.yaml")
    arms = list(dict.fromkeys(r["arm"] for r in results))
    metrics = [(m, METRIC_LABELS[m]) for m in recorded_metrics(results)]
    _plot(results, arms, metrics + PLOTTED_EXTRA, stem)
    root_name = next(o.split("=", 1)[1] for o in exp["base"] if o.startswith("storage.root="))
    root = REPO / root_name
    have_catalog = root.is_dir()
    seeds = sorted({r["seed"] for r in results})
    lines = [f"# Experiment `{stem}` — results (generated)", ""]
    lines += [f"> **{b.strip()}**" + "\n" for b in exp.get("banners", [])]
    lines += [
        f"Wall time: {wall_s / 60:.0f} min on this machine (arms {exp.get('parallel', 1)} at a time). "
        f"Every arm starts from {_policy(exp)}; evaluation every {exp.get('eval_every', 1)} iterations "
        f"on {exp['eval_tasks']} held-out tasks, T=1.0. Seeds {seeds}: an arm's seed s shares its rollout seed, "
        "start policy and evaluation tasks with every other arm's seed s, so the per-seed difference between "
        "two arms is the unit of every comparison. Solid/dashed lines in the plot are an arm's first/other seeds.",
        "",
        f"![curves]({stem}.png)",
        "",
    ]
    if LEGACY_FAILURES in recorded_metrics(results):
        lines += [MIXED_PROTOCOL, ""]
    when = f"; declared {analysis.declared}" if analysis.declared else ""
    registered = (
        f"declared in the experiment file before the run (pre-registered{when})"
        if analysis.pre_registered
        else f"declared after the run, for a re-analysis (not pre-registered{when})"
    )
    lines += [
        "## Contrasts",
        "",
        f"The contrasts, {registered}: arm − baseline at the final checkpoint, per seed; mean ± standard error "
        f"between seeds; Student's t-interval over the seeds (n − 1 degrees of freedom); p of a difference "
        f'Holm-adjusted across the {len(analysis.contrasts)} contrasts; and for a "no difference" claim the '
        f"equivalence test (TOST: both one-sided tests against the declared margin, Holm-adjusted the same "
        f'way). Verdicts at family-wise alpha {analysis.alpha:g}: "higher/lower" when the adjusted p of a '
        f'difference is below it, "equivalent within ±margin" when the adjusted TOST p is, "inconclusive" '
        f"when neither; the same sign in every seed is not a verdict."
        + registration_note(exp, OUT / f"{stem}.registration.json"),
        "",
        *contrast_table(evaluate(results, analysis), analysis.alpha),
        "",
        "## Final checkpoint, mean ± standard error between seeds",
        "",
        *seeds_table(results, arms, dict(metrics)),
        "",
    ]
    heading = (
        "Off-policy diagnostics of the partition each arm trained on (catalog views off_policy, splices, "
        "raw_kinds, failed_call_advantage, metrics)"
    )
    if have_catalog:
        lines += [
            f"## {heading}",
            "",
            "Per run over all its iterations, then mean ± s.e. between seeds. Moved: trained tokens sampled in "
            "another context than they are trained in (spliced shallow/deep, or moved by a splice before them); "
            "Δ = old − behaviour log-prob; beyond: share of trained tokens whose ratio is outside [0.5, 2]; "
            "replaced / rollbacks: retries spliced over their failed call, of the retries that carried a call "
            "after a model error; failed-first: trajectories whose first call failed (GRPO advantage on the raw "
            "group); correction filtered: share of trained tokens OpenRLHF's gate masked or clipped.",
            "",
            *off_policy_table(results, {a: _arm_mode(exp, a) or "saar" for a in arms}, root),
            "",
        ]
    elif _carried(old, "Off-policy diagnostics"):
        h, body = _carried(old, "Off-policy diagnostics")
        lines += [f"## {h}", "", CARRY_NOTE, "", body, ""]
    lines += [
        "## Premise figures per iteration (EXPERIMENTS.md), of the partition each arm trained on",
        "",
        *premise_table(results, arms),
        "",
    ]
    for saar in (False, True):
        lines += [
            f"## First and last checkpoint, SAAR {'on' if saar else 'off'} at test time",
            "",
            *_summary_table(results, arms, metrics, saar),
            "",
        ]
    for metric, label in metrics:
        for saar in (False, True):
            if any(series for a in arms for series in _series(results, a, metric, saar)):
                lines += [
                    f"## {label} per iteration, SAAR {'on' if saar else 'off'} at test time",
                    "",
                    "Mean over seeds ± standard error between seeds (each seed's value in brackets).",
                    "",
                    *_curve_table(results, arms, metric, saar),
                    "",
                ]
    for arm, baseline in _pairs(analysis):
        if arm in arms and baseline in arms:  # a partial run (--report while arms are still running)
            lines += [
                f"## Steps to {baseline}'s final value: {arm} vs {baseline}",
                "",
                *_steps(results, metrics, arm, baseline),
                "",
            ]
    missing = (
        f"(Not available: this section reads the runs' catalog, the experiment's workspace {root_name}"
        " is not on the machine that regenerated the page, and the page it replaced had no such section.)"
    )
    lines += [
        "## The premise: recovered trajectories' advantage (catalog view trajectory_kinds)",
        "",
        "Recovered trajectories' mean advantage, per run at its first and last iteration. It describes the runs; "
        "the coarse rule that read it as a prediction (positive: purification helps) did not predict "
        "(flows/premise.py).",
        "",
    ]
    carried = (
        ""
        if have_catalog
        else "\n".join(  # its table only: the page stated the coarse rule beside it
            ln for ln in (_carried(old, "The premise") or ("", ""))[1].splitlines() if ln.startswith("|")
        )
    )
    if have_catalog:
        lines += [*_premise_section(results, root), ""]
    elif carried:
        lines += [CARRY_NOTE, "", carried, ""]
    else:
        lines += [missing, ""]
    lines += ["## The token-level rule, tested", ""]
    rows: list | str | None = _token_rule_rows(results, exp, root) if have_catalog else None
    if rows is None and _carried(old, "The token-level rule"):
        body = _carried(old, "The token-level rule")[1]
        rows = token_rule_rows_of_page(body)
        if rows is None:  # the old page said why it had no table: keep that
            rows = body
        else:
            lines += [
                "(The removed-token counts and predictions are carried over from the page generated at the "
                "run, which read them from the runs' catalog; the gaps are recomputed from the committed JSON.)",
                "",
            ]
    if isinstance(rows, list):
        lines += [*_token_rule_table(results, rows, analysis, failure_metric(results)), ""]
    else:
        lines += [rows or missing, ""]
    lines += ["## Replay statistics", ""]
    if have_catalog:
        lines += [_replay_section(results, str(root)), ""]
    elif _carried(old, "Replay statistics"):
        lines += [CARRY_NOTE, "", _carried(old, "Replay statistics")[1], ""]
    else:
        lines += [missing, ""]
    page.write_text("\n".join(lines) + "\n")
    return page
