"""Evaluation as the paper reports it: k = 16 samples on each of the world's 200 held-out tasks in one batch on
the asynchronous loop (rollout_gen/eval_run.py), against one sample per task (k = 1) run the same way; and
LiveCodeBench's scoring time per program, the scorer of the committed code (git HEAD) against the current one
(`lcb_scoring`, its own section `eval_lcb_scoring`)."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

from benchmarks.common import HERE, BenchResult, Row, interleaved_best, record
from pipeline.config import DEFAULT_POLICY, SandboxConfig, load_config
from rollout_gen import lcb
from rollout_gen.eval_run import evaluate_tasks
from rollout_gen.sandbox import SandboxPool
from rollout_gen.world.tasks import eval_tasks

K = 16
CASES = HERE.parent / "tests" / "data" / "lcb" / "cases.json"


def _committed_lcb():
    """rollout_gen/lcb.py as committed (git HEAD), imported as a module of its own: the "before" scorer."""
    text = subprocess.run(
        ["git", "show", "HEAD:rollout_gen/lcb.py"], cwd=HERE.parent, check=True, capture_output=True, text=True
    ).stdout
    path = Path(tempfile.mkdtemp(prefix="lcb-head-")) / "lcb_head.py"
    path.write_text(text)
    spec = importlib.util.spec_from_file_location("lcb_head", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules["lcb_head"] = module  # dataclasses look their module up while the class is built
    spec.loader.exec_module(module)
    return module


def lcb_scoring() -> BenchResult:
    """Wall time to score one program on a LiveCodeBench problem, one program at a time through the real sandbox
    (2 workers, as `rollout.sandbox`): the harness-parity cases that pass and run quickly (2 tests each, stdin and
    call-based), and one stdin problem of 20 tests. Before: each test its own sandbox call, spread over the
    workers; after: one call per program running the tests in turn, compared in the pipeline's process."""
    before = _committed_lcb()
    cases = [c for c in json.loads(CASES.read_text()) if c["harness"]["passed"] and c["class"] != "limits"]
    problems = [(c["program"], c["problem"]) for c in cases]
    twenty = {"inputs": [f"{i} {i + 1}\n" for i in range(20)], "outputs": [f"{2 * i + 1}\n" for i in range(20)]}
    adder = "a, b = map(int, input().split())\nprint(a + b)"

    def scorer(module, batch):
        tests = [(p, module.code_tests(q["inputs"], q["outputs"], q.get("fn_name"), None)) for p, q in batch]
        return lambda: [module.run_tests(p, t, pool) for p, t in tests]

    with SandboxPool(SandboxConfig()) as pool:
        old_cases, new_cases = interleaved_best(scorer(before, problems), scorer(lcb, problems), repeat=3)
        old_20, new_20 = interleaved_best(
            scorer(before, [(adder, twenty)] * 5), scorer(lcb, [(adder, twenty)] * 5), repeat=3
        )
        agree_old = sum(all(r.passed for r in rs) for rs in scorer(before, problems)())
        agree_new = sum(all(r.passed for r in rs) for rs in scorer(lcb, problems)())
    n = len(problems)
    rows = [
        Row(
            f"LiveCodeBench scoring per program, {n} harness cases (2 tests each)",
            1000 * new_cases / n,
            1000 * old_cases / n,
            "ms",
            higher_is_better=False,
        ),
        Row(
            "LiveCodeBench scoring per program, a 20-test stdin problem",
            1000 * new_20 / 5,
            1000 * old_20 / 5,
            "ms",
            higher_is_better=False,
        ),
    ]
    notes = [
        "baseline: rollout_gen/lcb.py at git HEAD (`git show HEAD:rollout_gen/lcb.py`, imported as its own module), "
        "same process, same sandbox pool (2 workers), best of 3 interleaved runs.",
        f"the {n} cases are tests/data/lcb/cases.json's that LiveCodeBench's harness passes, less the `limits` class "
        f"(sleeps, big allocations); passed by the current scorer: {agree_new} of {n}, by HEAD's: {agree_old} of {n}.",
    ]
    return BenchResult(
        "eval_lcb_scoring", "LiveCodeBench scoring time per program, before (git HEAD) vs after.", rows, notes
    )


def run() -> BenchResult:
    record(lcb_scoring())  # its own section: a quick measurement next to the slow one
    torch.set_num_threads(1)
    cfg = load_config(None)
    tasks = eval_tasks(cfg.world)
    one = evaluate_tasks(cfg, DEFAULT_POLICY, tasks, samples=1, show_progress=False).metrics
    many = evaluate_tasks(cfg, DEFAULT_POLICY, tasks, samples=K, show_progress=False).metrics
    overall = many["benchmarks"]["all"]
    rows = [
        Row(
            f"k={K} × {len(tasks)} held-out tasks ({many['trajectories']:,} trajectories), wall",
            many["wall_s"],
            K * one["wall_s"],
            "s",
            higher_is_better=False,
        ),
        Row(
            f"generated tokens/s, k={K} in one batch",
            many["generated_tokens_per_s"],
            one["generated_tokens_per_s"],
            "tokens/s",
        ),
        Row(f"avg@{K} pass@1", overall["pass@1"], None, "fraction"),
        Row(f"pass@{K}", overall[f"pass@{K}"], None, "fraction"),
        Row(
            f"tool failures per trajectory (k={K}, SAAR on)",
            overall["tool_failures_per_trajectory"],
            None,
            "per trajectory",
            higher_is_better=False,
        ),
    ]
    notes = [
        f"baseline: the same {len(tasks)} tasks with one sample each (k=1, {one['wall_s']:.1f} s, "
        f"{one['generated_tokens']:,} tokens); the wall baseline is {K} × that run, what {K} one-sample evaluations "
        f"in a row would take. Same process, same CPU engine (transformers, torch threads 1), 2 sandbox workers.",
        f"k={K}: {many['generated_tokens']:,} generated tokens; trajectories finished after p50 "
        f"{many['latency_s']['p50']:.1f} s, p90 {many['latency_s']['p90']:.1f} s of the run.",
        "pass@k ± standard error over tasks: "
        + ", ".join(f"pass@{k} {overall[f'pass@{k}']:.3f} ± {overall[f'pass@{k}_se']:.3f}" for k in (1, 4, 16))
        + f"; first-call failure rate {overall['first_call_failure_rate']:.3f}; k=1 pass@1 {one['accuracy']:.3f}.",
        f"sample s uses seed rollout.seed + s: avg@{K} is the mean of {K} one-sample evaluations at seeds 0–{K - 1} "
        "(tests/test_eval_avgk.py checks the samples token for token).",
    ]
    return BenchResult(
        "eval",
        f"`cleaner eval --world --samples {K}`: avg@k / pass@k on the 200 held-out world tasks, "
        "wall time and throughput.",
        rows,
        notes,
    )
