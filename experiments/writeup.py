"""The write-up of "Should I turn SAAR on?", generated from the committed experiment files and their results:

    python -m experiments.writeup            # the pages of both experiments, then the write-up
    python -m experiments.writeup --check    # say which inputs are there, write nothing

Inputs: configs/experiments/{should_i_turn_saar_on,plan_b_slowdown}.yaml, docs/results/<stem>.json (written by
`python -m experiments.run`), docs/results/gradient_probe.json (written by `python -m experiments.probe`).
Output: each experiment's page (docs/results/<stem>.md, redrawn from its JSON) and
docs/results/should_i_turn_saar_on_writeup.md.

Every finding is a sentence built from one declared contrast: it names the contrast (arm − baseline), the metric
and test mode, the mean difference with its t-interval over seeds, n and the Holm-adjusted p; the words it uses
("lower", "equivalent within ±m", "inconclusive") are the contrast's verdict, so the text cannot be stronger
than the analysis. Nothing in the prose is typed in by hand from a number.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from dataclasses import dataclass
from pathlib import Path

import yaml

from experiments.contrasts import METRICS, ContrastResult, _p, analysis_of, evaluate, paired_t, t_quantile
from experiments.stats import final_by_seed

REPO = Path(__file__).resolve().parent.parent
OUT = REPO / "docs" / "results"
MAIN = "should_i_turn_saar_on"
PLAN_B = "plan_b_slowdown"
PROBE = "gradient_probe"
WRITEUP = OUT / f"{MAIN}_writeup.md"
LOWER_IS_BETTER = {"very_first_call_failure_rate", "first_call_failure_rate"}


@dataclass(frozen=True)
class Experiment:
    stem: str
    exp: dict
    results: list[dict]

    @property
    def where(self) -> str:
        return f"configs/experiments/{self.stem}.yaml"


def load(stem: str, repo: Path = REPO) -> Experiment | None:
    """The experiment file and its results, or None when it has not run yet (no results file)."""
    results = repo / "docs" / "results" / f"{stem}.json"
    if not results.exists():
        return None
    exp = yaml.safe_load((repo / "configs" / "experiments" / f"{stem}.yaml").read_text())
    return Experiment(stem, exp, json.loads(results.read_text()))


# -- one sentence per contrast ---------------------------------------------------------------------------------


def _test_mode(saar: bool) -> str:
    return f"SAAR {'on' if saar else 'off'} at test"


def interval(r: ContrastResult, alpha: float) -> str:
    """mean [low, high] (level t-interval, n = k seeds; Holm p): the numbers every finding carries."""
    s = r.stats
    assert s is not None
    level = f"{100 * (1 - alpha):g}%"
    if s.n < 2:
        return f"{s.mean:+.3f} (n = {s.n} seed: no interval)"
    p = _p(r.p_holm)
    return f"{s.mean:+.3f} ({level} t-interval [{s.low:+.3f}, {s.high:+.3f}], n = {s.n} seeds; Holm p = {p})"


def finding(r: ContrastResult, alpha: float) -> str:
    """One declared contrast as one sentence, at the strength of its verdict."""
    c = r.contrast
    head = f"`{c.name}`, {METRICS[c.metric]}, {_test_mode(c.saar_at_test)}"
    if r.stats is None:
        return f"{head}: not run (n = 0)."
    verdict = r.verdict(alpha)
    numbers = interval(r, alpha)
    if verdict.startswith(("higher", "lower")):
        direction = "higher" if r.stats.mean > 0 else "lower"
        side = "better" if (direction == "lower") == (c.metric in LOWER_IS_BETTER) else "worse"
        small = f", by less than the ±{r.margin:g} margin" if "less than" in verdict else ""
        return f"{head}: {c.arm} is {direction} ({side}) than {c.baseline}{small}, {numbers}."
    if verdict.startswith("equivalent"):
        return (
            f"{head}: {c.arm} and {c.baseline} are equivalent within ±{r.margin:g} "
            f"(TOST Holm p = {_p(r.p_equivalence_holm)}), {numbers}."
        )
    if verdict == "inconclusive":
        return f"{head}: inconclusive, neither a difference nor equivalence within ±{r.margin:g} is shown, {numbers}."
    return f"{head}: {verdict}, {numbers}."


def findings(e: Experiment) -> tuple[list[ContrastResult], list[str]]:
    analysis = analysis_of(e.exp, e.where)
    rows = evaluate(e.results, analysis)
    return rows, [finding(r, analysis.alpha) for r in rows]


def exploratory(results: list[dict], arm: str, baseline: str, metric: str, alpha: float) -> str:
    """An undeclared contrast, SAAR off at test, as one sentence that says so: its p is unadjusted and it is in no
    Holm family, so it can qualify a registered finding but not make one."""
    a, b = final_by_seed(results, arm, metric, False), final_by_seed(results, baseline, metric, False)
    s = paired_t({k: a[k] - b[k] for k in a.keys() & b.keys()}, alpha)
    return (
        f"`{arm} − {baseline}`, {METRICS[metric]}, {_test_mode(False)}: {s.mean:+.3f} ({100 * (1 - alpha):g}% "
        f"t-interval [{s.low:+.3f}, {s.high:+.3f}], n = {s.n} seeds; unadjusted p = {_p(s.p)}; exploratory, not "
        "registered)"
    )


def seeds_for_equivalence(r: ContrastResult, alpha: float) -> int | None:
    """How many seeds a TOST at the contrast's margin would need to show equivalence with the observed spread of
    the differences, were the true difference 0 (before any Holm correction): what the design could resolve."""
    s = r.stats
    if s is None or s.n < 2 or not s.sd > 0:
        return None
    n = 2
    while t_quantile(1 - alpha, n - 1) * s.sd / n**0.5 >= r.margin and n < 10_000:
        n += 1
    return n


def resolution_sentence(r: ContrastResult, alpha: float) -> str:
    """What an inconclusive `saar − raw` could and could not have shown."""
    c, s, need = r.contrast, r.stats, seeds_for_equivalence(r, alpha)
    return (
        f"What `{c.name}` could resolve ({METRICS[c.metric]}, n = {s.n} seeds, {100 * (1 - alpha):g}% t-interval "
        f"[{s.low:+.3f}, {s.high:+.3f}]): with the differences' spread between seeds (sd {s.sd:.3f}), showing "
        f"equivalence within ±{r.margin:g} needs about {need} seeds even at a true difference of 0; "
        "the interval also admits effects as large as the ones found below. Inconclusive is not no effect."
    )


# -- steps to the baseline's final value (the paper's "a third of the steps") ----------------------------------


def _curve(results: list[dict], arm: str, seed: int, metric: str, saar: bool) -> list[tuple[int, float]]:
    for r in results:
        if r["arm"] == arm and r["seed"] == seed:
            return sorted(
                (e["iteration"], e[metric])
                for e in r["evals"]
                if e["saar_at_test"] == saar and e.get(metric) is not None
            )
    return []


def steps_to_target(
    results: list[dict], arm: str, baseline: str, metric: str, saar: bool
) -> tuple[dict[int, int | None], int]:
    """Per seed: the first evaluated iteration at which the arm reaches the same seed's baseline at its final
    checkpoint (None: not within the run), and that final iteration."""
    out, last = {}, 0
    seeds = sorted(
        {r["seed"] for r in results if r["arm"] == arm} & {r["seed"] for r in results if r["arm"] == baseline}
    )
    for seed in seeds:
        a, b = _curve(results, arm, seed, metric, saar), _curve(results, baseline, seed, metric, saar)
        if not a or not b:
            continue
        target, last = b[-1][1], b[-1][0]
        reached = [i for i, v in a if (v <= target if metric in LOWER_IS_BETTER else v >= target)]
        out[seed] = reached[0] if reached else None
    return out, last


def clopper_pearson(k: int, n: int, alpha: float = 0.05) -> tuple[float, float]:
    """Exact binomial interval for k of n, by bisection on the regularized incomplete beta function."""
    from experiments.contrasts import _betainc

    def solve(f) -> float:
        lo, hi = 0.0, 1.0
        for _ in range(60):
            mid = (lo + hi) / 2
            lo, hi = (mid, hi) if f(mid) else (lo, mid)
        return (lo + hi) / 2

    low = 0.0 if k == 0 else solve(lambda p: _betainc(k, n - k + 1, p) < alpha / 2)
    high = 1.0 if k == n else solve(lambda p: _betainc(k + 1, n - k, p) < 1 - alpha / 2)
    return low, high


def steps_sentence(results: list[dict], arm: str, baseline: str, metric: str, saar: bool, alpha: float) -> str:
    reach, last = steps_to_target(results, arm, baseline, metric, saar)
    n = len(reach)
    if not n or not last:
        return f"`{arm} − {baseline}` steps to target, {METRICS[metric]}, {_test_mode(saar)}: not run (n = 0)."
    grid = sorted({i for i, _ in _curve(results, arm, next(iter(reach)), metric, saar)})
    half = [i for i in grid if 0 < i < last]
    by = half[0] if half else last
    k = sum(1 for v in reach.values() if v is not None and v <= by)
    low, high = clopper_pearson(k, n, alpha)
    per_seed = ", ".join(f"s{s} {'—' if v is None else v}" for s, v in reach.items())
    return (
        f"`{arm} − {baseline}` steps to target, {METRICS[metric]}, {_test_mode(saar)}: {arm} reached the same "
        f"seed's {baseline} final value (iteration {last}) by iteration {by} ({by / last:.2f} of the steps) in "
        f"{k} of n = {n} seeds ({100 * (1 - alpha):g}% Clopper-Pearson interval [{low:.2f}, {high:.2f}]; per seed "
        f"first iteration reached: {per_seed}; evaluated at iterations {grid})."
    )


# -- the gradient probe ----------------------------------------------------------------------------------------


def probe_sentences(probe: dict, alpha: float) -> list[str]:
    """The probe's contrasts as experiments/probe.py stores them (analysis.contrasts: arm, baseline, mean, t-interval,
    n and Holm p, with the probe's verdict), one sentence each."""
    out = []
    for c in probe["analysis"]["contrasts"]:
        p = _p(float("nan") if c.get("p_holm") is None else c["p_holm"])
        out.append(
            f"`{c['arm']} − {c['baseline']}`, Δ log-odds of the injected bug after one update: {c['mean']:+.4f} "
            f"({100 * (1 - alpha):g}% t-interval [{c['low']:+.4f}, {c['high']:+.4f}], n = {c['n']} seeds; "
            f"Holm p = {p}): {c['verdict']}."
        )
    return out


