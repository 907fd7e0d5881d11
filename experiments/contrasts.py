"""The statistics a result must carry (../shared/docs/EXPERIMENTS.md): contrasts declared in the experiment file
before the run, each paired across training seeds at the final checkpoint, with Student's t interval over the
per-seed differences, p-values Holm-adjusted across the result's contrasts, and an equivalence test (TOST) against
a margin declared with them for any "no difference" claim.

The unit of replication is a training seed: arm and baseline share seed s (the same rollout seed, start policy and
evaluation tasks), so the per-seed difference is the observation and seeds − 1 the degrees of freedom. A binomial
error over evaluation tasks leaves out seed-to-seed training noise, and "the same sign in every seed" is not a test
(with 3 seeds it fires by chance one time in four), so neither decides anything here.

The experiment file's `analysis` section:

    analysis:
      pre_registered: true             # false: declared after the run (a re-analysis); the page says which
      declared: "2026-11-27, before any run"
      alpha: 0.05                      # family-wise, Holm across every contrast below
      margins: {very_first_call_failure_rate: 0.02, accuracy: 0.01}   # equivalence margins, absolute
      contrasts:                       # arm − baseline; a list of metrics or test modes: one contrast each
        - {arm: saar, baseline: raw, metric: very_first_call_failure_rate, saar_at_test: false}
        - {arm: saar, baseline: raw, metric: accuracy, saar_at_test: [false, true]}
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from datetime import datetime, timezone
from math import atan, exp, inf, isfinite, lgamma, log, pi, sqrt
from pathlib import Path
from statistics import mean, stdev

from experiments.stats import final_by_seed
from storage.errors import CleanerError

METRICS = {  # what an experiment's evaluation records per checkpoint and test mode, as the pages name it
    "very_first_call_failure_rate": "very-first-call failure rate (position 0, attempt 0)",
    "retry_success_rate": "retry success rate",
    "accuracy": "pass@1",
    "first_call_failure_rate": "first-call failures per position (mixed protocol)",
}


class AnalysisError(CleanerError, ValueError):
    """An experiment file whose `analysis` section cannot be used; the message names the file and field."""


# -- Student's t, without scipy (not a project dependency) ------------------------------------------------------


def _betacf(a: float, b: float, x: float) -> float:
    """Continued fraction of the regularised incomplete beta function (modified Lentz)."""
    tiny = 1e-300
    c, d = 1.0, 1.0 - (a + b) * x / (a + 1.0)
    d = 1.0 / (d if abs(d) > tiny else tiny)
    h = d
    for m in range(1, 400):
        m2 = 2 * m
        for num in (
            m * (b - m) * x / ((a + m2 - 1) * (a + m2)),
            -(a + m) * (a + b + m) * x / ((a + m2) * (a + m2 + 1)),
        ):
            d = 1.0 + num * d
            d = 1.0 / (d if abs(d) > tiny else tiny)
            c = 1.0 + num / c
            c = c if abs(c) > tiny else tiny
            h *= d * c
        if abs(d * c - 1.0) < 1e-15:
            break
    return h


def _betainc(a: float, b: float, x: float) -> float:
    """I_x(a, b), the regularised incomplete beta function."""
    if x <= 0.0:
        return 0.0
    if x >= 1.0:
        return 1.0
    front = exp(lgamma(a + b) - lgamma(a) - lgamma(b) + a * log(x) + b * log(1.0 - x))
    if x < (a + 1.0) / (a + b + 2.0):
        return front * _betacf(a, b, x) / a
    return 1.0 - front * _betacf(b, a, 1.0 - x) / b


def t_sf(t: float, df: int) -> float:
    """P(T > t) for Student's t with df degrees of freedom."""
    if t == inf:
        return 0.0
    if t == -inf:
        return 1.0
    if df == 1:  # Cauchy: exact, and the continued fraction converges slowest here
        return 0.5 - atan(t) / pi
    tail = 0.5 * _betainc(df / 2.0, 0.5, df / (df + t * t))
    return tail if t >= 0 else 1.0 - tail


