"""GRPO-RoC (Resample-on-Correct, rStar2-Agent, arXiv 2508.20722) as pure functions: a baseline that
needs no retries and no rewriting, fed from the same raw shards as every other mode.

RoC samples a larger group than it trains on and down-samples it asymmetrically: the positive
trajectories it keeps are those with the fewest tool errors and format problems (so a correct answer
reached through failed calls is rarely reinforced), the negative ones are a uniform sample (so the
failures stay diverse). The reference (microsoft/rStar, `down_sample/roc.py`) splits the kept group
between positives and negatives in the proportion the sampled group had; so does this one, with at
least one of each when the sampled group has both and the kept group has room (the reference's
`min_*_trace_num` settings set to 1), so a kept group never loses its learning signal.

Penalty of a row (lower is better), as the reference's sum of two terms, read from the attempt tree:
- tool errors: failed calls / calls that ran (infrastructure failures are not the model's and count in
  neither); 0.5 when no call ran, as the reference scores a trajectory without tool responses;
- format problems: malformed calls (unclosed, bad JSON, unknown tool; in any turn, the final one
  included) / assistant turns.

The negatives' sample is seeded by a stable hash of (iteration, prompt id): the same on every run,
runner and machine, and two arms that sampled the same prompt in the same iteration keep the same
negatives. The row-level purification of `roc` is the raw sequence (purifier/saar.py); the selection
happens in the group stage (purifier/batch.py `with_advantages`), whose advantages are then computed
on the kept group.
"""

from __future__ import annotations

import hashlib
import random

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from purifier.unspliced import row_keys

ROC_PENALTY = "roc_penalty"  # a column that travels with roc rows from purify_batch to the group stage only
MALFORMED = ("unclosed", "bad_json", "unknown_tool")
NO_CALL_RAN = 0.5  # the reference's error ratio for a trajectory without tool responses


def _per_row(flags: np.ndarray, row_of: np.ndarray, n: int) -> np.ndarray:
    return np.bincount(row_of[flags], minlength=n).astype(np.float64)


def roc_penalties(raw: pa.Table) -> np.ndarray:
    """Tool-error ratio + format-problem ratio of every raw row (RAW schema), column-wise."""
    n = raw.num_rows
    positions = raw["positions"].combine_chunks()
    pos_row = pc.list_parent_indices(positions).to_numpy()
    attempts = pc.struct_field(pc.list_flatten(positions), "attempts")
    att_row = pos_row[pc.list_parent_indices(attempts).to_numpy()]
    att = pc.list_flatten(attempts)
    status = pc.struct_field(att, ["result", "status"]).fill_null("").to_numpy(zero_copy_only=False)
    error_class = pc.struct_field(att, ["result", "error_class"]).fill_null("").to_numpy(zero_copy_only=False)
    call_status = pc.struct_field(att, "call_status").fill_null("").to_numpy(zero_copy_only=False)
    ran = _per_row((status != "") & (error_class != "infra"), att_row, n)
    failed = _per_row((status == "failure") & (error_class == "model"), att_row, n)
    malformed = _per_row(np.isin(call_status, MALFORMED), att_row, n)
    turns = _per_row(np.ones(len(att_row), dtype=bool), att_row, n)
    final = raw["final_turn"].combine_chunks()
    turns += final.is_valid().to_numpy(zero_copy_only=False)
    final_status = pc.struct_field(final, "call_status").fill_null("").to_numpy(zero_copy_only=False)
    malformed += np.isin(final_status, MALFORMED)
    errors = np.divide(failed, ran, out=np.full(n, NO_CALL_RAN), where=ran > 0)
    return errors + np.divide(malformed, turns, out=np.zeros(n), where=turns > 0)


def with_roc_penalty(purified: pa.Table, raw: pa.Table) -> pa.Table:
    """`purified` (rows of `raw`, any order, some possibly dead-lettered) with each row's ROC_PENALTY."""
    of_key = dict(zip(row_keys(raw).to_pylist(), roc_penalties(raw).tolist()))
    return purified.append_column(
        ROC_PENALTY, pa.array([of_key[k] for k in purified["raw_key"].to_pylist()], pa.float64())
    )


def roc_seed(iteration: int, prompt_id: str) -> int:
    return int.from_bytes(hashlib.blake2b(f"{iteration}/{prompt_id}".encode(), digest_size=8).digest(), "big")


def roc_plan(samples: list[int], rewards: list[float], penalties: list[float], group_size: int, seed: int) -> list[int]:
    """Which rows of one prompt group RoC keeps: positions in the input lists, in sample order.

    A group no larger than `group_size` is kept whole (a dead-lettered row already made it smaller;
    dropping more would only lose data). Positives (reward > 0) are taken by (penalty, sample);
    negatives uniformly, without replacement."""
    n = len(samples)
    if n <= group_size:
        return sorted(range(n), key=lambda i: samples[i])
    pos = sorted((i for i in range(n) if rewards[i] > 0), key=lambda i: (penalties[i], samples[i]))
    neg = sorted((i for i in range(n) if rewards[i] <= 0), key=lambda i: samples[i])
    n_pos = int(len(pos) * group_size / n + 0.5)  # the sampled group's proportion, rounded half up
    if pos and neg and group_size >= 2:
        n_pos = min(max(n_pos, 1), group_size - 1)
    n_pos = min(n_pos, len(pos))
    n_neg = min(group_size - n_pos, len(neg))
    n_pos = group_size - n_neg  # len(pos) + len(neg) = n > group_size, so both fit
    kept = pos[:n_pos] + random.Random(seed).sample(neg, n_neg)
    return sorted(kept, key=lambda i: samples[i])