def probe_verdict(probe: dict) -> str:
    """The probe's overall verdict: the paragraph of its verdict text that says it."""
    return next((t for t in probe.get("verdict_text", []) if t.startswith("Overall")), "")


# -- the page ----------------------------------------------------------------------------------------------------


def _design(e: Experiment) -> list[str]:
    seeds = sorted({r["seed"] for r in e.results})
    arms = list(dict.fromkeys(r["arm"] for r in e.results))
    lines = [f"- `{e.where}`: arms {', '.join(f'`{a}`' for a in arms)}; seeds {seeds} (n = {len(seeds)} per arm)."]
    lines += [f"  - {b.strip()}" for b in e.exp.get("banners", [])]
    commits = sorted({r["commit"] for r in e.results if r.get("commit")})
    if commits:
        lines.append(f"  - code: {', '.join(commits)} (recorded by each run)")
    for name, spec in e.exp["arms"].items():
        lines.append(f"  - `{name}`: {' '.join(spec['overrides'])}")
    return lines


def redraw_page(e: Experiment) -> Path:
    """The experiment's page from its stored results. Its wall time is the runs' own (training plus evaluation,
    over the arms run at once): a resumed experiment's last session alone would understate it."""
    from experiments.report import write as write_page

    run_s = sum(r["train_s"] + sum(ev.get("wall_s", 0.0) for ev in r["evals"]) for r in e.results)
    return write_page(e.results, e.exp, e.stem, run_s / e.exp.get("parallel", 1), e.where)


