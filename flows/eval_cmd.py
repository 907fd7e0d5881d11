"""`cleaner eval`: a policy on the world's held-out tasks or a task file, k samples per task, with the real
agent loop (rollout_gen/eval_run.py); avg@k, pass@k and tool metrics per benchmark; LiveCodeBench export.
The rollout stack is imported inside the functions, so building the command line stays fast."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from flows.command import command_parser, config_of
from pipeline.config import CleanerConfig

METRICS_FILE = "metrics.json"
# Fields that depend on wall-clock time, not on the policy: excluded when comparing reruns.
TIMING_FIELDS = ("generated_tokens_per_s", "wall_s", "latency_s")


def evaluate_world(
    cfg: CleanerConfig, checkpoint: Path, limit: int | None = None, show_progress: bool = True, samples: int = 1
) -> dict:
    """avg@k / pass@k and tool metrics of the world's first `limit` held-out tasks, `samples` samples each,
    with the real agent loop."""
    from rollout_gen.eval_run import evaluate_tasks
    from rollout_gen.world.tasks import eval_tasks

    return evaluate_tasks(cfg, checkpoint, eval_tasks(cfg.world)[:limit], samples, show_progress).metrics


def run_eval(
    cfg: CleanerConfig,
    *,
    world: bool,
    tasks_file: Path | None,
    samples: int,
    limit: int | None,
    export_lcb: Path | None,
    as_json: bool,
    write: bool,
) -> int:
    """The command's work, with every refusal before any rollout (nothing is written on bad input)."""
    from flows.console import print_metrics
    from rollout_gen.eval_run import EvalError, check_exportable, check_samples, evaluate_tasks
    from rollout_gen.lcb import custom_output
    from rollout_gen.tasks import load_task_parquet
    from rollout_gen.world.tasks import eval_tasks
    from storage.checkpoints import check_checkpoint
    from storage.shards import atomic_write_json

    check_samples(cfg, samples)
    if write and samples != 1:  # metrics.json beside a policy records its one-sample evaluation
        raise EvalError(
            f"--write records the one-sample evaluation in {METRICS_FILE}; run it without --samples {samples}"
        )
    policy = cfg.rollout.policy
    check_checkpoint(policy)  # a missing folder or a truncated weight file: one line, before any task is loaded
    tasks = load_task_parquet(tasks_file)[:limit] if tasks_file else eval_tasks(cfg.world)[:limit]
    where = str(tasks_file) if tasks_file else "the world's held-out tasks"
    if export_lcb is not None:
        check_exportable(tasks, where)
        if export_lcb.is_dir() or not export_lcb.parent.is_dir():
            raise EvalError(
                f"--export-lcb {export_lcb}: "
                + (
                    "is a folder; give a file name such as generations.json"
                    if export_lcb.is_dir()
                    else f"folder {export_lcb.parent} does not exist"
                )
            )
    run = evaluate_tasks(cfg, policy, tasks, samples)
    metrics = run.metrics
    if as_json:
        print_metrics(where, {k: v for k, v in metrics.items() if k != "settings"}, True)
    else:
        print_metrics(f"{policy} on {where}", {k: v for k, v in metrics.items() if k not in ("settings", "benchmarks")})
        print_metrics(
            f"avg@{samples} (pass@1), pass@k ± standard error over tasks, per benchmark", metrics["benchmarks"]
        )
    if export_lcb is not None:
        entries = run.lcb_entries()
        atomic_write_json(export_lcb, custom_output(entries))
        print(
            f"wrote {export_lcb}: {len(entries)} LiveCodeBench problems × {samples} generations "
            f"(python -m lcb_runner.runner.custom_evaluator --custom_output_file {export_lcb})",
            file=sys.stderr,
        )
    if write and world:
        (policy / METRICS_FILE).write_text(json.dumps(metrics, indent=1, sort_keys=True) + "\n")
        print(f"wrote {policy / METRICS_FILE}", file=sys.stderr)
    return 0


