"""The generated write-up of "Should I turn SAAR on?": each finding is one declared contrast at the strength of
its verdict, and carries its contrast, interval and n (experiments/writeup.py)."""

from __future__ import annotations

import json
import random
import shutil
from pathlib import Path

import pytest
import yaml

from experiments import writeup
from experiments.contrasts import analysis_of, evaluate

REPO = Path(__file__).resolve().parent.parent
MAIN_CFG = REPO / "configs" / "experiments" / "should_i_turn_saar_on.yaml"
PLAN_B_CFG = REPO / "configs" / "experiments" / "plan_b_slowdown.yaml"


def _run(arm: str, seed: int, finals: dict[str, float], start: dict[str, float]) -> dict:
    evals = []
    for it, values in ((0, start), (10, {k: (start[k] + finals[k]) / 2 for k in finals}), (20, finals)):
        for saar in (False, True):
            evals.append({"iteration": it, "saar_at_test": saar, **values, "retry_success_rate": 0.5})
    return {"arm": arm, "seed": seed, "run_id": f"{arm}-s{seed}", "train_s": 100.0, "evals": evals}


def _results(exp: dict, shift: dict[str, float], seeds: int = 8) -> list[dict]:
    """Synthetic final values per arm: raw at 0.20 failures / 0.85 pass@1, each arm moved by `shift` plus noise."""
    rng = random.Random(0)
    out = []
    start = {"very_first_call_failure_rate": 0.33, "accuracy": 0.80, "first_call_failure_rate": 0.3}
    for arm in exp["arms"]:
        for s in range(seeds):
            d = shift.get(arm, 0.0)
            finals = {
                "very_first_call_failure_rate": 0.20 + d + rng.gauss(0, 0.004),
                "accuracy": 0.85 + rng.gauss(0, 0.002),
                "first_call_failure_rate": 0.2,
            }
            out.append(_run(arm, s, finals, start))
    return out


def test_a_clear_difference_reads_as_a_difference_with_its_numbers():
    exp = yaml.safe_load(MAIN_CFG.read_text())
    results = _results(exp, {"saar_correct": -0.03})
    analysis = analysis_of(exp, str(MAIN_CFG))
    rows = evaluate(results, analysis)
    row = next(
        r
        for r in rows
        if r.contrast.name == "saar_correct − raw" and r.contrast.metric == "very_first_call_failure_rate"
    )
    text = writeup.finding(row, analysis.alpha)
    assert text.startswith("`saar_correct − raw`, very-first-call failure rate")
    assert "saar_correct is lower (better) than raw" in text
    assert f"[{row.stats.low:+.3f}, {row.stats.high:+.3f}]" in text and "n = 8 seeds" in text
    assert "Holm p = " in text


def test_no_difference_reads_as_inconclusive_or_equivalent_never_as_a_direction():
    exp = yaml.safe_load(MAIN_CFG.read_text())
    results = _results(exp, {})
    analysis = analysis_of(exp, str(MAIN_CFG))
    for row in evaluate(results, analysis):
        text = writeup.finding(row, analysis.alpha)
        verdict = row.verdict(analysis.alpha)
        if verdict.startswith("equivalent"):
            assert "are equivalent within" in text and "TOST Holm p" in text
        elif verdict == "inconclusive":
            assert "inconclusive" in text
        if verdict.startswith(("equivalent", "inconclusive")):
            assert " is higher " not in text and " is lower " not in text


def test_clopper_pearson_matches_the_closed_forms():
    # k = 0 and k = n have closed forms: upper = 1 − (α/2)^(1/n), lower = (α/2)^(1/n)
    assert writeup.clopper_pearson(0, 8) == pytest.approx((0.0, 1 - 0.025 ** (1 / 8)), abs=1e-6)
    assert writeup.clopper_pearson(8, 8) == pytest.approx((0.025 ** (1 / 8), 1.0), abs=1e-6)
    # 4 of 8: the textbook exact interval [0.1570, 0.8430]
    low, high = writeup.clopper_pearson(4, 8)
    assert low == pytest.approx(0.1570, abs=1e-4) and high == pytest.approx(0.8430, abs=1e-4)


