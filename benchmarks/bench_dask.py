"""Purification on Beam's DaskRunner (a local scheduler + 1 or 2 worker processes, purifier/dask_cluster.py)
vs the in-process FnApiRunner, on the same 50k-row raw shard; Dask's fixed costs; what 1→2 workers implies
for 32 (an extrapolation, marked as such)."""

from __future__ import annotations

import dataclasses
import os
import shutil
import tempfile
import time
from pathlib import Path

import pyarrow as pa

from benchmarks.common import BenchResult, Row, best_of
from pipeline.config import DEFAULT_POLICY, load_config
from pipeline.modes import Variant
from pipeline.trajectory import trajectory_from_row, trajectory_to_row
from purifier import beam_pipeline, dask_cluster
from purifier.batch import SORT
from purifier.stage import beam_runner
from rollout_gen.stage import run_rollout_stage
from storage.layout import RunLayout
from storage.schemas import RAW
from storage.shards import read_shard, write_shard

VARIANTS = [Variant.of("saar", 0.5)]


def _parts(raw_dir: Path) -> list[tuple[str, dict]]:
    from storage.shards import read_manifest

    return [(str(raw_dir), dataclasses.asdict(p)) for p in read_manifest(raw_dir).parts]


def _raw_shards(root: Path, n: int, parts: int, tasks: int = 16) -> tuple[list, list, int]:
    """A real rollout of the tiny policy (a raw shard), and its rows replicated under new prompt ids up to n
    rows, committed as a raw shard of `parts` parts: both shards' part lists and the number of real rows."""
    cfg = load_config(
        None,
        [
            f"storage.root={root}",
            f"rollout.tasks_per_iteration={tasks}",
            "rollout.samples_per_prompt=4",
            "rollout.seed=11",
        ],
    )
    run_rollout_stage(cfg, "real", 0, DEFAULT_POLICY, show_progress=False)
    trajs = [trajectory_from_row(r) for r in read_shard(RunLayout(root, "real").raw_dir(0), RAW).to_pylist()]
    rows = [
        trajectory_to_row(dataclasses.replace(t, prompt_id=f"{t.prompt_id}-{k}"))
        for k in range(n // len(trajs) + 1)
        for t in trajs
    ][:n]
    raw_dir = RunLayout(root, "bench").raw_dir(0)
    write_shard(
        raw_dir,
        pa.Table.from_pylist(rows, schema=RAW),
        RAW,
        "bench",
        inputs=[str(DEFAULT_POLICY)],
        rows_per_part=-(-n // parts),
    )
    return _parts(raw_dir), _parts(RunLayout(root, "real").raw_dir(0)), len(trajs)


def run(n: int = 50_000, parts: int = 8, repeat: int = 2) -> BenchResult:
    tmp = Path(tempfile.mkdtemp(prefix="bench-dask-"))
    rows_out: list[Row] = []
    notes: list[str] = []
    counter = iter(range(1000))
    try:
        raw_parts, small_parts, small_rows = _raw_shards(tmp, n, parts)

        def purify(runner: str, options: list[str], some=raw_parts) -> Path:
            out = tmp / f"staging-{next(counter)}"
            out.mkdir()
            beam_pipeline.run(
                beam_pipeline.PurifyJob(
                    tuple(some),
                    tuple(VARIANTS),
                    str(out),
                    str(DEFAULT_POLICY),
                    runner=runner,
                    beam_options=tuple(options),
                )
            )
            return out

        def staged(out: Path) -> pa.Table:
            return beam_pipeline.read_staged(out, beam_pipeline.destination(VARIANTS[0], "purified")).sort_by(SORT)

        reference = staged(purify("FnApiRunner", []))  # warm-up, and the output every runner must stage
        t_fn = best_of(lambda: purify("FnApiRunner", []), repeat)
        t_fn_small = best_of(lambda: purify("FnApiRunner", [], small_parts), repeat)

        timings: dict[int, tuple[float, float, float]] = {}
        same = True
        for workers in (1, 2):
            directory = tmp / f"cluster-{workers}"
            t0 = time.perf_counter()
            cluster = dask_cluster.start(directory, workers=workers, timeout=120)
            t_start = time.perf_counter() - t0
            try:
                cfg = load_config(
                    None, [f"storage.root={tmp}", "purify.runner=dask", f"purify.dask_address={cluster.address}"]
                )
                runner, options = beam_runner(cfg)
                same &= staged(purify(runner, options)).equals(reference)  # warm-up: workers import the project
                t_run = best_of(lambda r=runner, o=options: purify(r, o), repeat)
                t_small = best_of(lambda r=runner, o=options: purify(r, o, small_parts), repeat)
            finally:
                dask_cluster.stop(directory)
            timings[workers] = (t_start, t_run, t_small)

        (s1, t1, small1), (s2, t2, small2) = timings[1], timings[2]
        rows_out.append(Row("FnApiRunner, in-process (splice + advantages, no recompute)", n / t_fn, None, "traj/s"))
        rows_out.append(
            Row("Dask, 1 worker process", n / t1, n / t_fn, "traj/s", target="same output as FnApiRunner", passed=same)
        )
        rows_out.append(
            Row(
                "Dask, 2 worker processes (baseline: 1 worker)",
                n / t2,
                n / t1,
                "traj/s",
                target="same output as FnApiRunner",
                passed=same,
            )
        )
        rows_out.append(
            Row("Dask cluster start-up: scheduler + 2 workers joined", s2, None, "s", higher_is_better=False)
        )
        rows_out.append(
            Row(
                f"fixed cost of one run: the pipeline on {small_rows} rows, Dask 2 workers (baseline: FnApiRunner)",
                small2,
                t_fn_small,
                "s",
                higher_is_better=False,
            )
        )
        # Amdahl from the measured 1→2 speed-up: serial fraction f with s = 1 / (f + (1 - f) / 2)
        speedup = t1 / t2
        f = min(1.0, max(0.0, 2 / speedup - 1))
        at32 = 1 / (f + (1 - f) / 32)
        rows_out.append(
            Row(
                "EXTRAPOLATION, not measured: 32 workers (Amdahl from the 1→2 scaling)", n / t1 * at32, n / t1, "traj/s"
            )
        )
        cores = os.cpu_count()
        notes.append(
            f"{n:,} raw rows replicated from {small_rows} real rollouts of the tiny policy under new prompt ids, in "
            f"{len(raw_parts)} raw parts (Dask runs one part per partition: the parts bound the read/purify "
            f"parallelism, the 8 prompt buckets per variant the group stage's); one variant (saar, γ=0.5), "
            f"recompute off (as in the purify section); best of {repeat} after a warm-up run; staged output "
            f"{'identical to' if same else 'DIFFERENT FROM'} FnApiRunner's on every runner"
        )
        notes.append(
            f"Dask start-up: {s1:.1f} s with 1 worker, {s2:.1f} s with 2 (processes started, every worker "
            f"joined); each run then pays a fixed {small2:.2f} s on 2 workers ({small1:.2f} s on 1) for "
            f"{small_rows} rows vs {t_fn_small:.2f} s in-process: client connection, graph submission, "
            "a task per step and partition, and the two GroupByKeys as Dask shuffles"
        )
        load = os.getloadavg()[0]
        notes.append(
            f"one Dask worker runs at {t_fn / t1:.2f}× the in-process speed: a partition's steps run as "
            "one task without Beam's coders between them, so a lone worker about matches FnApiRunner"
        )
        notes.append(
            f"where Dask loses here: (1) every run pays a fixed {small2:.2f} s vs {t_fn_small:.2f} s, so a "
            f"shard as small as the demo's ({small_rows} rows) is faster in-process; (2) 1→2 workers gives "
            f"only {speedup:.2f}× (parallel efficiency {speedup / 2:.0%}): this machine has {cores} cores "
            f"shared by the scheduler, the driver, both workers and other work (load average {load:.1f} at "
            "the end), and with two workers every table that changes worker at the two GroupByKeys is "
            "pickled and sent over TCP; without recompute each row costs little CPU, so that traffic weighs"
        )
        notes.append(
            f"EXTRAPOLATION (not measured): the 1→2 scaling read as Amdahl's law gives a serial fraction of "
            f"{f:.2f}, hence {at32:.1f}× one worker at 32 workers (≈ {n / t1 * at32:,.0f} traj/s). This is "
            "not a prediction: the serial fraction is overstated by 2 shared cores, and the figure leaves out "
            "the network, the driver's serial commit (read, sort and write of each partition) and the limits "
            "of the data: 32 workers need ≥ 32 raw parts (storage.rows_per_part) to read and purify in "
            "parallel, and the group stage has 8 prompt buckets per variant. Purification pays on a cluster "
            "when recompute dominates (a model per worker process), not for splice + advantages alone"
        )
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return BenchResult(
        "dask",
        "Purification on Beam's DaskRunner (local scheduler + worker processes) vs FnApiRunner.",
        rows_out,
        notes,
    )


if __name__ == "__main__":  # one run, printed; `python -m benchmarks.run dask` records it in RESULTS.md
    result = run()
    for row in result.rows:
        print(
            f"{row.metric}: {row.value:,.2f} {row.unit}" + (f" (baseline {row.baseline:,.2f})" if row.baseline else "")
        )
    for note in result.notes:
        print("-", note)
