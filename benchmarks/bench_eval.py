"""Evaluation as the paper reports it: k = 16 samples on each of the world's 200 held-out tasks in one batch on
the asynchronous loop (rollout_gen/eval_run.py), against one sample per task (k = 1) run the same way."""
from __future__ import annotations

import torch

from benchmarks.common import BenchResult, Row
from pipeline.config import DEFAULT_POLICY, load_config
from rollout_gen.eval_run import evaluate_tasks
from rollout_gen.world.tasks import eval_tasks

K = 16


def run() -> BenchResult:
    torch.set_num_threads(1)
    cfg = load_config(None)
    tasks = eval_tasks(cfg.world)
    one = evaluate_tasks(cfg, DEFAULT_POLICY, tasks, samples=1, show_progress=False).metrics
    many = evaluate_tasks(cfg, DEFAULT_POLICY, tasks, samples=K, show_progress=False).metrics
    overall = many["benchmarks"]["all"]
    rows = [
        Row(f"k={K} × {len(tasks)} held-out tasks ({many['trajectories']:,} trajectories), wall", many["wall_s"],
            K * one["wall_s"], "s", higher_is_better=False),
        Row(f"generated tokens/s, k={K} in one batch", many["generated_tokens_per_s"], one["generated_tokens_per_s"],
            "tokens/s"),
        Row(f"avg@{K} pass@1", overall["pass@1"], None, "fraction"),
        Row(f"pass@{K}", overall[f"pass@{K}"], None, "fraction"),
        Row(f"tool failures per trajectory (k={K}, SAAR on)", overall["tool_failures_per_trajectory"], None,
            "per trajectory", higher_is_better=False),
    ]
    notes = [
        f"baseline: the same {len(tasks)} tasks with one sample each (k=1, {one['wall_s']:.1f} s, "
        f"{one['generated_tokens']:,} tokens); the wall baseline is {K} × that run, what {K} one-sample evaluations "
        f"in a row would take. Same process, same CPU engine (transformers, torch threads 1), 2 sandbox workers.",
        f"k={K}: {many['generated_tokens']:,} generated tokens; trajectories finished after p50 "
        f"{many['latency_s']['p50']:.1f} s, p90 {many['latency_s']['p90']:.1f} s of the run.",
        "pass@k ± standard error over tasks: " + ", ".join(
            f"pass@{k} {overall[f'pass@{k}']:.3f} ± {overall[f'pass@{k}_se']:.3f}" for k in (1, 4, 16))
        + f"; first-call failure rate {overall['first_call_failure_rate']:.3f}; k=1 pass@1 {one['accuracy']:.3f}.",
        f"sample s uses seed rollout.seed + s: avg@{K} is the mean of {K} one-sample evaluations at seeds 0–{K - 1} "
        "(tests/test_eval_avgk.py checks the samples token for token).",
    ]
    return BenchResult("eval", f"`cleaner eval --world --samples {K}`: avg@k / pass@k on the 200 held-out world tasks, "
                       "wall time and throughput.", rows, notes)
