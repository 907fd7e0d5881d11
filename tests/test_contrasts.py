"""The statistics a result must carry (experiments/contrasts.py): Student's t without scipy, paired t-intervals over
seeds, Holm's adjustment across a result's contrasts, TOST equivalence against a declared margin, and the experiment
file's `analysis` section. Expected values are literals derived by hand from closed forms, never from the code under
test: for 1, 2 and 3 degrees of freedom Student's t has elementary CDFs,

    df = 1: F(t) = 1/2 + atan(t)/π
    df = 2: F(t) = 1/2 + t / (2·sqrt(t² + 2))
    df = 3: F(t) = 1/2 + (1/π)·[u/(1 + u²) + atan(u)],  u = t/√3

while the code computes every df through the regularised incomplete beta function."""

import math

import pytest

from experiments.contrasts import AnalysisError, analysis_of, contrast_table, evaluate, holm, paired_t, t_quantile, t_sf


def test_t_quantiles_match_the_closed_forms_and_the_printed_tables():
    # df = 1: tan(0.475·π) = 12.7062047362; df = 2: q = 0.975 → a = 2q − 1 = 0.95, t = a·sqrt(2 / (1 − a²))
    # = 0.95·sqrt(2 / 0.0975) = 0.95·4.52910810 = 4.30265273; df = 3: 3.18244631 (F(t) = 0.975 in the df = 3 form)
    assert t_quantile(0.975, 1) == pytest.approx(12.7062047362, abs=1e-8)
    assert t_quantile(0.975, 2) == pytest.approx(4.3026527297, abs=1e-8)
    assert t_quantile(0.975, 3) == pytest.approx(3.1824463053, abs=1e-8)
    # Printed t tables (two-sided 95% and 90%): 2.364624 (7 df), 1.894579 (7 df, 0.95), 2.262157 (9 df), 2.042272
    # (30 df); large df tends to the normal's 1.959964
    assert t_quantile(0.975, 7) == pytest.approx(2.364624, abs=1e-6)
    assert t_quantile(0.95, 7) == pytest.approx(1.894579, abs=1e-6)
    assert t_quantile(0.975, 9) == pytest.approx(2.262157, abs=1e-6)
    assert t_quantile(0.975, 30) == pytest.approx(2.042272, abs=1e-6)
    assert t_quantile(0.975, 100_000) == pytest.approx(1.959964, abs=1e-4)
    assert t_quantile(0.025, 7) == pytest.approx(-2.364624, abs=1e-6)  # symmetric
    # tails: df = 2, t = 5·√3 = 8.66025404: P(T > t) = 1/2 − t/(2·sqrt(77)) = 1/2 − 8.66025404/17.54992877
    # = 0.5 − 0.49346377 = 0.00653623
    assert t_sf(5 * math.sqrt(3), 2) == pytest.approx(0.0065362288, abs=1e-9)
    assert t_sf(-5 * math.sqrt(3), 2) == pytest.approx(1 - 0.0065362288, abs=1e-9)
    with pytest.raises(ValueError):
        t_quantile(1.0, 3)


def test_paired_t_interval_by_hand_four_seeds():
    # diffs 0.02, 0.04, 0.00, 0.02: mean 0.02; squared deviations 0, 0.0004, 0.0004, 0 → sum 0.0008;
    # variance 0.0008/3 = 0.000266667; sd 0.0163299316; se = sd/√4 = 0.0081649658
    # t(0.975, 3) = 3.1824463053 → half-width 3.1824463053 × 0.0081649658 = 0.0259845653
    # interval [0.02 − 0.0259845653, 0.02 + 0.0259845653] = [−0.0059845653, 0.0459845653]
    # t = 0.02 / 0.0081649658 = 2.4494897 = √6; df = 3: u = √2, u/(1 + u²) = √2/3 = 0.4714045208,
    # atan(√2) = 0.9553166181 → F = 1/2 + 1.4267211389/π = 0.9541394433 → two-sided p = 2 × 0.0458605567 = 0.0917211133
    # TOST at margin 0.05: the lower test (mean + 0.05)/se = 8.573 is far out; the upper (0.02 − 0.05)/se
    # = −3.6742346 = −(3/√2)·√3 → u = −3/√2 = −2.1213203, u/(1 + u²) = −2.1213203/5.5 = −0.3856946,
    # atan(u) = −1.1302857 → P(T ≤ −3.6742346) = 1/2 − 1.5159803/π = 0.5 − 0.4825515 = 0.0174485 (0.0174484923)
    p = paired_t({2: 0.00, 0: 0.02, 1: 0.04, 3: 0.02}, alpha=0.05, margin=0.05)
    assert list(p.diffs) == [0, 1, 2, 3] and p.n == 4 and p.df == 3
    assert p.mean == pytest.approx(0.02)
    assert p.sd == pytest.approx(0.0163299316, abs=1e-10)
    assert p.se == pytest.approx(0.0081649658, abs=1e-10)
    assert (p.low, p.high) == pytest.approx((-0.0059845653, 0.0459845653), abs=1e-9)
    assert p.p == pytest.approx(0.0917211133, abs=1e-9)
    assert p.p_equivalence == pytest.approx(0.0174484923, abs=1e-9)