def _grid(e: Experiment) -> list[int]:
    return sorted({ev["iteration"] for r in e.results for ev in r["evals"]})


def _level(e: Experiment) -> float:
    return analysis_of(e.exp, e.where).alpha


def write(repo: Path = REPO) -> Path:
    main = load(MAIN, repo)
    if main is None:
        raise SystemExit(
            f"docs/results/{MAIN}.json is missing: run python -m experiments.run configs/experiments/{MAIN}.yaml"
        )
    plan_b = load(PLAN_B, repo)
    probe_file = repo / "docs" / "results" / f"{PROBE}.json"
    probe = json.loads(probe_file.read_text()) if probe_file.exists() else None
    alpha = _level(main)
    rows, main_findings = findings(main)
    by_name = {(r.contrast.name, r.contrast.metric, r.contrast.saar_at_test): f for r, f in zip(rows, main_findings)}

    def pick(arm: str, base: str) -> list[str]:
        return [f for (name, _, _), f in by_name.items() if name == f"{arm} − {base}"]

    headline = [
        r
        for r in rows
        if r.contrast.name == "saar − raw"
        and r.contrast.metric == "very_first_call_failure_rate"
        and not r.contrast.saar_at_test
        and r.verdict(alpha) == "inconclusive"
    ]
    arms = {r["arm"] for r in main.results}
    vfcf = "very_first_call_failure_rate"

    lines = [
        "# Should I turn SAAR on? (write-up, generated)",
        "",
        "Generated by `python -m experiments.writeup` from the committed experiment files and their results. A "
        "finding is one pre-registered contrast with its t-interval over seeds, n and Holm-adjusted p "
        "(experiments/contrasts.py), unless it says otherwise: sentences marked exploratory, the steps to target, "
        "the gradient probe and the γ section were not registered. The retries were sampled with independent seeds "
        "(after the retry-seed fix).",
        "",
        "## Design",
        "",
        *_design(main),
    ]
    if plan_b:
        lines += _design(plan_b)
    lines += [
        "",
        "Unit of replication: the training seed (arm and baseline share seed s: rollout seed, start policy, "
        "evaluation tasks). Final checkpoint: iteration "
        f"{max(e['iteration'] for r in main.results for e in r['evals'])}. Headline metric: the very first call's "
        "failure rate (position 0, attempt 0), the same protocol with SAAR off and on at test.",
        "",
        "## The answer in one place",
        "",
        "SAAR as the paper runs it against raw on the headline metric, then every pre-registered contrast that "
        "shows a difference after Holm's correction (each repeated from its section below):",
        "",
        *[f"- {f}" for f in pick("saar", "raw")[:1]],
        *[f"- {f}" for r, f in zip(rows, main_findings) if r.verdict(alpha).startswith(("higher", "lower"))],
        "",
        "## Does training with SAAR change first-call errors, accuracy or retries? (`saar − raw`)",
        "",
        *[f"- {f}" for f in pick("saar", "raw")],
        *[f"- {resolution_sentence(r, alpha)}" for r in headline[:1]],
        "",
        "## The live-mode confound and purification alone",
        "",
        *[f"- {f}" for f in pick("saar_lived_raw", "saar") + pick("saar_lived_raw", "raw")],
        "",
        "## Credit assignment: outcome-aware purification (`saar_correct − raw`)",
        "",
        *[f"- {f}" for f in pick("saar_correct", "raw")],
        *(
            [
                "- The loss-normalisation control (EXPERIMENTS.md) was registered for `saar` only. Against it, "
                + exploratory(main.results, "saar_correct", "raw_seq_mean", vfcf, alpha)
                + ". The control alone moves the same rate (`raw_seq_mean − raw`, below): part of this effect may be "
                "the loss's weighting of rows, not outcome-aware purification."
            ]
            if {"saar_correct", "raw_seq_mean"} <= arms
            else []
        ),
        "",
        "## The reference's DPO on tool calls (`saar_dpo − saar`)",
        "",
        *[f"- {f}" for f in pick("saar_dpo", "saar")],
        *(
            [
                "- The registered baseline is `saar`; against raw, "
                + exploratory(main.results, "saar_dpo", "raw", vfcf, alpha)
                + "."
            ]
            if {"saar_dpo", "raw"} <= arms
            else []
        ),
        "",
        "## Loss normalisation (`raw_seq_mean`)",
        "",
        *[f"- {f}" for f in pick("raw_seq_mean", "raw") + pick("saar", "raw_seq_mean")],
        "",
        '## Steps to target (the paper\'s "a third of the steps"; exploratory, not registered)',
        "",
        f"Checkpoints were evaluated at iterations {_grid(main)}, so a third of the steps is resolved only where "
        "the grid has it; the interval is an exact binomial one over seeds, since a seed either reached the "
        "target by then or did not.",
        "",
    ]
    for metric in ("accuracy", "very_first_call_failure_rate"):
        lines.append(f"- {steps_sentence(main.results, 'saar', 'raw', metric, False, alpha)}")
    lines.append(
        f"- {steps_sentence(main.results, 'saar_correct', 'raw', 'very_first_call_failure_rate', False, alpha)}"
    )
    lines += ["", "## Plan B's slowdown: the rule or the live mechanics?", ""]
    plan_b = plan_b or Experiment(
        PLAN_B, yaml.safe_load((repo / "configs" / "experiments" / f"{PLAN_B}.yaml").read_text()), []
    )
    lines += [f"- {f}" for f in findings(plan_b)[1]]
    if not plan_b.results:
        lines.append(f"  (docs/results/{PLAN_B}.json is missing: `python -m experiments.run {plan_b.where}`)")
    lines += ["", "## The mechanism: a one-update gradient probe (not registered with the experiment)", ""]
    if probe:
        lines += [
            "Its contrasts are declared in experiments/probe.py, which was committed with its results: they were not "
            "registered before it ran. "
            'The explanation tested: purification deletes the only direct "do not write this" signal raw GRPO '
            "has (its failed calls trained under a negative advantage). One update from the start policy per "
            "partition of each seed's iteration-0 raw shard; readout the change in the log-odds of an injected "
            f"bug over {probe['bank_items']} labelled first calls ([page](gradient_probe.md)).",
            "",
            *[f"- {s}" for s in probe_sentences(probe, alpha)],
            "",
            probe_verdict(probe),
        ]
    else:
        lines.append(
            f"- `partition − raw` probe: not run, docs/results/{PROBE}.json is missing (n = 0): "
            "`python -m experiments.probe`."
        )
    lines += [
        "",
        "## γ",
        "",
        "This experiment gives no γ advice: it ran one γ (0.5), and its replay table over γ was not computed (the "
        "page's replay section failed on a bug, since fixed, and its stores are gone). In the earlier, "
        "coupled-retry world of cleaner_vs_raw_writeup.md every call-segment similarity observed was ≥ 0.84, so "
        "every γ below that gave the same training data. Look at your own first raw shard instead: "
        "`cleaner replay --run R --iteration 0 --sweep` shows which γ "
        "values change any splice decision there (only those can change what is trained), with example pairs "
        "around each γ.",
        "",
    ]
    path = repo / "docs" / "results" / f"{MAIN}_writeup.md"
    path.write_text("\n".join(lines))
    return path


