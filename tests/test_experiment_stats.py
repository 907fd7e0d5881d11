"""The experiment pages' between-seed summaries (experiments/stats.py); the paired contrasts, Holm and equivalence
are tests/test_contrasts.py."""

from math import sqrt
from statistics import stdev

import pytest

import experiments.stats as stats
from experiments.stats import final_by_seed, mean_se, seeds_table


def _run(arm: str, seed: int, first: float, last: float, saar_last: float = 0.5) -> dict:
    evals = [
        {"iteration": 20, "saar_at_test": False, "first_call_failure_rate": last, "retry_success_rate": None},
        {"iteration": 0, "saar_at_test": False, "first_call_failure_rate": first},
        {"iteration": 20, "saar_at_test": True, "first_call_failure_rate": saar_last, "retry_success_rate": 0.6},
    ]
    return {"arm": arm, "seed": seed, "evals": evals}


def test_final_by_seed_takes_the_last_checkpoint_of_the_asked_test_mode():
    results = [_run("raw", 0, 0.25, 0.10), _run("raw", 1, 0.24, 0.12), _run("saar", 0, 0.25, 0.2)]
    assert final_by_seed(results, "raw", "first_call_failure_rate", False) == {0: 0.10, 1: 0.12}
    assert final_by_seed(results, "raw", "first_call_failure_rate", False, first=True) == {0: 0.25, 1: 0.24}
    assert final_by_seed(results, "raw", "first_call_failure_rate", True) == {0: 0.5, 1: 0.5}


def test_a_metric_the_evaluation_did_not_record_is_left_out_not_counted_as_zero():
    results = [_run("raw", 0, 0.25, 0.10), _run("raw", 1, 0.24, 0.12)]
    # retry success with SAAR off at test: nothing was retried (None), so no seed has it
    assert final_by_seed(results, "raw", "retry_success_rate", False) == {}
    assert final_by_seed(results, "raw", "retry_success_rate", True) == {0: 0.6, 1: 0.6}
    # a result file from before the metric existed
    assert final_by_seed(results, "raw", "very_first_call_failure_rate", False) == {}


def test_seeds_table_gives_the_between_seed_error_and_a_dash_where_nothing_was_measured():
    results = [_run("raw", 0, 0.25, 0.10), _run("raw", 1, 0.24, 0.14), _run("saar", 0, 0.25, 0.2)]
    lines = seeds_table(results, ["raw", "saar"], {"first_call_failure_rate": "fcf", "retry_success_rate": "retry"})
    assert lines[0] == "| arm | seeds | fcf, SAAR off | fcf, SAAR on | retry, SAAR off | retry, SAAR on |"
    se = stdev([0.10, 0.14]) / sqrt(2)  # 0.0282843 / 1.4142136 = 0.02
    assert se == pytest.approx(0.02)
    assert lines[2] == "| raw | [0, 1] | 0.120 ± 0.020 | 0.500 ± 0.000 | — | 0.600 ± 0.000 |"
    assert lines[3] == "| saar | [0] | 0.200 | 0.500 | — | 0.600 |"  # one seed: no error to give


def test_one_seed_has_no_between_seed_error():
    m, se = mean_se([0.3])
    assert m == 0.3 and se != se  # nan: nothing to estimate it from


def test_the_same_sign_rule_is_retired():
    """'Same sign in every seed' fired by chance one time in four with 3 seeds; nothing may decide by it."""
    assert not hasattr(stats, "Paired") and not hasattr(stats, "paired_table")


def test_the_very_first_call_has_one_protocol_across_test_modes(tmp_path):
    """The headline metric on the real tiny policy, real sandbox: position 0, attempt 0 is sampled in the same
    context with the same draw whether SAAR is on or off at test, so its failure rate is the same in both modes,
    while the per-position rate is not (with SAAR off a failed call closes its position and the next call opens
    another). The retry success rate exists only where something was retried."""
    from pathlib import Path

    from experiments.run import eval_checkpoint
    from pipeline.config import load_config

    cfg = load_config(None, [f"storage.root={tmp_path}"])
    cfg.world.eval_size = 40
    off, on = (eval_checkpoint(cfg, Path(cfg.rollout.policy), saar) for saar in (False, True))
    assert off["very_first_calls"] == on["very_first_calls"] > 30
    assert off["very_first_call_failure_rate"] == on["very_first_call_failure_rate"] > 0
    assert off["first_call_failure_rate"] != on["first_call_failure_rate"]  # the mixed protocol it replaces
    assert off["retries"] == 0 and off["retry_success_rate"] is None
    assert on["retries"] > 0 and 0 <= on["retry_success_rate"] <= 1