def t_quantile(q: float, df: int) -> float:
    """The t with P(T ≤ t) = q (0 < q < 1), by bisection on t_sf (monotone)."""
    if not 0.0 < q < 1.0:
        raise ValueError(f"quantile level must be in (0, 1), got {q}")
    if q < 0.5:
        return -t_quantile(1.0 - q, df)
    lo, hi = 0.0, 1.0
    while t_sf(hi, df) > 1.0 - q:
        hi *= 2.0
    for _ in range(200):
        mid = (lo + hi) / 2.0
        if t_sf(mid, df) > 1.0 - q:
            lo = mid
        else:
            hi = mid
        if hi - lo < 1e-12 * max(1.0, hi):
            break
    return (lo + hi) / 2.0


# -- one paired contrast ---------------------------------------------------------------------------------------


@dataclass(frozen=True)
class PairedT:
    """arm − baseline over the seeds both have: the per-seed differences and Student's t on them."""

    diffs: dict[int, float]  # seed → arm − baseline
    mean: float
    sd: float  # between-seed standard deviation of the differences (nan with one seed)
    se: float
    df: int
    low: float  # two-sided (1 − alpha) t-interval
    high: float
    p: float  # two-sided, H0: mean difference 0 (unadjusted)
    p_equivalence: float  # TOST, H0: |mean difference| ≥ margin (unadjusted); nan without a margin

    @property
    def n(self) -> int:
        return len(self.diffs)


def paired_t(diffs: dict[int, float], alpha: float = 0.05, margin: float | None = None) -> PairedT:
    """Paired t on per-seed differences. With one seed, or the same difference in every seed (no spread: t is
    undefined, and with evaluation rates in steps of 1/tasks two seeds can tie by chance), nothing is tested:
    p and the equivalence p are nan (the interval is the point when there is no spread)."""
    values = [diffs[s] for s in sorted(diffs)]
    n = len(values)
    if n == 0:
        raise ValueError("no seed has both arms")
    m = mean(values)
    nan = float("nan")
    by_seed = dict(sorted(diffs.items()))
    if n < 2:
        return PairedT(diffs=by_seed, mean=m, sd=nan, se=nan, df=0, low=nan, high=nan, p=nan, p_equivalence=nan)
    df = n - 1
    sd = stdev(values)
    if sd <= 1e-12 * max(1.0, abs(m)):  # float noise around identical differences
        return PairedT(diffs=by_seed, mean=m, sd=0.0, se=0.0, df=df, low=m, high=m, p=nan, p_equivalence=nan)
    se = sd / sqrt(n)
    half = t_quantile(1.0 - alpha / 2.0, df) * se
    p = _p_two_sided(m, se, df)
    p_eq = nan if margin is None else max(_p_upper(m + margin, se, df), _p_upper(margin - m, se, df))
    return PairedT(diffs=by_seed, mean=m, sd=sd, se=se, df=df, low=m - half, high=m + half, p=p, p_equivalence=p_eq)


def _p_two_sided(m: float, se: float, df: int) -> float:
    return min(1.0, 2.0 * t_sf(abs(m) / se, df))


def _p_upper(distance: float, se: float, df: int) -> float:
    """One-sided p of H0 'the true difference lies beyond this bound', the observed mean being `distance` inside
    it (TOST's two halves: (mean + margin) for the lower bound, (margin − mean) for the upper)."""
    return t_sf(distance / se, df)


def holm(pvalues: list[float]) -> list[float]:
    """Holm's step-down adjustment, in the input's order: the i-th smallest p times (m − i + 1), made monotone,
    capped at 1. nan p-values (not estimable) stay nan and do not count in m."""
    idx = sorted((i for i, p in enumerate(pvalues) if isfinite(p)), key=lambda i: pvalues[i])
    m = len(idx)
    out = [float("nan")] * len(pvalues)
    running = 0.0
    for rank, i in enumerate(idx):
        running = max(running, min(1.0, (m - rank) * pvalues[i]))
        out[i] = running
    return out


# -- the experiment file's declared contrasts ------------------------------------------------------------------


@dataclass(frozen=True)
class Contrast:
    arm: str
    baseline: str
    metric: str
    saar_at_test: bool

    @property
    def name(self) -> str:
        return f"{self.arm} − {self.baseline}"


@dataclass(frozen=True)
class Analysis:
    pre_registered: bool
    declared: str
    alpha: float
    margins: dict[str, float]
    contrasts: list[Contrast]