def test_paired_t_three_seeds_all_one_sign():
    # diffs 0.03, 0.02, 0.025: mean 0.025, deviations ±0.005 and 0 → variance 0.00005/2 = 0.000025, sd 0.005,
    # se 0.005/√3 = 0.0028867513; t(0.975, 2) = 4.3026527297 → half-width 0.0124206886, interval
    # [0.0125793114, 0.0374206886]; t = 0.025/0.0028867513 = 5√3 → p = 1 − t/sqrt(t² + 2) = 1 − 8.66025404/8.77496439
    # = 0.0130724576
    p = paired_t({0: 0.03, 1: 0.02, 2: 0.025})
    assert p.se == pytest.approx(0.0028867513, abs=1e-10)
    assert (p.low, p.high) == pytest.approx((0.0125793114, 0.0374206886), abs=1e-9)
    assert p.p == pytest.approx(0.0130724576, abs=1e-9)
    assert math.isnan(p.p_equivalence)  # no margin, no equivalence test


def test_one_seed_or_no_spread_is_not_tested():
    one = paired_t({4: 0.01}, margin=0.02)
    assert one.n == 1 and all(math.isnan(v) for v in (one.se, one.low, one.high, one.p, one.p_equivalence))
    # two seeds each 3 tasks in 300 better: 0.6866… − 0.6766… and 0.6966… − 0.6866… (a real page's pair) differ by
    # float noise only; t would be ~1e15 and p ~0, which says nothing about the arms
    tie = paired_t(
        {0: 0.6866666666666666 - 0.6766666666666666, 1: 0.6966666666666667 - 0.6866666666666666}, margin=0.02
    )
    assert tie.sd == 0.0 and (tie.low, tie.high) == (tie.mean, tie.mean)
    assert math.isnan(tie.p) and math.isnan(tie.p_equivalence)
    flat = paired_t({0: 0.0, 1: 0.0, 2: 0.0}, margin=0.02)  # an A/A pair (byte-identical arms)
    assert (flat.mean, flat.sd, flat.low, flat.high) == (0.0, 0.0, 0.0, 0.0)
    with pytest.raises(ValueError):
        paired_t({})


def test_holm_by_hand():
    # p = 0.01, 0.04, 0.03, 0.005 (m = 4). Sorted: 0.005 × 4 = 0.02; 0.01 × 3 = 0.03; 0.03 × 2 = 0.06;
    # 0.04 × 1 = 0.04 → raised to the running maximum 0.06. Back in input order: 0.03, 0.06, 0.06, 0.02.
    assert holm([0.01, 0.04, 0.03, 0.005]) == pytest.approx([0.03, 0.06, 0.06, 0.02])
    # capped at 1: 0.3 × 3 = 0.9, 0.4 × 2 = 0.8 → 0.9, 0.5 × 1 → 0.9 (monotone)
    assert holm([0.5, 0.3, 0.4]) == pytest.approx([0.9, 0.9, 0.9])
    assert holm([0.6, 0.7]) == pytest.approx([1.0, 1.0])
    # a not-estimable contrast (nan) stays nan and does not count: 0.01 × 2, 0.02 × 1 → 0.02
    out = holm([0.02, float("nan"), 0.01])
    assert out[0] == pytest.approx(0.02) and math.isnan(out[1]) and out[2] == pytest.approx(0.02)
    assert holm([]) == []


