"""The unbiased pass@k estimator (pipeline/passk.py) against direct computations and brute force, and the
avg@k / pass@k summaries with their standard errors. Pure: no engine, no sandbox."""

from __future__ import annotations

import itertools
import math
import statistics

import pytest

from pipeline.passk import mean_se, pass_at_k, report_ks, summarize


def _direct(n: int, c: int, k: int) -> float:
    """Chen et al.'s formula as written, with exact binomials."""
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)


def _brute(n: int, c: int, k: int) -> float:
    """The share of k-subsets of the n samples (the first c correct) holding at least one correct sample."""
    subsets = list(itertools.combinations(range(n), k))
    return sum(any(i < c for i in s) for s in subsets) / len(subsets)


@pytest.mark.parametrize("n", [1, 4, 16, 100])
def test_no_correct_sample_is_zero_and_all_correct_is_one(n):
    for k in range(1, n + 1):
        assert pass_at_k(n, 0, k) == 0.0
        assert pass_at_k(n, n, k) == 1.0


@pytest.mark.parametrize(
    "n,c,k", [(16, 1, 1), (16, 1, 4), (16, 5, 16), (32, 3, 16), (10, 9, 2), (64, 20, 16), (200, 7, 64)]
)
def test_matches_the_binomial_formula_on_crafted_counts(n, c, k):
    assert pass_at_k(n, c, k) == pytest.approx(_direct(n, c, k), rel=1e-12, abs=1e-15)


def test_pass_at_1_is_the_share_correct():
    for n, c in [(1, 0), (1, 1), (16, 5), (32, 31)]:
        assert pass_at_k(n, c, 1) == pytest.approx(c / n, abs=1e-15)


def test_matches_brute_force_enumeration_for_small_n():
    for n in range(1, 9):
        for c in range(n + 1):
            for k in range(1, n + 1):
                assert pass_at_k(n, c, k) == pytest.approx(_brute(n, c, k), abs=1e-12), (n, c, k)


def test_stays_finite_where_the_binomials_overflow_floats():
    n, c, k = 5000, 3, 1024
    assert math.comb(n, k) > 1e308  # float(C(n, k)) would overflow
    value = pass_at_k(n, c, k)
    assert 0.0 < value < 1.0 and value == pytest.approx(_direct(n, c, k), rel=1e-9)


@pytest.mark.parametrize("n,c,k", [(4, 5, 1), (4, -1, 1), (4, 2, 0), (4, 2, 5)])
def test_refuses_impossible_counts(n, c, k):
    with pytest.raises(ValueError, match="pass@k needs"):
        pass_at_k(n, c, k)


def test_reported_k_are_powers_of_four_up_to_n():
    assert report_ks(1) == [1]
    assert report_ks(3) == [1]
    assert report_ks(4) == [1, 4]
    assert report_ks(16) == [1, 4, 16]
    assert report_ks(63) == [1, 4, 16]
    with pytest.raises(ValueError):
        report_ks(0)


def test_summary_is_the_mean_over_tasks_with_its_standard_error():
    counts = [(16, 0), (16, 4), (16, 16), (16, 9)]
    out = summarize(counts)
    assert set(out) == {"pass@1", "pass@1_se", "pass@4", "pass@4_se", "pass@16", "pass@16_se"}
    per_task = [c / n for n, c in counts]
    assert out["pass@1"] == pytest.approx(statistics.mean(per_task))  # avg@16
    assert out["pass@1_se"] == pytest.approx(statistics.stdev(per_task) / math.sqrt(len(counts)))
    p4 = [_direct(n, c, 4) for n, c in counts]
    assert out["pass@4"] == pytest.approx(statistics.mean(p4))
    assert out["pass@4_se"] == pytest.approx(statistics.stdev(p4) / 2)
    assert out["pass@16"] == pytest.approx(3 / 4)  # 16 of 16 drawn: solved iff any sample is


def test_one_task_has_no_standard_error_and_k_stops_at_the_smallest_n():
    assert mean_se([0.25]) == (0.25, None)
    assert summarize([(5, 2)]) == {
        "pass@1": pytest.approx(0.4),
        "pass@1_se": None,
        "pass@4": pytest.approx(_direct(5, 2, 4)),
        "pass@4_se": None,
    }
    assert set(summarize([(16, 3), (4, 1)])) == {"pass@1", "pass@1_se", "pass@4", "pass@4_se"}
    with pytest.raises(ValueError):
        summarize([])
