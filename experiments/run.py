"""Does purification help? Train every arm of an experiment file from the same bootstrap policy and
the same seeds, evaluate every checkpoint on the held-out world tasks (SAAR at test time off and on),
and write a table, plots and the raw numbers under docs/results/.

    python -m experiments.run configs/experiments/cleaner_vs_raw.yaml [--only ARM ...]
    python -m experiments.run configs/experiments/X.yaml --check        # validate the file, run nothing
    python -m experiments.run configs/experiments/X.yaml --report 93    # redraw the page from the stored JSON

An arm marked `pending: REASON` in the file is reported and skipped (its contrasts show as not run) until the
reason is removed.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor, as_completed
from pathlib import Path

import yaml

from experiments.stats import premise_by_iteration

REPO = Path(__file__).resolve().parent.parent
OUT = REPO / "docs" / "results"


def _env(root: Path) -> dict:
    return {
        **os.environ,
        "PYTHONPATH": str(REPO),
        "PREFECT_HOME": str(root / ".prefect"),
        "PREFECT_LOGGING_LEVEL": "WARNING",
    }


def run_arm(name: str, seed: int, spec: dict, exp: dict) -> dict:
    run_id = f"{name}-s{seed}"
    overrides = [
        *exp["base"],
        *spec["overrides"],
        f"flow.run_id={run_id}",
        f"rollout.seed={seed}",
        f"train.seed={seed}",
    ]
    root = REPO / next(o.split("=", 1)[1] for o in exp["base"] if o.startswith("storage.root="))
    root.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    train = subprocess.run(
        [sys.executable, "-m", "flows.cli", "train", *overrides],
        cwd=REPO,
        env=_env(root),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    if train.returncode:  # the run's own one-line error, not a bare exit status
        raise RuntimeError(
            f"{run_id}: cleaner train exited {train.returncode}: {train.stderr.strip().splitlines()[-1:]}"
        )
    train_s = time.perf_counter() - t0
    evals = json.loads(
        subprocess.run(
            [
                sys.executable,
                "-m",
                "experiments.run",
                "--eval-run",
                run_id,
                str(exp["eval_tasks"]),
                str(exp.get("eval_every", 1)),
                *overrides,
            ],
            cwd=REPO,
            env=_env(root),
            check=True,
            capture_output=True,
            text=True,
        ).stdout.splitlines()[-1]
    )
    return {
        "arm": name,
        "seed": seed,
        "run_id": run_id,
        "commit": code_commit(),
        "train_s": train_s,
        "evals": evals,
        "premise": _premise(root, run_id, trained_mode(overrides)),
    }


def _premise(root: Path, run_id: str, mode: str) -> list[dict] | None:
    """The run's premise figures per iteration; None (said on stderr) when the catalog cannot give them: a bonus
    figure never costs the arm's result."""
    try:
        return premise_by_iteration(root, run_id, mode)
    except Exception as e:  # noqa: BLE001 - the result matters, the figure is a bonus
        print(f"[experiment] {run_id}: premise figures unavailable: {e}", file=sys.stderr)
        return None


def trained_mode(overrides: list[str]) -> str:
    """The purification mode a run's update trains on: its last train.mode override, else the default."""
    from pipeline.config import TrainConfig

    given = [o.split("=", 1)[1] for o in overrides if o.startswith("train.mode=")]
    return given[-1] if given else TrainConfig.model_fields["mode"].default