def analysis_of(exp: dict, where: str) -> Analysis:
    """The experiment file's `analysis` section, checked against its arms; every refusal names the field."""
    a = exp.get("analysis")
    if not isinstance(a, dict):
        raise AnalysisError(
            f"{where}: no `analysis` section: declare the contrasts, alpha and equivalence margins "
            "(experiments/contrasts.py shows the layout)"
        )
    unknown = set(a) - {"pre_registered", "declared", "alpha", "margins", "contrasts"}
    if unknown:
        raise AnalysisError(f"{where}: analysis.{sorted(unknown)[0]}: unknown field")
    if not isinstance(a.get("pre_registered"), bool):
        raise AnalysisError(f"{where}: analysis.pre_registered: say true (declared before the run) or false")
    alpha = a.get("alpha", 0.05)
    if not isinstance(alpha, (int, float)) or not 0 < alpha < 0.5:
        raise AnalysisError(f"{where}: analysis.alpha: expected a number in (0, 0.5), got {alpha!r}")
    margins = a.get("margins") or {}
    for metric, margin in margins.items():
        if metric not in METRICS:
            raise AnalysisError(f"{where}: analysis.margins.{metric}: unknown metric (one of {', '.join(METRICS)})")
        if not isinstance(margin, (int, float)) or not margin > 0:
            raise AnalysisError(f"{where}: analysis.margins.{metric}: expected a positive number, got {margin!r}")
    arms = set(exp.get("arms", {}))
    contrasts = []
    for i, c in enumerate(a.get("contrasts") or []):
        field = f"{where}: analysis.contrasts[{i}]"
        if not isinstance(c, dict) or set(c) != {"arm", "baseline", "metric", "saar_at_test"}:
            raise AnalysisError(f"{field}: expected {{arm, baseline, metric, saar_at_test}}, got {c!r}")
        for key in ("arm", "baseline"):
            if c[key] not in arms:
                raise AnalysisError(f"{field}.{key}: {c[key]!r} is not an arm of the experiment")
        if c["arm"] == c["baseline"]:
            raise AnalysisError(f"{field}: arm and baseline are both {c['arm']!r}")
        # a list of metrics or of test modes declares one contrast per combination
        for metric in c["metric"] if isinstance(c["metric"], list) else [c["metric"]]:
            if metric not in METRICS:
                raise AnalysisError(f"{field}.metric: {metric!r} is not one of {', '.join(METRICS)}")
            if metric not in margins:
                raise AnalysisError(f"{field}.metric: {metric} has no equivalence margin in analysis.margins")
            for saar in c["saar_at_test"] if isinstance(c["saar_at_test"], list) else [c["saar_at_test"]]:
                if not isinstance(saar, bool):
                    raise AnalysisError(f"{field}.saar_at_test: expected true or false, got {saar!r}")
                contrasts.append(Contrast(c["arm"], c["baseline"], metric, saar))
    if not contrasts:
        raise AnalysisError(f"{where}: analysis.contrasts: declare at least one")
    if len(set(contrasts)) != len(contrasts):
        raise AnalysisError(f"{where}: analysis.contrasts: a contrast is declared twice")
    return Analysis(a["pre_registered"], str(a.get("declared", "")), float(alpha), dict(margins), contrasts)


@dataclass(frozen=True)
class ContrastResult:
    contrast: Contrast
    margin: float
    stats: PairedT | None  # None: no seed has both arms (not run yet)
    p_holm: float
    p_equivalence_holm: float

    def verdict(self, alpha: float) -> str:
        """What the contrast supports at the family-wise alpha: a difference, equivalence within the margin,
        both (a real difference smaller than the margin), or nothing."""
        if self.stats is None:
            return "not run"
        if self.stats.n < 2:
            return "not estimable (one seed)"
        if self.stats.sd == 0.0:
            return (
                "identical in every seed"
                if self.stats.mean == 0.0
                else "not estimable (the same difference in every seed)"
            )
        differs = self.p_holm < alpha
        equivalent = self.p_equivalence_holm < alpha
        direction = "higher" if self.stats.mean > 0 else "lower"
        if differs and equivalent:
            return f"{direction}, by less than ±{self.margin:g}"
        if differs:
            return f"{direction} than {self.contrast.baseline}"
        if equivalent:
            return f"equivalent within ±{self.margin:g}"
        return "inconclusive"


