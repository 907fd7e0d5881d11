"""Evaluation as the paper reports it: k samples per task through the real agent loop and sandbox, scored
as each benchmark scores (rollout_gen/evaluate.py, pipeline/passk.py), for `cleaner eval` and the training
flow's eval stage (rollout_gen/eval_stage.py).

The k samples of every task run as one batch on the asynchronous loop. Sample s of a task is drawn exactly
as a one-sample evaluation at `rollout.seed + s` draws it (the same SAAR gate coin and per-turn seeds), so
avg@k is the mean of k single-sample evaluations with those seeds (tests/test_eval_avgk.py).
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from pipeline.chat import ChatFormat, load_chat
from pipeline.config import CleanerConfig
from pipeline.progress import StageProgress
from pipeline.trajectory import Trajectory
from rollout_gen.agent import AgentLoop, RolloutIdentity, model_text, one_sample_runs
from rollout_gen.evaluate import benchmark_metrics, world_metrics
from rollout_gen.lcb import LCBFormatError, extract_code, parse_tests
from rollout_gen.sandbox import SandboxPool
from rollout_gen.stage import make_engine
from rollout_gen.tasks import Task
from storage.checkpoints import policy_version
from storage.errors import CleanerError


class EvalError(CleanerError, ValueError):
    """An evaluation asked for with values that cannot run (k, tasks, an export target); nothing was run."""

    exit_code = 2


def check_samples(cfg: CleanerConfig, samples: int, name: str = "--samples") -> None:
    """k must be at least 1 and fit the engine's batch: a task's k samples run together."""
    if isinstance(samples, bool) or not isinstance(samples, int) or samples < 1:
        raise EvalError(f"{name} {samples!r}: the number of samples per task must be an integer >= 1")
    if samples > cfg.rollout.engine_tuning.max_in_flight:
        raise EvalError(
            f"{name} {samples}: above rollout.engine_tuning.max_in_flight "
            f"({cfg.rollout.engine_tuning.max_in_flight}), the most requests the engine runs at once (a task's "
            f"samples are batched together); lower {name} or raise rollout.engine_tuning.max_in_flight"
        )


class _Clock:
    """When each trajectory finished, from the loop's progress reports (finished counts per engine step)."""

    def __init__(self, bar: StageProgress | None) -> None:
        self.t0, self.bar, self.done_at = time.perf_counter(), bar, []

    def __call__(self, done: int, total: int, note: str) -> None:
        self.done_at += [time.perf_counter() - self.t0] * (done - len(self.done_at))
        if self.bar is not None:
            self.bar.update(done, note)

    def latency(self, total: int, wall: float) -> dict[str, float]:
        times = sorted(self.done_at + [wall] * (total - len(self.done_at)))
        if not times:
            return {"p50": 0.0, "p90": 0.0, "max": 0.0}
        return {"p50": times[len(times) // 2], "p90": times[int(0.9 * (len(times) - 1))], "max": times[-1]}


@dataclass
class EvalRun:
    metrics: dict
    tasks: list[Task]
    samples: int
    trajectories: list[Trajectory]
    codes: list[str]  # per trajectory: the program LiveCodeBench would extract ("" for a math task)

    def lcb_entries(self) -> list[tuple[str, list[str]]]:
        """(question_id, the k programs) of every LiveCodeBench task, in sample order."""
        k = self.samples
        return [
            (qid, self.codes[i * k : (i + 1) * k])
            for i, task in enumerate(self.tasks)
            if (qid := question_id(task)) is not None
        ]


def question_id(task: Task) -> str | None:
    if task.kind != "code":
        return None
    try:
        return parse_tests(task.ground_truth).question_id
    except LCBFormatError:
        return None


def check_exportable(tasks: list[Task], where: str) -> None:
    """Every code task must carry its LiveCodeBench question_id, and there must be one: refused before running."""
    code = [(i, t) for i, t in enumerate(tasks) if t.kind == "code"]
    if not code:
        raise EvalError(
            f"--export-lcb: {where} has no code task (LiveCodeBench layouts: code_generation_lite rows, "
            "or Open-AgentRL-Eval's LiveCodeBench_v6)"
        )
    ids = [(i, question_id(t)) for i, t in code]
    missing = [i for i, qid in ids if qid is None]
    if missing:
        raise EvalError(
            f"--export-lcb: {where}: row {missing[0]} ({tasks[missing[0]].source}) has no question_id "
            f"({len(missing)} of {len(code)} code tasks lack one); LiveCodeBench aligns generations by it"
        )
    first: dict[str, int] = {}
    for i, qid in ids:
        if qid in first:
            raise EvalError(
                f"--export-lcb: {where}: row {i}: question_id {qid!r} repeats row {first[qid]}'s; "
                "LiveCodeBench takes one entry per problem"
            )
        first[qid] = i


def check_prompt_lengths(tasks: list[Task], chat: ChatFormat, limit: int) -> None:
    """A task whose prompt is longer than rollout.max_prompt_tokens is never tried, and would count as a failure:
    refused before anything runs, naming the first such task and the setting to raise."""
    lengths = [len(chat.prompt_ids(t.question)) for t in tasks]
    over = [i for i, n in enumerate(lengths) if n > limit]
    if over:
        raise EvalError(
            f"{len(over)} of {len(tasks)} tasks have prompts longer than rollout.max_prompt_tokens "
            f"({limit}; the longest {max(lengths)} tokens, the first row {over[0]}, "
            f"{tasks[over[0]].prompt_id}): they would count as failures without being tried; raise "
            f"rollout.max_prompt_tokens (e.g. rollout.max_prompt_tokens={max(lengths)})"
        )


def evaluate_tasks(
    cfg: CleanerConfig,
    checkpoint: Path,
    tasks: list[Task],
    samples: int = 1,
    show_progress: bool = True,
    log: Callable[[str], None] | None = None,
) -> EvalRun:
    """k samples per task with SAAR as configured; metrics overall and per benchmark (task source)."""
    check_samples(cfg, samples)
    if not tasks:
        raise EvalError("no tasks to evaluate")
    cfg = cfg.model_copy(deep=True)
    cfg.rollout.samples_per_prompt = 1
    cfg.rollout.overlong_buffer = 0  # scored as the benchmark scores: no length shaping
    chat = load_chat(checkpoint, cfg.rollout.chat_template_kwargs)
    check_prompt_lengths(tasks, chat, cfg.rollout.max_prompt_tokens)
    engine = make_engine(cfg, checkpoint, chat)
    identity = RolloutIdentity("eval", 0, policy_version(checkpoint), cfg.rollout.seed)
    total = len(tasks) * samples
    bar = StageProgress("eval", "trajectories", total, log=log) if show_progress else None
    clock = _Clock(bar)
    t0 = time.perf_counter()
    try:
        with SandboxPool(cfg.rollout.sandbox) as sandbox, bar or contextlib.nullcontext():
            # each sample is a one-sample run at its own seed (rollout.seed + s), as avg@k is defined
            trajectories = AgentLoop(engine, sandbox, chat, cfg.rollout).run(
                tasks, identity, clock, samples, one_sample_runs
            )
    finally:
        engine.close()
    wall = time.perf_counter() - t0
    metrics = world_metrics(trajectories, wall)
    bench = benchmark_metrics([(t.source, t.kind) for t in tasks], trajectories, samples)
    metrics.update(
        {
            "accuracy": bench["all"]["pass@1"],  # avg@k: a code task counts only when every test passes
            "samples": samples,
            "tool_failures_per_trajectory": bench["all"]["tool_failures_per_trajectory"],
            "benchmarks": bench,
            "latency_s": clock.latency(total, wall),
            "answer_match": cfg.rollout.answer_match,  # equivalent scores above the paper's exact rule (docs/eval.md)
        }
    )
    metrics["settings"] = {  # the keys policies/*/metrics.json records (a test compares them)
        "tasks": len(tasks),
        "temperature": cfg.rollout.temperature,
        "seed": cfg.rollout.seed,
        "saar_live_mode": cfg.rollout.saar.live_mode,
        "max_retries": cfg.rollout.saar.max_retries,
        "world": cfg.world.model_dump(),
        "policy_version": identity.policy_version,
    }
    codes = [
        extract_code(model_text(chat, t.lived_ids, t.lived_mask)) if tasks[i // samples].kind == "code" else ""
        for i, t in enumerate(trajectories)
    ]
    return EvalRun(metrics, tasks, samples, trajectories, codes)