def test_steps_to_target_is_per_seed_against_the_same_seeds_baseline():
    results = [
        _run("raw", 0, {"accuracy": 0.85}, {"accuracy": 0.80}),
        _run("saar", 0, {"accuracy": 0.95}, {"accuracy": 0.80}),  # halfway 0.875 ≥ 0.85: reached at 10
        _run("raw", 1, {"accuracy": 0.90}, {"accuracy": 0.80}),
        _run("saar", 1, {"accuracy": 0.88}, {"accuracy": 0.80}),  # never reaches 0.90
    ]
    reach, last = writeup.steps_to_target(results, "saar", "raw", "accuracy", False)
    assert (reach, last) == ({0: 10, 1: None}, 20)
    text = writeup.steps_sentence(results, "saar", "raw", "accuracy", False, 0.05)
    assert "by iteration 10 (0.50 of the steps) in 1 of n = 2 seeds" in text and "s0 10, s1 —" in text


def test_the_whole_writeup_carries_its_numbers_and_the_check_catches_a_bare_claim(tmp_path):
    for cfg in (MAIN_CFG, PLAN_B_CFG):
        (tmp_path / "configs" / "experiments").mkdir(parents=True, exist_ok=True)
        shutil.copy(cfg, tmp_path / "configs" / "experiments" / cfg.name)
    out = tmp_path / "docs" / "results"
    out.mkdir(parents=True)
    main = yaml.safe_load(MAIN_CFG.read_text())
    (out / "should_i_turn_saar_on.json").write_text(json.dumps(_results(main, {"saar_correct": -0.03})))
    plan_b = yaml.safe_load(PLAN_B_CFG.read_text())
    (out / "plan_b_slowdown.json").write_text(json.dumps(_results(plan_b, {"plan_b": 0.05}, seeds=6)))
    probe = {
        "bank_items": 800,
        "analysis": {
            "contrasts": [
                {
                    "arm": "splice_neg",
                    "baseline": "raw",
                    "mean": 0.4,
                    "low": 0.1,
                    "high": 0.7,
                    "n": 8,
                    "p_holm": 0.01,
                    "verdict": "confirmed",
                }
            ]
        },
        "verdict_text": ["Raw's own update ...", "Overall, the explanation is confirmed."],
    }
    (out / "gradient_probe.json").write_text(json.dumps(probe))
    text = writeup.write(tmp_path).read_text()
    assert writeup.unsupported_sentences(text) == []
    assert "  - Run on code ba15f11" in text  # the experiment file's banner: which code made the results
    assert "`plan_b − raw`, very-first-call failure rate" in text and "plan_b is higher (worse) than raw" in text
    assert "`splice_neg − raw`, Δ log-odds" in text and "n = 8 seeds" in text
    assert "Overall, the explanation is confirmed." in text
    # a finding typed in by hand without its numbers is caught
    assert writeup.unsupported_sentences(text + "\n## Extra\n\n- SAAR is slower.\n") == ["- SAAR is slower."]


def test_a_missing_result_is_said_not_invented(tmp_path):
    (tmp_path / "configs" / "experiments").mkdir(parents=True)
    for cfg in (MAIN_CFG, PLAN_B_CFG):
        shutil.copy(cfg, tmp_path / "configs" / "experiments" / cfg.name)
    (tmp_path / "docs" / "results").mkdir(parents=True)
    main = yaml.safe_load(MAIN_CFG.read_text())
    (tmp_path / "docs" / "results" / "should_i_turn_saar_on.json").write_text(json.dumps(_results(main, {})))
    text = writeup.write(tmp_path).read_text()
    assert (
        "- `plan_b − raw`, very-first-call failure rate (position 0, attempt 0), SAAR off at test: not run (n = 0)."
        in text
    )
    assert "probe: not run, docs/results/gradient_probe.json is missing (n = 0)" in text
    assert writeup.unsupported_sentences(text) == []