def evaluate(results: list[dict], analysis: Analysis) -> list[ContrastResult]:
    """Every declared contrast on the results, Holm-adjusted across them (difference and equivalence p-values
    each as one family); contrasts whose arms have not run are kept as 'not run' and do not count."""
    stats: list[PairedT | None] = []
    for c in analysis.contrasts:
        a = final_by_seed(results, c.arm, c.metric, c.saar_at_test)
        b = final_by_seed(results, c.baseline, c.metric, c.saar_at_test)
        diffs = {s: a[s] - b[s] for s in a.keys() & b.keys()}
        stats.append(paired_t(diffs, analysis.alpha, analysis.margins[c.metric]) if diffs else None)
    nan = float("nan")
    p = holm([s.p if s else nan for s in stats])
    p_eq = holm([s.p_equivalence if s else nan for s in stats])
    return [
        ContrastResult(c, analysis.margins[c.metric], s, p[i], p_eq[i])
        for i, (c, s) in enumerate(zip(analysis.contrasts, stats))
    ]


def _num(v: float, fmt: str = "+.3f") -> str:
    return "—" if v != v else format(v, fmt)


def _p(v: float) -> str:
    return "—" if v != v else ("< 0.001" if v < 0.001 else f"{v:.3f}")


def contrast_table(rows: list[ContrastResult], alpha: float) -> list[str]:
    """One row per declared contrast: per-seed differences, mean ± s.e., the t-interval, Holm-adjusted p of a
    difference and of equivalence within the margin, and the verdict."""
    level = f"{100 * (1 - alpha):g}%"
    lines = [
        f"| contrast | metric | SAAR at test | n | per seed (arm − baseline) | mean ± s.e. | {level} t-interval | "
        "p (Holm) | margin | p equivalent (TOST, Holm) | verdict |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        c, s = r.contrast, r.stats
        head = f"| {c.name} | {METRICS[c.metric]} | {'on' if c.saar_at_test else 'off'} |"
        if s is None:
            lines.append(f"{head} 0 | — | — | — | — | ±{r.margin:g} | — | not run |")
            continue
        per_seed = ", ".join(f"s{seed} {d:+.3f}" for seed, d in s.diffs.items())
        lines.append(
            f"{head} {s.n} | {per_seed} | {_num(s.mean)} ± {_num(s.se, '.3f')} | "
            f"[{_num(s.low)}, {_num(s.high)}] | {_p(r.p_holm)} | ±{r.margin:g} | {_p(r.p_equivalence_holm)} | "
            f"{r.verdict(alpha)} |"
        )
    return lines


# -- the record that the analysis was declared before the results ------------------------------------------------


def record_registration(exp: dict, record: Path, have_results: bool) -> str:
    """Before the runs: keep the experiment file's `analysis` section, with the time, beside the results
    (docs/results/<stem>.registration.json), so that the page can show it was declared before any result existed.
    Written once, before the first result; rewritten only while there is still no result. Returns a line to print."""
    from storage.shards import atomic_write_json

    analysis = exp.get("analysis")
    if record.exists():
        kept = json.loads(record.read_text())
        if kept["analysis"] == analysis:
            return f"analysis as registered at {kept['declared_at']} ({record.name})"
        if have_results:
            return (
                f"the analysis section differs from the one registered at {kept['declared_at']} before the first "
                f"result ({record.name}): the page will say so"
            )
    atomic_write_json(
        record,
        {
            "declared_at": datetime.now(timezone.utc).isoformat(timespec="seconds"),
            "before_any_result": not have_results,
            "analysis": analysis,
        },
    )
    return f"analysis registered in {record.name}" + ("" if not have_results else " (after results existed)")


def registration_note(exp: dict, record: Path) -> str:
    """How the page may describe the analysis, from the record kept before the runs: pre-registered only when the
    record was written before any result and still matches the experiment file."""
    analysis = exp.get("analysis") or {}
    if not analysis.get("pre_registered"):
        return ""
    if not record.exists():
        return (
            f" No record of the declaration from before the runs ({record.name}) is kept beside the results, "
            "so the page cannot show it."
        )
    kept = json.loads(record.read_text())
    if kept["analysis"] != analysis:
        return (
            f" The experiment file's analysis section differs from the one registered at {kept['declared_at']} "
            f"({record.name}): the contrasts below are the file's current ones, not the registered ones."
        )
    if not kept.get("before_any_result"):
        return f" It was recorded at {kept['declared_at']}, after results existed ({record.name})."
    return (
        f" Registered at {kept['declared_at']}, before this experiment's results file existed ({record.name}; "
        "that time is the one the run wrote there: git shows when the record was committed)."
    )
