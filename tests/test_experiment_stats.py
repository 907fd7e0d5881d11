"""The experiment pages' statistics (experiments/stats.py): paired per-seed differences with the
standard error between seeds and Student's t interval, as ../shared/docs/EXPERIMENTS.md asks."""
from math import sqrt
from statistics import stdev

import pytest

from experiments.stats import final_by_seed, mean_se, paired


def _run(arm: str, seed: int, first: float, last: float, saar_last: float = 0.5) -> dict:
    evals = [{"iteration": 20, "saar_at_test": False, "first_call_failure_rate": last},
             {"iteration": 0, "saar_at_test": False, "first_call_failure_rate": first},
             {"iteration": 20, "saar_at_test": True, "first_call_failure_rate": saar_last}]
    return {"arm": arm, "seed": seed, "evals": evals}


def test_final_by_seed_takes_the_last_checkpoint_of_the_asked_test_mode():
    results = [_run("raw", 0, 0.25, 0.10), _run("raw", 1, 0.24, 0.12), _run("saar", 0, 0.25, 0.2)]
    assert final_by_seed(results, "raw", "first_call_failure_rate", False) == {0: 0.10, 1: 0.12}
    assert final_by_seed(results, "raw", "first_call_failure_rate", False, first=True) == {0: 0.25, 1: 0.24}
    assert final_by_seed(results, "raw", "first_call_failure_rate", True) == {0: 0.5, 1: 0.5}


def test_paired_difference_between_seeds_with_the_t_interval():
    raw = [_run("raw", s, 0.25, v) for s, v in enumerate([0.10, 0.12, 0.14])]
    arm = [_run("saar", s, 0.25, v) for s, v in enumerate([0.13, 0.14, 0.165])]
    p = paired(raw + arm, "saar", "raw", "first_call_failure_rate", False)
    diffs = [0.03, 0.02, 0.025]
    assert list(p.diffs.values()) == pytest.approx(diffs)
    se = stdev(diffs) / sqrt(3)
    assert p.mean == pytest.approx(sum(diffs) / 3) and p.se == pytest.approx(se)
    assert (p.low, p.high) == pytest.approx((p.mean - 4.303 * se, p.mean + 4.303 * se))  # t(0.975, 2 df)
    assert p.every_seed and p.claimed and p.low > 0  # all positive, and the interval excludes zero here


def test_mixed_signs_are_not_claimed_and_unpaired_seeds_are_left_out():
    raw = [_run("raw", s, 0.25, v) for s, v in enumerate([0.10, 0.12, 0.14])]
    arm = [_run("saar", s, 0.25, v) for s, v in [(0, 0.12), (1, 0.10), (3, 0.5)]]  # seed 3 has no raw twin
    p = paired(raw + arm, "saar", "raw", "first_call_failure_rate", False)
    assert sorted(p.diffs) == [0, 1]
    assert not p.every_seed and not p.claimed
    assert paired(raw, "plan_b", "raw", "first_call_failure_rate", False) is None


def test_one_seed_has_no_between_seed_error():
    m, se = mean_se([0.3])
    assert m == 0.3 and se != se  # nan: nothing to estimate it from
