"""Tables and plots of an experiment's results (called by experiments/run.py)."""
from __future__ import annotations

from pathlib import Path
from math import sqrt
from statistics import mean

REPO = Path(__file__).resolve().parent.parent
OUT = REPO / "docs" / "results"
METRICS = [("accuracy", "pass@1"), ("first_call_failure_rate", "first-call failure rate"),
           ("tool_calls_per_traj", "tool calls / trajectory"), ("response_tokens", "response tokens")]
RATES = {"accuracy", "first_call_failure_rate"}  # per-task rates: binomial standard errors apply


def _series(results: list[dict], arm: str, metric: str, saar: bool) -> list[list[tuple[int, float]]]:
    """Per seed of the arm: (iteration, value) at every evaluated checkpoint."""
    runs = [r for r in results if r["arm"] == arm]
    return [[(e["iteration"], e[metric]) for e in sorted(r["evals"], key=lambda e: e["iteration"])
             if e["saar_at_test"] == saar] for r in runs]


def _mean_curve(series: list[list[tuple[int, float]]]) -> list[tuple[int, float]]:
    return [(pts[0][0], mean(v for _, v in pts)) for pts in zip(*series)] if series else []


def steps_to_reach(curve: list[tuple[int, float]], target: float, higher_is_better: bool = True) -> int | None:
    """First evaluated iteration whose value reaches the target."""
    for it, v in curve:
        if (v >= target) if higher_is_better else (v <= target):
            return it
    return None


def _se(p: float, n: int) -> float:
    """Binomial standard error of a rate measured on n tasks."""
    return sqrt(max(p * (1 - p), 0.0) / n)


def _replay_section(results: list[dict], root_hint: str) -> str:
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
        raw_dir = RunLayout(cfg.storage.root, run).raw_dir(0)
        raws = [trajectory_from_row(r) for r in read_shard(raw_dir, RAW).to_pylist()]
        chat = load_chat(resolve_recorded(cfg.storage.root, read_manifest(raw_dir).inputs[0]))
        live = live_measure(lived_saar(cfg, RunLayout(cfg.storage.root, run).run_json))
        lines = ["| γ | positions | shallow | deep | tokens removed | tokens recomputed | ≠ γ_live | ≠ difflib |",
                 "|---|---|---|---|---|---|---|---|"]
        for g in (0.0, 0.3, 0.5, 0.7, 0.9, 0.95, 1.01):
            s = replay_stats(raws, g, chat.decode, live, live)
            lines.append(f"| {g:g} | {s.positions} | {s.shallow} | {s.deep} | {s.tokens_removed} | {s.tokens_recomputed} "
                         f"| {s.differ_from_live} | {s.differ_from_reference} |")
        return f"Replay of `{run}` iteration 0 ({len(raws)} raw trajectories):\n\n" + "\n".join(lines)
    except Exception as e:  # noqa: BLE001 - the table is a bonus; say why it is missing
        return f"(replay statistics unavailable: {e})"