def _run(arm: str, seed: int, **final) -> dict:
    return {
        "arm": arm,
        "seed": seed,
        "evals": [
            {"iteration": 0, "saar_at_test": False, "accuracy": 0.5, "very_first_call_failure_rate": 0.3},
            {"iteration": 20, "saar_at_test": False, **final},
            {"iteration": 20, "saar_at_test": True, "accuracy": 0.0, "very_first_call_failure_rate": 1.0},
        ],
    }


EXP = {
    "arms": {"raw": {}, "saar": {}, "saar_correct": {}, "later": {}},
    "analysis": {
        "pre_registered": True,
        "alpha": 0.05,
        "margins": {"very_first_call_failure_rate": 0.02, "accuracy": 0.02},
        "contrasts": [
            {"arm": "saar_correct", "baseline": "raw", "metric": "very_first_call_failure_rate", "saar_at_test": False},
            {
                "arm": "saar",
                "baseline": "raw",
                "metric": ["very_first_call_failure_rate", "accuracy"],
                "saar_at_test": False,
            },
            {"arm": "later", "baseline": "raw", "metric": "accuracy", "saar_at_test": False},
        ],
    },
}


def test_declared_contrasts_paired_holm_adjusted_with_equivalence_verdicts():
    raw = [0.20, 0.22, 0.18, 0.20]
    # saar_correct − raw: −0.03, −0.04, −0.02, −0.03 → mean −0.03, deviations 0, −0.01, +0.01, 0 → sd =
    # sqrt(0.0002/3) = 0.0081649658, se 0.0040824829, t = −7.3484692 = −3√6; df = 3: u = −3√2 = −4.2426407,
    # u/(1 + u²) = −4.2426407/19 = −0.2232969, atan(u) = −1.3393190 → F = 1/2 − 1.5626158/π = 0.0026039
    # → two-sided p = 0.0052079
    correct = [-0.03, -0.04, -0.02, -0.03]
    # saar − raw, first-call: +0.01, +0.05, +0.09, +0.01 → mean 0.04, deviations −0.03, 0.01, 0.05, −0.03 →
    # sum of squares 0.0044, sd sqrt(0.0044/3) = 0.0382970843, se 0.0191485422, t = 2.0889319; df = 3:
    # u = 1.2060454, u/(1 + u²) = 0.4913518, atan(u) = 0.8785283 → F = 1/2 + 1.3698801/π = 0.9360464
    # → two-sided p = 0.1279072. Same sign in every seed, and inconclusive.
    saar = [0.01, 0.05, 0.09, 0.01]
    # saar − raw, accuracy: +0.001, −0.001, +0.002, 0.000 → mean 0.0005, sd sqrt(0.000005/3) = 0.0012909944,
    # se 0.0006454972: t = 0.7745967, p = 0.4950253; TOST: (0.0005 − 0.02)/se = −30.2, P(T ≤ −30.2) = 0.0000398
    # with 3 df: equivalent within ±0.02
    acc = [0.001, -0.001, 0.002, 0.0]
    results = [_run("raw", s, accuracy=0.8, very_first_call_failure_rate=raw[s]) for s in range(4)]
    results += [
        _run("saar_correct", s, accuracy=0.8, very_first_call_failure_rate=raw[s] + correct[s]) for s in range(4)
    ]
    results += [_run("saar", s, accuracy=0.8 + acc[s], very_first_call_failure_rate=raw[s] + saar[s]) for s in range(4)]
    analysis = analysis_of(EXP, "exp.yaml")
    assert len(analysis.contrasts) == 4  # the list of metrics declared two contrasts
    rows = evaluate(results, analysis)
    by = {(r.contrast.arm, r.contrast.metric): r for r in rows}
    c, s, a = (
        by["saar_correct", "very_first_call_failure_rate"],
        by["saar", "very_first_call_failure_rate"],
        by["saar", "accuracy"],
    )
    assert c.stats.p == pytest.approx(0.0052079, abs=2e-7)
    assert s.stats.p == pytest.approx(0.1279072, abs=2e-7)
    assert a.stats.p == pytest.approx(0.4950253, abs=2e-7) and a.stats.p_equivalence == pytest.approx(3.98e-5, abs=1e-6)
    # Holm over the three estimable contrasts ('later' has not run: no seed, not counted): the smallest p × 3,
    # then × 2, then × 1, kept monotone
    ps = sorted([c.stats.p, s.stats.p, a.stats.p])
    assert c.p_holm == pytest.approx(3 * 0.0052079, abs=1e-6)
    assert s.p_holm == pytest.approx(max(3 * ps[0], 2 * ps[1]), abs=1e-6)
    assert a.p_holm == pytest.approx(max(3 * ps[0], 2 * ps[1], ps[2]), abs=1e-6)
    assert c.verdict(0.05) == "lower than raw"
    assert s.verdict(0.05) == "inconclusive"  # positive in every seed, and not a finding
    assert a.verdict(0.05) == "equivalent within ±0.02"
    assert by["later", "accuracy"].stats is None and by["later", "accuracy"].verdict(0.05) == "not run"
    tie = evaluate(
        [_run("raw", s, accuracy=0.5, very_first_call_failure_rate=0.2) for s in range(2)]
        + [_run("later", s, accuracy=0.51, very_first_call_failure_rate=0.2) for s in range(2)],
        analysis,
    )
    assert tie[-1].verdict(0.05) == "not estimable (the same difference in every seed)"
    table = "\n".join(contrast_table(rows, 0.05))
    assert "s0 -0.030, s1 -0.040, s2 -0.020, s3 -0.030" in table
    assert "| saar_correct − raw | very-first-call failure rate (position 0, attempt 0) | off | 4 |" in table
    assert "[-0.043, -0.017]" in table  # −0.03 ± 3.1824463 × 0.0040824829 = −0.03 ± 0.0129921
    assert "| 0.016 |" in table  # Holm-adjusted p = 3 × 0.0052079 = 0.0156236
    assert "not run |" in table