def code_commit() -> str | None:
    """The commit the runs' code is at ("+dirty" with uncommitted changes), None outside a git checkout: each
    result says which code made it."""
    head = subprocess.run(["git", "-C", str(REPO), "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
    if head.returncode:
        return None
    dirty = subprocess.run(
        ["git", "-C", str(REPO), "status", "--porcelain", "--untracked-files=no"], capture_output=True
    )
    return head.stdout.strip() + ("+dirty" if dirty.stdout.strip() else "")


def eval_iterations(iterations: int, every: int) -> list[int]:
    """Checkpoints to evaluate: every `every`-th iteration, always the bootstrap policy (0) and the last."""
    return sorted(set(range(0, iterations + 1, every)) | {iterations})


def headline_metrics(metrics: dict) -> dict:
    """The experiment's headline metrics, one protocol across arms and test modes: the failure rate of the very
    first call (position 0, attempt 0: the same context, hence the same draw, whether SAAR is on or off at test),
    with the number of trajectories that made one; the retry success rate beside it (None when nothing was retried,
    as with SAAR off at test); accuracy. The per-position rate `first_call_failure_rate` is kept for comparison
    with older results: with SAAR off at test a failed call closes its position and the next call opens another."""
    return {
        "very_first_call_failure_rate": metrics["very_first_call_failure_rate"]
        if metrics["very_first_calls"]
        else None,
        "very_first_calls": metrics["very_first_calls"],
        "retry_success_rate": metrics["retry_success_rate"] if metrics["retries"] else None,
        "retries": metrics["retries"],
        "accuracy": metrics["accuracy"],
        "first_call_failure_rate": metrics["first_call_failure_rate"],
    }


def eval_checkpoint(cfg, checkpoint: Path, saar: bool) -> dict:
    """One checkpoint on the world's held-out tasks with SAAR on (every trajectory, live mode purified) or off at
    test: the headline metrics and the cost figures."""
    from rollout_gen.eval_run import evaluate_tasks
    from rollout_gen.world.tasks import eval_tasks

    c = cfg.model_copy(deep=True)
    c.rollout.saar.gate_p = 1.0 if saar else 0.0
    c.rollout.saar.live_mode = "purified"
    run = evaluate_tasks(c, Path(checkpoint), eval_tasks(c.world), show_progress=False)
    m = run.metrics
    return {
        "saar_at_test": saar,
        **headline_metrics(m),
        "tool_calls_per_traj": m["tool_calls"] / m["trajectories"],
        "response_tokens": m["mean_response_tokens"],
        "wall_s": m["wall_s"],
    }


def eval_run(run_id: str, n_tasks: int, every: int, overrides: list[str]) -> list[dict]:
    """The run's checkpoints (iteration 0 = the bootstrap policy) on the held-out tasks."""
    from pipeline.config import load_config
    from storage.layout import RunLayout
    from storage.checkpoints import checkpoint_for

    cfg = load_config(None, overrides)
    cfg.world.eval_size = n_tasks
    layout = RunLayout(cfg.storage.root, run_id)
    rows = []
    for i in eval_iterations(cfg.flow.iterations, every):
        ckpt = checkpoint_for(cfg.storage.root, run_id, i, cfg.rollout.policy) if i else cfg.rollout.policy
        for saar in (False, True):
            rows.append({"iteration": i, **eval_checkpoint(cfg, Path(ckpt), saar)})
    assert layout.run_dir.is_dir()
    return rows


def check(exp: dict, where: str) -> list[str]:
    """Everything a run needs from the experiment file, checked without running anything: each arm's config
    tree loads, the declared contrasts name arms and carry margins, arms share their seeds. Returns what will
    run, one line per arm; raises AnalysisError or the config's own error on the first problem."""
    from experiments.contrasts import AnalysisError, analysis_of
    from pipeline.config import load_config

    if not isinstance(exp, dict):
        raise AnalysisError(f"{where}: expected a mapping with base, arms, eval_tasks and analysis")
    for key in ("base", "arms", "eval_tasks"):
        if key not in exp:
            raise AnalysisError(f"{where}: `{key}` is missing")
    if not any(o.startswith("storage.root=") for o in exp["base"]):
        raise AnalysisError(f"{where}: base: name a storage.root=… for the experiment's runs")
    analysis = analysis_of(exp, where)
    lines, seeds = [], None
    for name, spec in exp["arms"].items():
        if not isinstance(spec, dict) or not spec.get("seeds") or not isinstance(spec.get("overrides"), list):
            raise AnalysisError(f"{where}: arms.{name}: expected {{seeds: [...], overrides: [...]}}")
        if spec.get("pending"):
            lines.append(f"{name}: pending ({spec['pending']}); skipped until that is resolved")
            continue
        seeds = seeds if seeds is not None else spec["seeds"]
        if spec["seeds"] != seeds and analysis.pre_registered:  # contrasts pair seeds: an arm on others has no twin
            raise AnalysisError(f"{where}: arms.{name}.seeds: {spec['seeds']} differs from the other arms' {seeds}")
        try:
            cfg = load_config(None, [*exp["base"], *spec["overrides"], f"flow.run_id={name}-s{seeds[0]}"])
        except Exception as e:  # the config tree's own one-line error, prefixed with the arm that caused it
            raise AnalysisError(f"{where}: arms.{name}: {e}") from e
        lines.append(
            f"{name}: seeds {spec['seeds']}, train.mode={cfg.train.mode}, "
            f"live_mode={cfg.rollout.saar.live_mode}, {cfg.flow.iterations} iterations"
        )
    lines.append(
        f"{len(analysis.contrasts)} contrasts ("
        + ("pre-registered" if analysis.pre_registered else "declared after the run")
        + f"), Holm at alpha {analysis.alpha:g}; margins {analysis.margins}"
    )
    return lines


def run_order(exp: dict, only: list[str] | None = None) -> list[tuple[str, int, dict]]:
    """(arm, seed, spec) of every run, seed by seed: an experiment stopped part-way has every arm on its first
    seeds, hence paired contrasts, rather than some arms complete and others not started."""
    arms = [
        (name, spec) for name, spec in exp["arms"].items() if (not only or name in only) and not spec.get("pending")
    ]
    seeds = list(dict.fromkeys(seed for _, spec in arms for seed in spec["seeds"]))
    return [(name, seed, spec) for seed in seeds for name, spec in arms if seed in spec["seeds"]]


def main(argv: list[str]) -> int:
    if argv[:1] == ["--eval-run"]:  # internal: evaluate one run's checkpoints in a fresh process
        print(json.dumps(eval_run(argv[1], int(argv[2]), int(argv[3]), argv[4:])))
        return 0
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("experiment", nargs="?", type=Path)
    ap.add_argument("--only", nargs="+", help="run only these arms")
    ap.add_argument(
        "--report",
        type=float,
        metavar="WALL_MIN",
        help="only rewrite the table and plots from the stored results (stating this wall time)",
    )
    ap.add_argument("--check", action="store_true", help="validate the experiment file (arms, contrasts) and exit")
    args = ap.parse_args(argv)
    if args.experiment is None:
        ap.error("name an experiment file, e.g. configs/experiments/cleaner_vs_raw.yaml")
    from storage.errors import CleanerError

    where = str(args.experiment)
    try:
        exp = yaml.safe_load(args.experiment.read_text())
        for line in check(exp, where):
            print(f"[experiment] {line}")
    except (CleanerError, OSError, yaml.YAMLError) as e:
        print(f"[experiment] {where}: {e}" if not str(e).startswith(where) else f"[experiment] {e}", file=sys.stderr)
        return 2
    if args.check:
        return 0
    if args.report is not None:
        from experiments.report import write

        results = json.loads((OUT / f"{args.experiment.stem}.json").read_text())
        print(f"[experiment] wrote {write(results, exp, args.experiment.stem, args.report * 60, where)}")
        return 0
    jobs = run_order(exp, args.only)
    OUT.mkdir(parents=True, exist_ok=True)
    results_file = OUT / f"{args.experiment.stem}.json"
    done = json.loads(results_file.read_text()) if results_file.exists() else []
    from experiments.contrasts import record_registration

    print(f"[experiment] {record_registration(exp, OUT / f'{args.experiment.stem}.registration.json', bool(done))}")
    finished = {(r["arm"], r["seed"]) for r in done}
    t0 = time.perf_counter()
    failed = []
    with ThreadPoolExecutor(max_workers=exp.get("parallel", 1)) as pool:
        futures = {pool.submit(run_arm, n, s, spec, exp): f"{n}-s{s}" for n, s, spec in jobs if (n, s) not in finished}
        for f in as_completed(futures):  # a failed run is reported and the others go on (rerun to retry it)
            try:
                done.append(f.result())
            except Exception as e:  # noqa: BLE001 - one line per failed run; the experiment keeps the rest
                failed.append(futures[f])
                print(f"[experiment] {futures[f]} failed: {e}", flush=True)
                continue
            results_file.write_text(json.dumps(done, indent=1))
            print(f"[experiment] {done[-1]['run_id']} done after {time.perf_counter() - t0:.0f} s", flush=True)
    from experiments.report import write

    print(f"[experiment] wrote {write(done, exp, args.experiment.stem, time.perf_counter() - t0, where)}")
    if failed:
        print(f"[experiment] {len(failed)} runs failed ({', '.join(failed)}): rerun the same command to retry them")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