def test_the_products_answer_quotes_the_experiment_it_cites():
    """flows/premise.py's ANSWER and TOKEN_RULE (printed by `cleaner replay`, shown by `cleaner report`) quote the
    pre-registered experiment: every interval they give is the one its stored results give."""
    from flows.premise import ANSWER, TOKEN_RULE

    e = writeup.load("should_i_turn_saar_on")
    assert e is not None, "docs/results/should_i_turn_saar_on.json is committed with the experiment"
    analysis = analysis_of(e.exp, e.where)
    rows = {(r.contrast.name, r.contrast.metric, r.contrast.saar_at_test): r for r in evaluate(e.results, analysis)}

    def quoted(name: str, metric: str) -> tuple[str, str]:
        s = rows[(name, metric, False)].stats
        return f"{abs(s.mean):.3f}", f"[{s.low:+.3f}, {s.high:+.3f}]".replace("-", "−")

    for name, metric, texts in (
        ("saar − raw", "very_first_call_failure_rate", (ANSWER, TOKEN_RULE)),
        ("saar − raw", "accuracy", (ANSWER,)),
        ("saar_correct − raw", "very_first_call_failure_rate", (ANSWER,)),
        ("saar_dpo − saar", "very_first_call_failure_rate", (ANSWER,)),
    ):
        mean, interval = quoted(name, metric)
        for text in texts:
            assert mean in text and interval in text, (name, metric, mean, interval)
    n = {r.stats.n for r in rows.values() if r.stats is not None}
    assert n == {8} and "n = 8 seeds" in ANSWER and f"{len(analysis.contrasts)} contrasts" in ANSWER
    verdicts = {k: r.verdict(analysis.alpha) for k, r in rows.items()}
    assert all(v == "inconclusive" for k, v in verdicts.items() if k[0] == "saar − raw")  # "not distinguishable"
    assert verdicts[("saar_correct − raw", "very_first_call_failure_rate", False)] == "lower than raw"
    assert verdicts[("saar_dpo − saar", "very_first_call_failure_rate", False)] == "lower than saar"


def test_the_writeup_says_what_was_not_registered_and_what_the_design_could_resolve(tmp_path):
    """The write-up called every finding pre-registered (the steps to target, the gradient probe and the γ advice
    were not), gave `saar_correct − raw` without the loss-normalisation control EXPERIMENTS.md asks for, and read an
    inconclusive `saar − raw` as "not distinguishable" with no word on what n = 8 could resolve."""
    from experiments.contrasts import t_quantile

    for stem in ("should_i_turn_saar_on", "plan_b_slowdown"):
        (tmp_path / "configs" / "experiments").mkdir(parents=True, exist_ok=True)
        shutil.copy(writeup.REPO / "configs" / "experiments" / f"{stem}.yaml", tmp_path / "configs" / "experiments")
    shutil.copytree(writeup.REPO / "docs" / "results", tmp_path / "docs" / "results")
    e = writeup.load("should_i_turn_saar_on")
    text = writeup.write(tmp_path).read_text()
    assert text == writeup.WRITEUP.read_text(), "the committed write-up is the one its generator writes"
    assert "every finding below is one pre-registered contrast" not in text
    assert '## Steps to target (the paper\'s "a third of the steps"; exploratory, not registered)' in text
    assert "(not registered with the experiment)" in text and "0.6–0.84" not in text
    control = [line for line in text.splitlines() if "`saar_correct − raw_seq_mean`" in line]
    assert len(control) == 1 and "exploratory, not registered" in control[0], control
    rows = {
        (r.contrast.name, r.contrast.metric, r.contrast.saar_at_test): r
        for r in evaluate(e.results, analysis_of(e.exp, e.where))
    }
    headline = rows[("saar − raw", "very_first_call_failure_rate", False)]
    need = writeup.seeds_for_equivalence(headline, 0.05)
    s = headline.stats

    def resolves(n: int) -> bool:
        return t_quantile(0.95, n - 1) * s.sd / n**0.5 < headline.margin

    assert resolves(need) and not resolves(need - 1) and need > s.n
    assert f"needs about {need} seeds" in text
    assert writeup.unsupported_sentences(text) == []
