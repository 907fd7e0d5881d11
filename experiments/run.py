"""Does purification help? Train every arm of an experiment file from the same bootstrap policy and
the same seeds, evaluate every checkpoint on the held-out world tasks (SAAR at test time off and on),
and write a table, plots and the raw numbers under docs/results/.

    python -m experiments.run configs/experiments/cleaner_vs_raw.yaml [--only ARM ...]
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

REPO = Path(__file__).resolve().parent.parent
OUT = REPO / "docs" / "results"


def _env(root: Path) -> dict:
    return {**os.environ, "PYTHONPATH": str(REPO), "PREFECT_HOME": str(root / ".prefect"),
            "PREFECT_LOGGING_LEVEL": "WARNING"}


def run_arm(name: str, seed: int, spec: dict, exp: dict) -> dict:
    run_id = f"{name}-s{seed}"
    overrides = [*exp["base"], *spec["overrides"], f"flow.run_id={run_id}", f"rollout.seed={seed}", f"train.seed={seed}"]
    root = REPO / next(o.split("=", 1)[1] for o in exp["base"] if o.startswith("storage.root="))
    root.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    train = subprocess.run([sys.executable, "-m", "flows.cli", "train", *overrides], cwd=REPO, env=_env(root),
                           stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    if train.returncode:  # the run's own one-line error, not a bare exit status
        raise RuntimeError(f"{run_id}: cleaner train exited {train.returncode}: {train.stderr.strip().splitlines()[-1:]}")
    train_s = time.perf_counter() - t0
    evals = json.loads(subprocess.run(
        [sys.executable, "-m", "experiments.run", "--eval-run", run_id, str(exp["eval_tasks"]),
         str(exp.get("eval_every", 1)), *overrides], cwd=REPO, env=_env(root), check=True, capture_output=True, text=True).stdout.splitlines()[-1])
    return {"arm": name, "seed": seed, "run_id": run_id, "train_s": train_s, "evals": evals}


def eval_iterations(iterations: int, every: int) -> list[int]:
    """Checkpoints to evaluate: every `every`-th iteration, always the bootstrap policy (0) and the last."""
    return sorted(set(range(0, iterations + 1, every)) | {iterations})


def eval_run(run_id: str, n_tasks: int, every: int, overrides: list[str]) -> list[dict]:
    """The run's checkpoints (iteration 0 = the bootstrap policy) on the held-out tasks."""
    from pipeline.config import load_config
    from flows.eval_cmd import evaluate_world
    from storage.layout import RunLayout
    from storage.checkpoints import checkpoint_for

    cfg = load_config(None, overrides)
    cfg.world.eval_size = n_tasks
    layout = RunLayout(cfg.storage.root, run_id)
    rows = []
    for i in eval_iterations(cfg.flow.iterations, every):
        ckpt = checkpoint_for(cfg.storage.root, run_id, i, cfg.rollout.policy) if i else cfg.rollout.policy
        for saar in (False, True):
            c = cfg.model_copy(deep=True)
            c.rollout.saar.gate_p = 1.0 if saar else 0.0
            c.rollout.saar.live_mode = "purified"
            m = evaluate_world(c, Path(ckpt), show_progress=False)
            rows.append({"iteration": i, "saar_at_test": saar, "accuracy": m["accuracy"],
                         "first_call_failure_rate": m["first_call_failure_rate"],
                         "tool_calls_per_traj": m["tool_calls"] / m["trajectories"],
                         "response_tokens": m["mean_response_tokens"], "wall_s": m["wall_s"]})
    assert layout.run_dir.is_dir()
    return rows


def main(argv: list[str]) -> int:
    if argv[:1] == ["--eval-run"]:  # internal: evaluate one run's checkpoints in a fresh process
        print(json.dumps(eval_run(argv[1], int(argv[2]), int(argv[3]), argv[4:])))
        return 0
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("experiment", nargs="?", type=Path)
    ap.add_argument("--only", nargs="+", help="run only these arms")
    ap.add_argument("--report", type=float, metavar="WALL_MIN",
                    help="only rewrite the table and plots from the stored results (stating this wall time)")
    args = ap.parse_args(argv)
    exp = yaml.safe_load(args.experiment.read_text())
    if args.report is not None:
        from experiments.report import write

        results = json.loads((OUT / f"{args.experiment.stem}.json").read_text())
        print(f"[experiment] wrote {write(results, exp, args.experiment.stem, args.report * 60)}")
        return 0
    jobs = [(name, seed, spec) for name, spec in exp["arms"].items() if not args.only or name in args.only
            for seed in spec["seeds"]]
    OUT.mkdir(parents=True, exist_ok=True)
    results_file = OUT / f"{args.experiment.stem}.json"
    done = json.loads(results_file.read_text()) if results_file.exists() else []
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

    print(f"[experiment] wrote {write(done, exp, args.experiment.stem, time.perf_counter() - t0)}")
    if failed:
        print(f"[experiment] {len(failed)} runs failed ({', '.join(failed)}): rerun the same command to retry them")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
