"""avg@k and the unbiased pass@k estimator (Chen et al. 2021, "Evaluating Large Language Models Trained on
Code", eq. 1), with standard errors over tasks. Pure functions: no engine, no I/O.

For one task with n samples of which c are correct, pass@k = 1 − C(n−c, k) / C(n, k): the chance that at
least one of k samples drawn without replacement from the n is correct. The binomials overflow floats for
the n of a real evaluation, so it is computed as the product 1 − Π_{j=n−c+1..n} (1 − k/j), which is the
same ratio written factor by factor and stays within [0, 1] at every step.
"""

from __future__ import annotations

import math
from typing import Sequence


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k of one task: n samples, c of them correct, 1 <= k <= n."""
    if not (0 <= c <= n) or not (1 <= k <= n):
        raise ValueError(f"pass@k needs 0 <= c <= n and 1 <= k <= n (got n={n}, c={c}, k={k})")
    if n - c < k:  # every k-subset holds a correct sample
        return 1.0
    return 1.0 - math.prod(1.0 - k / j for j in range(n - c + 1, n + 1))


def report_ks(n: int) -> list[int]:
    """The k reported for n samples per task: 1, 4, 16, … up to n (the paper's pass@1 and pass@16)."""
    if n < 1:
        raise ValueError(f"n must be >= 1 (got {n})")
    ks, k = [], 1
    while k <= n:
        ks.append(k)
        k *= 4
    return ks


def mean_se(values: Sequence[float]) -> tuple[float, float | None]:
    """Mean and its standard error over tasks (sample standard deviation / √m); None below two tasks,
    where no spread can be measured."""
    m = len(values)
    if m == 0:
        raise ValueError("no values")
    mean = math.fsum(values) / m
    if m < 2:
        return mean, None
    var = math.fsum((v - mean) ** 2 for v in values) / (m - 1)
    return mean, math.sqrt(var / m)


def summarize(counts: Sequence[tuple[int, int]]) -> dict[str, float | None]:
    """pass@k and its standard error for every reported k, from (n, c) per task. pass@1 is avg@n: the mean
    over tasks of c/n (the unbiased pass@1 equals c/n). k stops at the smallest n of any task."""
    if not counts:
        raise ValueError("no tasks")
    out: dict[str, float | None] = {}
    for k in report_ks(min(n for n, _ in counts)):
        mean, se = mean_se([pass_at_k(n, c, k) for n, c in counts])
        out[f"pass@{k}"], out[f"pass@{k}_se"] = mean, se
    return out