def unsupported_sentences(text: str) -> list[str]:
    """Finding sentences (bullets under a '## ' heading after Design) that lack a contrast name, an interval or an
    n: the write-up's own check that no claim is stated without its numbers."""
    bad, section = [], ""
    for line in text.splitlines():
        if line.startswith("## "):
            section = line
            continue
        if section in ("", "## Design", "## γ") or not line.startswith("- "):
            continue
        has_contrast = re.search(r"`[\w]+ − [\w]+", line) is not None
        has_n = re.search(r"\bn = \d+", line) is not None
        has_interval = "interval [" in line or "(n = 0)" in line or "no interval" in line
        if not (has_contrast and has_n and has_interval):
            bad.append(line)
    return bad


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--check", action="store_true", help="say which inputs are present and write nothing")
    args = ap.parse_args(argv)
    inputs = [OUT / f"{MAIN}.json", OUT / f"{PLAN_B}.json", OUT / f"{PROBE}.json"]
    for f in inputs:
        print(f"[writeup] {'have' if f.exists() else 'missing'} {f.relative_to(REPO)}")
    if args.check:
        return 0
    for stem in (MAIN, PLAN_B):
        e = load(stem)
        if e is not None:
            print(f"[writeup] redrew {redraw_page(e).relative_to(REPO)}")
    path = write()
    bad = unsupported_sentences(path.read_text())
    print(f"[writeup] wrote {path.relative_to(REPO)}")
    if bad:
        print(f"[writeup] {len(bad)} findings lack a contrast, an interval or an n:", *bad, sep="\n  ", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