@pytest.mark.parametrize(
    "change, field",
    [
        (lambda a: a.pop("pre_registered"), "analysis.pre_registered"),
        (lambda a: a["contrasts"][0].update(arm="nope"), "analysis.contrasts[0].arm: 'nope' is not an arm"),
        (lambda a: a["contrasts"][1].update(metric=["accuracy", "tokens"]), "analysis.contrasts[1].metric: 'tokens'"),
        (lambda a: a["margins"].pop("accuracy"), "analysis.contrasts[1].metric: accuracy has no equivalence margin"),
        (lambda a: a["margins"].update(accuracy=0), "analysis.margins.accuracy: expected a positive number"),
        (lambda a: a["contrasts"][0].update(saar_at_test="off"), "analysis.contrasts[0].saar_at_test"),
        (lambda a: a.update(alpha=0.7), "analysis.alpha"),
        (lambda a: a.update(contrasts=[]), "analysis.contrasts: declare at least one"),
        (lambda a: a["contrasts"].append(dict(a["contrasts"][0])), "declared twice"),
    ],
)
def test_a_bad_analysis_section_is_refused_in_one_line_naming_the_field(change, field):
    import copy

    exp = copy.deepcopy(EXP)
    change(exp["analysis"])
    with pytest.raises(AnalysisError) as e:
        analysis_of(exp, "configs/experiments/x.yaml")
    assert str(e.value).startswith("configs/experiments/x.yaml: ") and field in str(e.value)
    assert "\n" not in str(e.value)
    with pytest.raises(AnalysisError, match="no `analysis` section"):
        analysis_of({"arms": {}}, "x.yaml")


# -- the generated page --------------------------------------------------------------------------------------------

OLD_PAGE = """# Experiment `x` — results (generated)

## The premise: recovered trajectories' advantage (catalog view trajectory_kinds)

Purification is predicted to help when recovered trajectories' mean advantage is positive.

| run | iteration | recovered / all | recovered correct | recovered mean advantage \
| not recovered / all | clean correct |
|---|---|---|---|---|---|---|
| raw-s0 | 0 | 20/64 | 0.90 | +0.108 | 3/64 | 0.76 |

## The token-level rule, tested

Prediction from the raw arm's shards only (raw-s0): …

| arm | mode | removed at iteration 0 (neg / pos) | removed, all iterations (neg / pos) | predicted \
| measured gap ± s.e. | held |
|---|---|---|---|---|---|---|
| saar | saar | 287 / 92 | 4066 / 1242 | slower | +0.022 ± 0.017 (+1.3 s.e.) | yes |
| saar_correct | saar_correct | 0 / 92 | 0 / 1242 | not slower | -0.010 ± 0.016 (-0.6 s.e.) | yes |

## Replay statistics

Replay of `saar-s0` iteration 0 (64 raw trajectories):

| γ | positions |
|---|---|
| 0.5 | 23 |
"""


