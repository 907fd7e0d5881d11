"""A store at real size, written with the project's own shard writer: N iterations of a run, each a raw shard
of `rows` trajectories of `tokens` lived tokens (ids, mask, log-probs; one position with one attempt), plus a
saar purified partition and an update metrics shard, as a training run leaves them.

`python -m benchmarks.store_generator ROOT --iterations 200` builds one; the store-scale benchmark uses it.
Rows of one iteration share their token arrays (the bytes on disk are those of distinct random tokens per
iteration: each iteration draws its own).
"""

from __future__ import annotations

import argparse
import math
import time
from pathlib import Path

import numpy as np
import pyarrow as pa

from storage.layout import RunLayout
from storage.schemas import METRICS, PURIFIED, RAW
from storage.shards import write_shard


def _lists(values: np.ndarray, rows: int, kind: pa.DataType) -> pa.ListArray:
    n = len(values) // rows
    return pa.ListArray.from_arrays(pa.array(np.arange(rows + 1, dtype=np.int32) * n), pa.array(values, kind))


def raw_table(run_id: str, iteration: int, rows: int, tokens: int, rng: np.random.Generator) -> pa.Table:
    ids = rng.integers(0, 151_936, rows * tokens, dtype=np.int32)
    mask = np.ones(rows * tokens, dtype=np.int8)
    lps = -rng.exponential(0.5, rows * tokens).astype(np.float32)
    prompt = rng.integers(0, 151_936, rows * 64, dtype=np.int32)
    turn = tokens - 32
    attempt = {
        "attempt_idx": 0,
        "turn_ids": None,
        "logprobs": None,
        "call_start": 4,
        "call_status": "ok",
        "context_len": 64,
        "context_fingerprint": "f" * 24,
        "code": "print(6 * 7)",
        "result": {
            "status": "success",
            "text": "Tool call success\nstdout: 42",
            "error_label": None,
            "error_class": None,
            "exit_code": 0,
            "duration_s": 0.01,
            "timed_out": False,
        },
        "feedback_ids": list(range(32)),
        "finish_reason": "stop",
    }
    positions, finals = [], []
    for r in range(rows):
        a = dict(
            attempt,
            turn_ids=ids[r * tokens : r * tokens + turn].tolist(),
            logprobs=lps[r * tokens : r * tokens + turn].tolist(),
        )
        positions.append([{"position_idx": 0, "attempts": [a], "outcome": "success"}])
        finals.append(None)
    stats = {k: 0 for k in RAW.field("stats").type.names}
    columns = {
        "run_id": pa.array([run_id] * rows),
        "iteration": pa.array([iteration] * rows, pa.int32()),
        "prompt_id": pa.array([f"p{r // 8:04d}" for r in range(rows)]),
        "sample_idx": pa.array([r % 8 for r in range(rows)], pa.int32()),
        "policy_version": pa.array(["v"] * rows),
        "seed": pa.array([0] * rows, pa.int64()),
        "task_source": pa.array(["world"] * rows),
        "question": pa.array(["What is 6 * 7?"] * rows),
        "ground_truth": pa.array(["42"] * rows),
        "saar_gate": pa.array([True] * rows),
        "gate_p": pa.array([1.0] * rows),
        "live_mode": pa.array(["purified"] * rows),
        "gamma_live": pa.array([0.5] * rows),
        "max_retries": pa.array([3] * rows, pa.int32()),
        "prompt_ids": _lists(prompt, rows, pa.int32()),
        "lived_ids": _lists(ids, rows, pa.int32()),
        "lived_mask": _lists(mask, rows, pa.int8()),
        "lived_logprobs": _lists(lps, rows, pa.float32()),
        "positions": pa.array(positions, RAW.field("positions").type),
        "final_turn": pa.array(finals, RAW.field("final_turn").type),
        "final_answer": pa.array(["42"] * rows),
        "reward": pa.array(rng.choice([-1.0, 1.0], rows)),
        "finish_reason": pa.array(["stop"] * rows),
        "stats": pa.array([dict(stats, turns=2, tool_calls=1, response_tokens=tokens)] * rows, RAW.field("stats").type),
        "reward_reason": pa.array([""] * rows),
    }
    return pa.table([columns[f.name] for f in RAW], schema=RAW)


def purified_table(raw: pa.Table) -> pa.Table:
    n = raw.num_rows
    key = [
        f"{a}/{b}/{c}/{d}"
        for a, b, c, d in zip(*(raw[k].to_pylist() for k in ("run_id", "iteration", "prompt_id", "sample_idx")))
    ]
    columns = {
        "run_id": raw["run_id"],
        "iteration": raw["iteration"],
        "prompt_id": raw["prompt_id"],
        "sample_idx": raw["sample_idx"],
        "mode": pa.array(["saar"] * n),
        "gamma": pa.array([0.5] * n),
        "raw_key": pa.array(key),
        "prompt_ids": raw["prompt_ids"],
        "response_ids": raw["lived_ids"],
        "loss_mask": raw["lived_mask"],
        "old_logprobs": raw["lived_logprobs"],
        "logprob_valid": raw["lived_mask"],
        "reward": raw["reward"],
        "advantage": pa.array([0.0] * n),
        "splices": pa.array([[]] * n, PURIFIED.field("splices").type),
        "recompute_from": pa.array([-1] * n, pa.int32()),
        "tokens_forwarded": pa.array([0] * n, pa.int32()),
        "gate": raw["saar_gate"],
        "behaviour_logprobs": raw["lived_logprobs"],
        "token_origin": raw["lived_mask"],
        "is_threshold": pa.nulls(n, pa.float64()),
    }
    return pa.table([columns[f.name] for f in PURIFIED], schema=PURIFIED)


def build(
    root: Path, iterations: int, rows: int = 64, tokens: int = 8192, run_id: str = "scale", start: int = 0, log=print
) -> None:
    layout = RunLayout(root, run_id)
    t0 = time.perf_counter()
    for i in range(start, start + iterations):
        rng = np.random.default_rng(i)
        raw = raw_table(run_id, i, rows, tokens, rng)
        write_shard(layout.raw_dir(i), raw, RAW, "gen", inputs=[f"checkpoints/iteration={i:04d}"])
        write_shard(layout.purified_dir(i, "saar", 0.5), purified_table(raw), PURIFIED, "gen")
        write_shard(
            layout.metrics_dir(i, "update"),
            pa.Table.from_pylist(
                [
                    {
                        "run_id": run_id,
                        "iteration": i,
                        "stage": "update",
                        "step": 0,
                        "name": "loss",
                        "value": math.sin(i),
                    }
                ],
                schema=METRICS,
            ),
            METRICS,
            "gen",
        )
        if log and (i + 1) % 50 == 0:
            log(f"[store] {i + 1 - start}/{iterations} iterations, {time.perf_counter() - t0:.0f} s")


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("root", type=Path)
    ap.add_argument("--iterations", type=int, default=20)
    ap.add_argument("--rows", type=int, default=64)
    ap.add_argument("--tokens", type=int, default=8192)
    a = ap.parse_args()
    build(a.root, a.iterations, a.rows, a.tokens)
