"""LiveCodeBench rows scored as LiveCodeBench's own harness scores them: every (problem, program) case of
tests/data/lcb/cases.json, in the real sandbox, against the verdict the harness itself gave (recorded by
tests/data/lcb/make_cases.py from its repository; nothing is fetched here)."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from pipeline.config import SandboxConfig
from rollout_gen.lcb import TestResult, code_tests, run_tests
from rollout_gen.sandbox import SandboxPool

CASES = json.loads((Path(__file__).parent / "data" / "lcb" / "cases.json").read_text())


def harness_code(result: bool | int) -> bool | int | None:
    """The harness's per-test result: True, -2 wrong answer (False on call-based), -3 time-out, -4 runtime
    error; None for a crashed run (-1, -5), which says only that the test failed."""
    if result is True:
        return True
    if result is False or result == -2:
        return -2
    return result if result in (-3, -4) else None


def cleaner_code(result: TestResult) -> bool | int | None:
    if result.passed:
        return True
    for prefix, code in (("wrong answer", -2), ("time limit", -3), ("runtime error", -4)):
        if result.why.startswith(prefix):
            return code
    return None


@pytest.fixture(scope="module")
def verdicts() -> dict[int, list[TestResult]]:
    with SandboxPool(SandboxConfig()) as pool:

        def score(case: dict) -> list[TestResult]:
            p = case["problem"]
            return run_tests(case["program"], code_tests(p["inputs"], p["outputs"], p.get("fn_name"), None), pool)

        with ThreadPoolExecutor(max_workers=pool.cfg.workers) as threads:
            return dict(zip((c["id"] for c in CASES), threads.map(score, CASES)))


def test_the_cases_cover_every_class_of_the_harness():
    classes = {c["class"] for c in CASES}
    assert classes == {"stdin", "stdout", "exit", "wrap", "limits", "compare", "call"}
    # both verdicts occur in every class: agreement cannot come from a scorer that always says one thing
    for cls in classes:
        assert {c["harness"]["passed"] for c in CASES if c["class"] == cls} == {True, False}, cls


@pytest.mark.parametrize("case", CASES, ids=[f"{c['id']}-{c['class']}" for c in CASES])
def test_verdict_agrees_with_the_harness(case, verdicts):
    results = verdicts[case["id"]]
    passed = all(r.passed for r in results)
    if case["known_difference"]:  # listed in docs/eval.md; kept here so a change of either side shows
        assert passed != case["harness"]["passed"], case["known_difference"]
        return
    assert passed == case["harness"]["passed"], (case["name"], results, case["harness"])
    crashed = case["harness"]["error_message"] == "TestRunnerError"  # its run died: the -2 it keeps says nothing
    for j, want in enumerate(case["harness"]["results"]):  # up to the harness's first failure, test by test
        want, got = None if crashed else harness_code(want), cleaner_code(results[j])
        if want is None or got is None:
            assert want is not True and got is not True, (case["name"], j, results)
        else:
            assert got == want, (case["name"], j, results, case["harness"])
