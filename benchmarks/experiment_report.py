"""Tables and plots of an experiment's results (called by benchmarks/experiment.py)."""
from __future__ import annotations

from pathlib import Path
from statistics import mean

OUT = Path(__file__).resolve().parent.parent / "docs" / "results"
METRICS = [("accuracy", "pass@1"), ("first_call_failure_rate", "first-call failure rate"),
           ("tool_calls_per_traj", "tool calls / trajectory"), ("response_tokens", "response tokens")]


def _series(results: list[dict], arm: str, metric: str, saar: bool) -> list[list[float]]:
    runs = [r for r in results if r["arm"] == arm]
    return [[e[metric] for e in sorted(r["evals"], key=lambda e: e["iteration"]) if e["saar_at_test"] == saar]
            for r in runs]


def _mean_curve(series: list[list[float]]) -> list[float]:
    return [mean(v) for v in zip(*series)] if series else []


def steps_to_reach(curve: list[float], target: float, higher_is_better: bool = True) -> int | None:
    for i, v in enumerate(curve):
        if (v >= target) if higher_is_better else (v <= target):
            return i
    return None


def _replay_section(results: list[dict], root_hint: str) -> str:
    try:
        from pipeline.config import load_config
        from pipeline.trajectory import trajectory_from_row
        from purifier.replay import replay_stats
        from rollout_gen.stage import load_chat
        from storage.layout import RunLayout
        from storage.schemas import RAW
        from storage.shards import read_manifest, read_shard

        run = next(r["run_id"] for r in results if r["arm"].startswith("saar_g0.5"))
        cfg = load_config(None, [f"storage.root={root_hint}"])
        raw_dir = RunLayout(cfg.storage.root, run).raw_dir(0)
        raws = [trajectory_from_row(r) for r in read_shard(raw_dir, RAW).to_pylist()]
        chat = load_chat(read_manifest(raw_dir).inputs[0])
        lines = ["| γ | positions | shallow | deep | tokens removed | tokens recomputed | ≠ γ_live | ≠ difflib |",
                 "|---|---|---|---|---|---|---|---|"]
        for g in (0.0, 0.3, 0.5, 0.7, 0.9, 1.01):
            s = replay_stats(raws, g, chat.decode)
            lines.append(f"| {g:g} | {s.positions} | {s.shallow} | {s.deep} | {s.tokens_removed} | {s.tokens_recomputed} "
                         f"| {s.differ_from_live} | {s.differ_from_difflib} |")
        return f"Replay of `{run}` iteration 0 ({len(raws)} raw trajectories):\n\n" + "\n".join(lines)
    except Exception as e:  # noqa: BLE001 - the table is a bonus; say why it is missing
        return f"(replay statistics unavailable: {e})"


def write(results: list[dict], exp: dict, stem: str, wall_s: float) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    OUT.mkdir(parents=True, exist_ok=True)
    arms = list(dict.fromkeys(r["arm"] for r in results))
    fig, axes = plt.subplots(2, 2, figsize=(11, 7))
    for ax, (metric, label) in zip(axes.flat, METRICS):
        for k, arm in enumerate(arms):
            for j, s in enumerate(_series(results, arm, metric, saar=False)):
                ax.plot(range(len(s)), s, color=f"C{k}", alpha=0.9 if j == 0 else 0.5,
                        linestyle="-" if j == 0 else "--", label=arm if j == 0 else None)
        ax.set_title(f"{label} (SAAR off at test time)"), ax.set_xlabel("RL iteration")
    axes.flat[0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(OUT / f"{stem}.png", dpi=90)
    plt.close(fig)

    lines = [f"# Experiment `{stem}` — results (generated)", "",
             f"Wall time: {wall_s / 60:.0f} min on this machine (arms {exp.get('parallel', 1)} at a time). "
             f"Every arm starts from policies/tiny-tool-policy; evaluation on {exp['eval_tasks']} held-out tasks, "
             "T=1.0, mean over seeds. Solid/dashed lines in the plot are seeds 0/1.", "",
             f"![curves]({stem}.png)", ""]
    for saar in (False, True):
        lines += [f"## Per iteration, SAAR {'on' if saar else 'off'} at test time", "",
                  "| arm | seeds | " + " | ".join(f"{label} it0 → final" for _, label in METRICS) + " |",
                  "|---|---|" + "---|" * len(METRICS)]
        for arm in arms:
            seeds = [r["seed"] for r in results if r["arm"] == arm]
            cells = []
            for metric, _ in METRICS:
                c = _mean_curve(_series(results, arm, metric, saar))
                cells.append(f"{c[0]:.3f} → {c[-1]:.3f}" if c else "")
            lines.append(f"| {arm} | {seeds} | " + " | ".join(cells) + " |")
        lines.append("")
    if "saar_g0.5" in arms and "raw" in arms:
        lines += ["## Steps to the baseline's final numbers", ""]
        for metric, label, hib in (("accuracy", "pass@1", True), ("first_call_failure_rate", "first-call failure rate", False)):
            a = _mean_curve(_series(results, "saar_g0.5", metric, False))
            b = _mean_curve(_series(results, "raw", metric, False))
            reach = steps_to_reach(a, b[-1], hib)
            ratio = f"{reach}/{len(b) - 1} = {reach / (len(b) - 1):.2f}" if reach is not None and len(b) > 1 else "not reached"
            lines.append(f"- {label}: raw ends at {b[-1]:.3f} after {len(b) - 1} iterations; saar_g0.5 reaches it at "
                         f"iteration {reach} (steps ratio {ratio})")
        lines.append("")
    root = next(o.split("=", 1)[1] for o in exp["base"] if o.startswith("storage.root="))
    lines += ["## Replay statistics", "", _replay_section(results, str(Path(__file__).resolve().parent.parent / root)), ""]
    page = OUT / f"{stem}.md"
    page.write_text("\n".join(lines) + "\n")
    return page
