"""Shallow/deep decision agreement of the similarity measures with the reference's (difflib ratio on
the whole call segment), on real rollouts of the committed tiny policy: every failed-call/retry pair
the rollout lived is compared under each measure and target, at γ = 0.3/0.5/0.7/0.9.

`python -m benchmarks.bench_measures` rolls out (nothing cached), then refreshes its own section of
RESULTS.md.
"""

from __future__ import annotations

import statistics
import tempfile
import time
from pathlib import Path

import torch

from benchmarks.common import BenchResult, Row, record
from pipeline.config import DEFAULT_POLICY, load_config
from pipeline.similarity import REFERENCE_MEASURE, Measure
from pipeline.trajectory import trajectory_from_row
from purifier.replay import candidates
from pipeline.modes import live_measure
from rollout_gen.stage import run_rollout_stage
from pipeline.chat import load_chat
from storage.layout import RunLayout
from storage.schemas import RAW
from storage.shards import read_shard

GAMMAS = (0.3, 0.5, 0.7, 0.9)
MEASURES = [Measure(s, on) for s in ("rapidfuzz", "difflib") for on in ("segment", "code")]
SEEDS = (11, 12)


def rollouts(root: Path) -> list:
    raws = []
    for seed in SEEDS:
        cfg = load_config(
            None,
            [
                f"storage.root={root}",
                "rollout.tasks_per_iteration=64",
                "rollout.samples_per_prompt=4",
                f"rollout.seed={seed}",
            ],
        )
        run_rollout_stage(cfg, f"m{seed}", 0, DEFAULT_POLICY, show_progress=False)
        raws += [trajectory_from_row(r) for r in read_shard(RunLayout(root, f"m{seed}").raw_dir(0), RAW).to_pylist()]
    return raws, cfg


def run() -> BenchResult:
    torch.set_num_threads(1)
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        raws, cfg = rollouts(Path(tmp))
    wall = time.perf_counter() - t0
    decode = load_chat(DEFAULT_POLICY).decode
    pairs = candidates(raws, decode, REFERENCE_MEASURE, live_measure(cfg.rollout.saar))
    sims = {m: [m(p.old_call, p.new_call) for p in pairs] for m in MEASURES}
    ref = sims[REFERENCE_MEASURE]
    rows, n = [], max(1, len(pairs))
    for m in MEASURES:
        for g in GAMMAS:
            # the decision as purification takes it: exact comparison (pipeline/similarity.py)
            mine = [m.ratio(p.old_call, p.new_call).at_least(g) for p in pairs]
            theirs = [REFERENCE_MEASURE.ratio(p.old_call, p.new_call).at_least(g) for p in pairs]
            agree = sum(a == b for a, b in zip(mine, theirs)) / n
            rows.append(Row(f"{m.key} agrees with difflib-segment at γ={g}", agree, None, "fraction"))
    spread = "; ".join(
        f"{m.key}: min {min(s):.2f} / median {statistics.median(s):.2f} / max {max(s):.2f}"
        for m, s in sims.items()
        if s
    )
    differ = sum(abs(a - b) > 1e-12 for a, b in zip(sims[Measure()], ref))
    notes = [
        f"{len(pairs)} failed-call/retry pairs lived in {len(raws)} trajectories of the committed tiny policy "
        f"(seeds {', '.join(map(str, SEEDS))}, 64 tasks × 4 samples each, T=1.0; rollout {wall:.0f} s).",
        f"similarity spread — {spread}.",
        f"rapidfuzz-segment and difflib-segment values differ on {differ} of {len(pairs)} pairs; rows above are "
        "decision agreement (shallow/deep) with the reference measure on the same pairs.",
    ]
    return BenchResult(
        "measures",
        "SAAR shallow/deep decisions of each similarity measure and target vs the "
        "reference's (difflib SequenceMatcher ratio on the whole call segment), on real rollouts.",
        rows,
        notes,
    )


if __name__ == "__main__":
    result = run()
    record(result)
    for row in result.rows:
        print(f"  {row.metric}: {row.value:.3f}")
    for note in result.notes:
        print("  " + note)