def run(args: argparse.Namespace) -> int:
    from rollout_gen.eval_run import EvalError, check_samples

    cfg = config_of(args)
    if args.world == bool(args.tasks):
        raise EvalError(
            "give --world (the held-out world tasks) or --tasks FILE.parquet" + (", not both" if args.world else "")
        )
    if args.write and (args.tasks or args.flow):  # it would be ignored
        raise EvalError(
            "--write records the world's one-sample evaluation beside the policy; "
            f"{'--flow' if args.flow else '--tasks'} writes no metrics.json (use --json for a copy of the numbers)"
        )
    if args.flow:  # as a Prefect flow, SAAR at test time on and off
        if args.export_lcb:
            raise EvalError("--export-lcb runs without --flow (one setting, one file)")
        check_samples(cfg, args.samples)  # refused before a server starts
        from storage.checkpoints import check_checkpoint

        check_checkpoint(cfg.rollout.policy)
        if args.tasks:
            from rollout_gen.tasks import load_task_parquet

            load_task_parquet(args.tasks)  # a bad file is one line here, not a failed flow run
        from flows.server import start_temporary_server

        start_temporary_server(cfg.storage.root)  # dies with this command, even under kill -9
        from flows.side_flows import eval_flow

        result = eval_flow(
            str(args.config) if args.config else None,
            list(args.overrides),
            tasks_file=str(args.tasks) if args.tasks else None,
            samples=args.samples,
            limit=args.limit,
        )
        print_flow_metrics(f"{cfg.rollout.policy}: SAAR at test time on vs off", result, args.samples, args.json)
        return 0
    return run_eval(
        cfg,
        world=args.world,
        tasks_file=args.tasks,
        samples=args.samples,
        limit=args.limit,
        export_lcb=args.export_lcb,
        as_json=args.json,
        write=args.write,
    )


def print_flow_metrics(title: str, result: dict, samples: int, as_json: bool) -> None:
    """The eval flow's result: SAAR on vs off overall, then per benchmark as `cleaner eval` prints it."""
    from flows.console import print_metrics

    if as_json:
        print_metrics(title, result, True)
        return
    print_metrics(title, {k: v for k, v in result.items() if k != "benchmarks"})
    print_metrics(
        f"avg@{samples} (pass@1), pass@k ± standard error over tasks, per benchmark and SAAR at test time",
        result["benchmarks"],
    )


def _at_least_one(text: str) -> int:
    try:
        n = int(text)
    except ValueError:
        n = 0
    if n < 1:
        raise argparse.ArgumentTypeError(f"invalid count {text!r}: a whole number of tasks, at least 1")
    return n


def add_parser(sub) -> None:
    p = command_parser(
        sub,
        "eval",
        "measure a policy on held-out tasks with the real agent loop",
        "Examples:\n  cleaner eval --world\n  cleaner eval --world --samples 16\n"
        "  cleaner eval --world --limit 50 rollout.temperature=1.3\n"
        "  cleaner eval --tasks aime_2024_problems.parquet --samples 16 rollout.policy=/ckpt\n"
        "  cleaner eval --tasks lcb_v6.parquet --samples 4 --export-lcb generations.json\n"
        "  cleaner eval --world --samples 4 --flow   # Prefect flow: SAAR at test time on vs off\n"
        "  cleaner eval --world --write      # refresh metrics.json beside the policy",
        "Roll out the policy (rollout.policy) --samples times per held-out task of the tool-use world "
        "(or of --tasks FILE), with SAAR retries as configured, and print well-formed call rate, first-call "
        "failures by label, retry success, tool failures per trajectory, tokens, latency, and per benchmark (task "
        "source) avg@k pass@1 and the unbiased pass@k (k = 1, 4, 16, … up to --samples) with standard errors over "
        "tasks. Sample s uses seed rollout.seed + s. Code tasks count as solved only when every test passes, as "
        "LiveCodeBench counts them (docs/eval.md).",
        func=run,
    )
    p.add_argument("--world", action="store_true", help="evaluate on the tool-use world's held-out set")
    p.add_argument(
        "--tasks",
        type=Path,
        help="evaluate on a task file: Open-AgentRL-Eval (AIME2024, AIME2025, "
        "gpqa_diamond, LiveCodeBench_v6), LiveCodeBench code_generation_lite rows, or Open-AgentRL/verl",
    )
    p.add_argument(
        "--samples",
        type=int,
        default=1,
        metavar="K",
        help="samples per task (seeds rollout.seed … +K-1), at most rollout.engine_tuning.max_in_flight [1]",
    )
    p.add_argument("--limit", type=_at_least_one, help="only the first N held-out tasks")
    p.add_argument(
        "--export-lcb",
        type=Path,
        metavar="FILE",
        help="write the code tasks' generations in LiveCodeBench's custom-evaluation format "
        "([{question_id, code_list}], for lcb_runner.runner.custom_evaluator --custom_output_file)",
    )
    p.add_argument("--write", action="store_true", help="write metrics.json next to the policy (--world)")
    p.add_argument(
        "--flow",
        action="store_true",
        help="run as the Prefect eval flow: pass@k, tool errors and latency with SAAR on and off",
    )
    p.add_argument("--json", action="store_true", help="print one JSON document (for scripts) instead of a table")