def _plot(results: list[dict], arms: list[str], stem: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, len(METRICS), figsize=(4.2 * len(METRICS), 7.5))
    for row, saar in enumerate((False, True)):
        for ax, (metric, label) in zip(axes[row], METRICS):
            for k, arm in enumerate(arms):
                for j, s in enumerate(_series(results, arm, metric, saar)):
                    ax.plot([i for i, _ in s], [v for _, v in s], color=f"C{k}", alpha=0.9 if j == 0 else 0.55,
                            linestyle="-" if j == 0 else "--", marker=".", label=arm if j == 0 else None)
            ax.set_title(f"{label}\n(SAAR {'on' if saar else 'off'} at test time)", fontsize=9)
            ax.set_xlabel("RL iteration")
    axes[0][0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(OUT / f"{stem}.png", dpi=90)
    plt.close(fig)


def _summary_table(results: list[dict], arms: list[str], saar: bool) -> list[str]:
    lines = ["| arm | seeds | " + " | ".join(f"{label} it0 → final" for _, label in METRICS) + " |",
             "|---|---|" + "---|" * len(METRICS)]
    for arm in arms:
        seeds = [r["seed"] for r in results if r["arm"] == arm]
        cells = []
        for metric, _ in METRICS:
            c = _mean_curve(_series(results, arm, metric, saar))
            cells.append(f"{c[0][1]:.3f} → {c[-1][1]:.3f}" if c else "")
        lines.append(f"| {arm} | {seeds} | " + " | ".join(cells) + " |")
    return lines


def _curve_table(results: list[dict], arms: list[str], metric: str, saar: bool, n_tasks: int) -> list[str]:
    """Iteration × arm: mean over seeds ± its standard error (binomial, seeds × tasks), each seed in
    brackets where there are several."""
    lines = ["| iteration | " + " | ".join(arms) + " |", "|---|" + "---|" * len(arms)]
    per_arm = {a: _series(results, a, metric, saar) for a in arms}
    iterations = [i for i, _ in per_arm[arms[0]][0]]
    for n, it in enumerate(iterations):
        cells = []
        for a in arms:
            vals = [s[n][1] for s in per_arm[a] if n < len(s)]
            se = f" ± {_se(mean(vals), n_tasks * len(vals)):.3f}" if metric in RATES else ""
            cells.append(f"{mean(vals):.3f}{se}" + (f" ({', '.join(f'{v:.3f}' for v in vals)})" if len(vals) > 1 else ""))
        lines.append(f"| {it} | " + " | ".join(cells) + " |")
    return lines


def _final_gap(results: list[dict], n_tasks: int, arm: str, baseline: str, metric: str, saar: bool) -> tuple[float, float]:
    """Final value of `arm` minus `baseline` (means over seeds) and its standard error."""
    a = _mean_curve(_series(results, arm, metric, saar))
    b = _mean_curve(_series(results, baseline, metric, saar))
    seeds = min(len(_series(results, arm, metric, saar)), len(_series(results, baseline, metric, saar)))
    return a[-1][1] - b[-1][1], sqrt(_se(a[-1][1], n_tasks * seeds) ** 2 + _se(b[-1][1], n_tasks * seeds) ** 2)


def _comparison(results: list[dict], n_tasks: int, arm: str, baseline: str = "raw") -> list[str]:
    """`arm` vs no purification (`baseline`): steps-to-target and the final gap against its noise."""
    lines = []
    for metric, label, hib in (("accuracy", "pass@1", True), ("first_call_failure_rate", "first-call failure rate", False)):
        for saar in (False, True):
            a = _mean_curve(_series(results, arm, metric, saar))
            b = _mean_curve(_series(results, baseline, metric, saar))
            seeds = min(len(_series(results, arm, metric, saar)), len(_series(results, baseline, metric, saar)))
            reach = steps_to_reach(a, b[-1][1], hib)
            last = b[-1][0]
            ratio = f"{reach}/{last} = {reach / last:.2f}" if reach is not None and last else "not reached"
            gap, se = _final_gap(results, n_tasks, arm, baseline, metric, saar)
            tail = max(1, len(a) // 3)  # the last third of the evaluated checkpoints, to average out eval noise
            tail_gap = mean(v for _, v in a[-tail:]) - mean(v for _, v in b[-tail:])
            lines.append(f"- {label}, SAAR {'on' if saar else 'off'} at test: {baseline} ends at {b[-1][1]:.3f} "
                         f"(iteration {last}); "
                         + (f"{arm} reaches it at iteration {reach} (steps ratio {ratio})" if reach is not None else
                            f"{arm} does not reach it within {last} iterations")
                         + f"; final gap {arm} − {baseline} "
                         f"{gap:+.3f} ± {se:.3f} (1 s.e., {seeds} seeds × {n_tasks} tasks); mean gap over the last "
                         f"{tail} checkpoints {tail_gap:+.3f}")
    return lines


def _premise_section(results: list[dict], root: Path) -> list[str]:
    """The premise (issue 19 §1) per run: recovered trajectories' share, correctness and mean GRPO
    advantage at the first and last iteration, from the catalog view trajectory_kinds."""
    try:
        from storage.catalog import Catalog

        with Catalog(root) as cat:
            rows = cat.query("SELECT run_id, iteration, kind, trajectories, correct, mean_advantage "
                             "FROM trajectory_kinds ORDER BY ALL").to_pylist()
    except Exception as e:  # noqa: BLE001 - the table is a bonus; say why it is missing
        return [f"(premise figures unavailable: {e})"]
    runs = {r["run_id"]: r["arm"] for r in results}
    lines = ["| run | iteration | recovered / all | recovered correct | recovered mean advantage | "
             "not recovered / all | clean correct |", "|---|---|---|---|---|---|---|"]
    for run_id in sorted(runs):
        mine = [r for r in rows if r["run_id"] == run_id]
        if not mine:
            continue
        for it in sorted({min(r["iteration"] for r in mine), max(r["iteration"] for r in mine)}):
            at = {r["kind"]: r for r in mine if r["iteration"] == it}
            n = sum(r["trajectories"] for r in at.values())
            rec, nrec, clean = at.get("recovered"), at.get("not_recovered"), at.get("clean")
            cells = [run_id, str(it), f"{rec['trajectories'] if rec else 0}/{n}",
                     f"{rec['correct']:.2f}" if rec else "—", f"{rec['mean_advantage']:+.3f}" if rec else "—",
                     f"{nrec['trajectories'] if nrec else 0}/{n}", f"{clean['correct']:.2f}" if clean else "—"]
            lines.append("| " + " | ".join(cells) + " |")
    return lines


def _arm_mode(exp: dict, arm: str) -> str | None:
    return next((o.split("=", 1)[1] for o in exp["arms"][arm]["overrides"] if o.startswith("train.mode=")), None)


def _token_rule_section(results: list[dict], exp: dict, root: Path) -> list[str]:
    """The token-level rule (flows/premise.TOKEN_RULE) as a prediction made from the raw arm's shards
    alone (what a user has before choosing a mode), then checked against each arm's measured gap."""
    try:
        from flows.premise import predicts_slower, removed_by_sign
        from storage.catalog import Catalog

        raw_runs = sorted(r["run_id"] for r in results if r["arm"] == "raw")
        with Catalog(root) as cat:
            rows = cat.con.sql("SELECT run_id, iteration, mode, on_negative, on_positive FROM failed_call_advantage "
                               "WHERE list_contains($runs, run_id)", params={"runs": raw_runs}).to_arrow_table().to_pylist()
    except Exception as e:  # noqa: BLE001 - the table is a bonus; say why it is missing
        return [f"(token-level figures unavailable: {e})"]

    def removed(mode: str, first_only: bool) -> tuple[int, int]:
        pick = [r for r in rows if not first_only or r["iteration"] == 0]
        sums = {m: {k: sum(r[k] for r in pick if r["mode"] == m) for k in ("on_negative", "on_positive")}
                for m in ("raw", mode)}
        return removed_by_sign(sums["raw"], sums[mode])

    lines = [f"Prediction from the raw arm's shards only ({', '.join(raw_runs)}): failed-call tokens each mode "
             "would stop training, compared with raw, by the sign of their advantage (negative / positive). Checked "
             "against the arm's final first-call failure gap to raw, SAAR off at test (positive = slower error "
             "reduction).", "",
             "| arm | mode | removed at iteration 0 (neg / pos) | removed, all iterations (neg / pos) | predicted | "
             "measured gap ± s.e. | held |", "|---|---|---|---|---|---|---|"]
    for arm in (a for a in dict.fromkeys(r["arm"] for r in results) if a != "raw"):
        mode = _arm_mode(exp, arm)
        if mode not in {r["mode"] for r in rows} or mode == "raw":
            continue
        (n0, p0), (n, p) = removed(mode, True), removed(mode, False)
        slower = predicts_slower(n, p)
        gap, se = _final_gap(results, exp["eval_tasks"], arm, "raw", "first_call_failure_rate", False)
        held = (gap > 0) == slower
        lines.append(f"| {arm} | {mode} | {n0} / {p0} | {n} / {p} | {'slower' if slower else 'not slower'} | "
                     f"{gap:+.3f} ± {se:.3f} ({gap / se if se else 0:+.1f} s.e.) | {'yes' if held else 'no'} |")
    if len(lines) == 4:  # no data row: the raw arm's shards were purified under no other mode
        return ["(not measured: the raw arm purified only its own partition; `cleaner replay --mode …` on its "
                "stored raw shards adds the other modes)"]
    return lines


def _policy(exp: dict) -> str:
    return next((o.split("=", 1)[1] for o in exp["base"] if o.startswith("rollout.policy=")), "policies/tiny-tool-policy")


def write(results: list[dict], exp: dict, stem: str, wall_s: float) -> Path:
    OUT.mkdir(parents=True, exist_ok=True)
    arms = list(dict.fromkeys(r["arm"] for r in results))
    _plot(results, arms, stem)
    lines = [f"# Experiment `{stem}` — results (generated)", "",
             f"Wall time: {wall_s / 60:.0f} min on this machine (arms {exp.get('parallel', 1)} at a time). "
             f"Every arm starts from {_policy(exp)}; evaluation every {exp.get('eval_every', 1)} iterations "
             f"on {exp['eval_tasks']} held-out tasks, T=1.0, mean over seeds. Solid/dashed lines in the plot are seeds 0/1.",
             "", f"![curves]({stem}.png)", ""]
    from experiments.stats import off_policy_table, paired_table, seeds_table

    root = REPO / next(o.split("=", 1)[1] for o in exp["base"] if o.startswith("storage.root="))
    contrasts = [*((a, "raw") for a in arms if a != "raw" and "raw" in arms), *(tuple(c) for c in exp.get("compare", []) if set(c) <= set(arms))]
    lines += ["## Final checkpoint, mean ± standard error between seeds", "", *seeds_table(results, arms), "",
              "## Paired contrasts (same rollout seed, same evaluation tasks)", "",
              "Per-seed difference at the final checkpoint; claimed when every seed has the same sign or the paired "
              "95% interval (Student's t) excludes zero.", "", *paired_table(results, contrasts), "",
              "## Off-policy diagnostics of the partition each arm trained on (catalog views off_policy, splices, "
              "raw_kinds, failed_call_advantage, metrics)", "",
              "Per run over all its iterations, then mean ± s.e. between seeds. Moved: trained tokens sampled in "
              "another context than they are trained in (spliced shallow/deep, or moved by a splice before them); "
              "Δ = old − behaviour log-prob; beyond: share of trained tokens whose ratio is outside [0.5, 2]; "
              "replaced / rollbacks: retries spliced over their failed call, of the retries that carried a call "
              "after a model error; failed-first: trajectories whose first call failed (GRPO advantage on the raw "
              "group); correction filtered: share of trained tokens OpenRLHF's gate masked or clipped.", "",
              *off_policy_table(results, {a: _arm_mode(exp, a) or "saar" for a in arms}, root), ""]
    for saar in (False, True):
        lines += [f"## First and last checkpoint, SAAR {'on' if saar else 'off'} at test time", "",
                  *_summary_table(results, arms, saar), ""]
    for metric, label in METRICS[:2]:
        for saar in (False, True):
            lines += [f"## {label} per iteration, SAAR {'on' if saar else 'off'} at test time", "",
                      *_curve_table(results, arms, metric, saar, exp["eval_tasks"]), ""]
    if "raw" in arms:
        for arm in (a for a in arms if a != "raw"):
            lines += [f"## {arm} vs no purification (raw)", "", *_comparison(results, exp["eval_tasks"], arm), ""]
    for arm, baseline in exp.get("compare", []):  # further pairs the experiment file asks for
        if arm not in arms or baseline not in arms:  # a partial run (--report while arms are still running)
            continue
        lines += [f"## {arm} vs {baseline}", "", *_comparison(results, exp["eval_tasks"], arm, baseline), ""]
    lines += ["## The premise: recovered trajectories' advantage (catalog view trajectory_kinds)", "",
              "Purification is predicted to help when recovered trajectories' mean advantage is positive.", "",
              *_premise_section(results, root), ""]
    lines += ["## The token-level rule, tested", "", *_token_rule_section(results, exp, root), ""]
    lines += ["## Replay statistics", "", _replay_section(results, str(root)), ""]
    page = OUT / f"{stem}.md"
    page.write_text("\n".join(lines) + "\n")
    return page