def _page_results() -> list[dict]:
    raw = [0.20, 0.22, 0.18, 0.20]
    deltas = {"raw": [0, 0, 0, 0], "saar": [0.01, 0.05, 0.09, 0.01], "saar_correct": [-0.03, -0.04, -0.02, -0.03]}
    out = []
    for arm, d in deltas.items():
        for s in range(4):
            evals = []
            for it, fcf in ((0, 0.3), (20, raw[s] + d[s])):
                evals += [
                    {
                        "iteration": it,
                        "saar_at_test": False,
                        "accuracy": 0.8,
                        "very_first_call_failure_rate": fcf,
                        "retry_success_rate": None,
                        "tool_calls_per_traj": 1.5,
                        "response_tokens": 80.0,
                    },
                    {
                        "iteration": it,
                        "saar_at_test": True,
                        "accuracy": 0.79,
                        "very_first_call_failure_rate": fcf,
                        "retry_success_rate": 0.7,
                        "tool_calls_per_traj": 1.6,
                        "response_tokens": 70.0,
                    },
                ]
            out.append({"arm": arm, "seed": s, "run_id": f"{arm}-s{s}", "evals": evals})
    return out


def test_the_page_shows_declared_contrasts_per_seed_and_carries_catalog_sections(tmp_path, monkeypatch):
    """Regenerated from the results alone (the runs' workspace absent): the contrast table, between-seed errors
    only, the banner, and the catalog sections carried from the page it replaces, the token-level rule's gaps
    recomputed as paired intervals instead of the old page's binomial ones; writing twice gives the same page."""
    import experiments.report as report

    monkeypatch.setattr(report, "OUT", tmp_path)
    (tmp_path / "x.md").write_text(OLD_PAGE)
    exp = {
        "base": [f"storage.root={tmp_path / 'no-workspace'}"],
        "eval_tasks": 300,
        "eval_every": 20,
        "banners": ["Sampled with coupled retries (before the seed fix of 2026-11-27)."],
        "arms": {
            "raw": {"overrides": ["train.mode=raw"]},
            "saar": {"overrides": ["train.mode=saar"]},
            "saar_correct": {"overrides": ["train.mode=saar_correct"]},
        },
        "analysis": {
            "pre_registered": True,
            "declared": "before the run",
            "alpha": 0.05,
            "margins": {"very_first_call_failure_rate": 0.02},
            "contrasts": [
                {"arm": a, "baseline": "raw", "metric": "very_first_call_failure_rate", "saar_at_test": False}
                for a in ("saar", "saar_correct")
            ],
        },
    }
    page = report.write(_page_results(), exp, "x", 600)
    text = page.read_text()
    assert text.count("> **Sampled with coupled retries (before the seed fix of 2026-11-27).**") == 1
    assert "pre-registered; declared before the run" in text and "Holm-adjusted across the 2 contrasts" in text
    # saar_correct − raw by hand (test above): −0.03 ± 0.004, interval [−0.043, −0.017], p 0.0052079 → Holm × 2
    row = next(ln for ln in text.splitlines() if ln.startswith("| saar_correct − raw |"))
    assert "s0 -0.030, s1 -0.040, s2 -0.020, s3 -0.030 | -0.030 ± 0.004 | [-0.043, -0.017] | 0.010 |" in row
    assert row.endswith("| lower than raw |")
    assert next(ln for ln in text.splitlines() if ln.startswith("| saar − raw |")).endswith("| inconclusive |")
    assert "MIXED" not in text and "mixes protocols" not in text  # the headline metric was recorded
    assert "binomial" not in text and "1 s.e.," not in text  # no error over tasks anywhere
    # the retry success rate has nothing to count with SAAR off at test: a dash, not a zero
    assert "| raw | [0, 1, 2, 3] | 0.200 ± 0.008 | 0.200 ± 0.008 | — | 0.700 ± 0.000 | 0.800 ± 0.000 |" in text
    # catalog sections carried over, the coarse rule's sentence dropped from the premise
    assert "| raw-s0 | 0 | 20/64 | 0.90 | +0.108 | 3/64 | 0.76 |" in text
    assert "Purification is predicted to help" not in text
    assert "| 0.5 | 23 |" in text
    # the rule's predictions carried, the gaps restated: saar +0.04 ± 0.019 [−0.021, +0.101], saar_correct −0.03
    # with upper end −0.017 < +0.02
    assert (
        "| saar | saar | 287 / 92 | 4066 / 1242 | slower | +0.040 ± 0.019 [-0.021, +0.101] (n=4) | "
        "undecided: interval includes 0 |"
    ) in text
    assert (
        "| saar_correct | saar_correct | 0 / 92 | 0 / 1242 | not slower | -0.030 ± 0.004 [-0.043, -0.017] (n=4) | "
        "yes: upper end below +0.02 |"
    ) in text
    assert "+1.3 s.e." not in text and "| held |" not in text
    assert report.write(_page_results(), exp, "x", 600).read_text() == text


# -- the experiment file, checked without running -----------------------------------------------------------------


def test_the_saar_experiment_file_checks_without_running(capsys):
    from pathlib import Path

    from experiments.run import REPO, main

    path = REPO / "configs" / "experiments" / "should_i_turn_saar_on.yaml"
    store = REPO / "workspace" / "experiments-should-i-turn-saar-on"
    before = sorted(store.iterdir()) if store.exists() else None  # a finished experiment's store may be there
    assert main([str(path), "--check"]) == 0
    out = capsys.readouterr().out
    for arm in ("raw", "saar", "saar_lived_raw", "saar_correct", "saar_dpo", "raw_seq_mean"):
        assert f"[experiment] {arm}: seeds [0, 1, 2, 3, 4, 5, 6, 7]" in out
    assert "pending" not in out and Path(path).read_text().count("train.loss_agg=seq_mean") == 1
    assert "12 contrasts (pre-registered), Holm at alpha 0.05" in out
    assert (sorted(store.iterdir()) if store.exists() else None) == before  # nothing ran
    assert Path(path).read_text().count("train.use_dpo_on_tool_calls=true") == 1


def test_a_bad_experiment_file_is_refused_in_one_line(tmp_path, capsys):
    import yaml

    from experiments.run import REPO, main

    exp = yaml.safe_load((REPO / "configs" / "experiments" / "should_i_turn_saar_on.yaml").read_text())
    exp["arms"]["saar_dpo"]["seeds"] = [0, 1, 2]  # pre-registered contrasts pair seeds: every arm needs the same
    bad = tmp_path / "bad.yaml"
    bad.write_text(yaml.safe_dump(exp))
    assert main([str(bad), "--check"]) == 2
    err = capsys.readouterr().err.strip()
    assert err == (
        f"[experiment] {bad}: arms.saar_dpo.seeds: [0, 1, 2] differs from the other arms' [0, 1, 2, 3, 4, 5, 6, 7]"
    )
    exp["arms"]["saar_dpo"]["seeds"] = list(range(8))
    exp["arms"]["saar_dpo"]["overrides"].append("train.use_dpo_on_tool_call=true")  # a typo in a key
    bad.write_text(yaml.safe_dump(exp))
    assert main([str(bad), "--check"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"[experiment] {bad}: arms.saar_dpo: ") and "use_dpo_on_tool_call" in err
    assert "\n" not in err


def test_the_page_says_whether_the_analysis_was_registered_before_any_result(tmp_path):
    import copy

    from experiments.contrasts import record_registration, registration_note

    record = tmp_path / "x.registration.json"
    assert "No record of the declaration" in registration_note(EXP, record)
    assert record_registration(EXP, record, have_results=False) == "analysis registered in x.registration.json"
    assert registration_note(EXP, record).startswith(
        " Registered at "
    ) and "before this experiment's results file existed" in registration_note(EXP, record)
    assert record_registration(EXP, record, have_results=True).startswith("analysis as registered at ")
    changed = copy.deepcopy(EXP)
    changed["analysis"]["margins"]["accuracy"] = 0.05  # widened once the results were in
    assert "differs from the one registered" in record_registration(changed, record, have_results=True)
    assert "differs from the one registered" in registration_note(changed, record)
    assert registration_note(EXP, record).startswith(" Registered at ")  # the record itself was kept
    # while no result exists the declaration may still change
    assert record_registration(changed, record, have_results=False) == "analysis registered in x.registration.json"
    assert registration_note(changed, record).startswith(" Registered at ")
    post_hoc = copy.deepcopy(EXP)
    post_hoc["analysis"]["pre_registered"] = False
    assert registration_note(post_hoc, record) == ""
