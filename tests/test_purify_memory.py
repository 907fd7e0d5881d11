"""Purification's Python objects are bounded by one slice of a raw part and by one prompt group, not by the part
or the bucket: at 16k tokens a row is ~2 MB of Python objects, and a raw part holds up to storage.rows_per_part
rows (benchmarks/bench_purify_memory.py measures the whole stage's RSS). Measured with tracemalloc, which sees
Python allocations (the lists purification builds per row) and not Arrow's buffers, on real rollouts."""
from __future__ import annotations

import dataclasses
import tracemalloc

import pyarrow as pa
import pyarrow.compute as pc

from pipeline.config import DEFAULT_POLICY
from pipeline.modes import Variant
from pipeline.trajectory import trajectory_from_row, trajectory_to_row
from purifier.batch import purify_batch, recompute_groups, token_slices
from purifier.beam_pipeline import PurifyBatches, PurifyJob, _tokenizer_decode
from purifier.recompute import CPURecompute
from storage.layout import RunLayout
from storage.schemas import RAW
from storage.shards import read_shard

VARIANTS = (Variant.of("saar", 0.5), Variant.of("raw"))


def _replicated(cfg, copies: int) -> pa.Table:
    """The world rollout's rows `copies` times, each copy under its own prompt ids."""
    rows = [trajectory_from_row(r) for r in read_shard(RunLayout(cfg.storage.root, "w").raw_dir(0), RAW).to_pylist()]
    return pa.Table.from_pylist([trajectory_to_row(dataclasses.replace(t, prompt_id=f"{t.prompt_id}-{k}"))
                                 for k in range(copies) for t in rows], schema=RAW)


def _peak(fn) -> int:
    """Peak bytes of Python objects allocated while fn runs (its result is kept, so it is not counted twice)."""
    tracemalloc.start()
    try:
        fn()
        return tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


def test_token_slices_cut_a_part_by_lived_tokens(world_rollout):
    raw = _replicated(world_rollout, 2)
    sizes = pc.list_value_length(raw["lived_ids"]).to_pylist()
    budget = 4 * max(sizes)
    slices = token_slices(raw, budget)
    assert sum(s.num_rows for s in slices) == raw.num_rows and len(slices) > 1
    assert all(sum(pc.list_value_length(s["lived_ids"]).to_pylist()) <= budget for s in slices)
    assert pa.concat_tables(slices).equals(raw)
    assert token_slices(raw, 1) and all(s.num_rows == 1 for s in token_slices(raw, 1))  # a row longer than the budget


def test_purify_batches_holds_one_slice_of_a_part_at_a_time(world_rollout):
    one, eight = _replicated(world_rollout, 1), _replicated(world_rollout, 8)
    budget = sum(pc.list_value_length(one["lived_ids"]).to_pylist())  # one copy of the rollout per slice
    dofn = PurifyBatches(PurifyJob(raw_parts=(), variants=VARIANTS, staging="", tokenizer_dir=str(DEFAULT_POLICY)),
                         slice_tokens=budget)
    dofn.setup()
    outputs: dict[str, list] = {"one": [], "eight": []}
    list(dofn.process(("part-0", one)))  # warm-up: caches and lazy imports are not the part's
    small = _peak(lambda: outputs["one"].extend(dofn.process(("part-0", one))))
    large = _peak(lambda: outputs["eight"].extend(dofn.process(("part-1", eight))))
    # unsliced, eight times the rows built eight times the Python objects at once
    assert large < 2 * small, (small, large)
    # and the slices purify to the same rows as the whole part at once
    whole = purify_batch(eight, list(VARIANTS), _tokenizer_decode(str(DEFAULT_POLICY)), "part-1")
    sort = [("prompt_id", "ascending"), ("sample_idx", "ascending")]
    for variant in VARIANTS:
        got = pa.concat_tables([t for (v, _), t in outputs["eight"] if v == variant]).sort_by(sort)
        # compared as text: advantages are NaN until the group stage sets them, and NaN != NaN
        assert str(got.to_pylist()) == str(whole[variant][0].sort_by(sort).to_pylist())


def test_recompute_holds_one_prompt_group_at_a_time(world_rollout):
    raw = _replicated(world_rollout, 1)
    table = purify_batch(raw, [VARIANTS[0]], _tokenizer_decode(str(DEFAULT_POLICY)))[VARIANTS[0]][0]
    spliced = table.filter(pc.greater_equal(table["recompute_from"], 0))
    counts = pc.value_counts(spliced["prompt_id"]).to_pylist()
    first = max(counts, key=lambda c: c["counts"])["values"]  # the group with the most rows to recompute
    group = spliced.filter(pc.equal(spliced["prompt_id"], first))
    assert group.num_rows >= 1
    many = pa.concat_tables([group.set_column(group.schema.get_field_index("prompt_id"), "prompt_id",
                                              pa.array([f"{first}-{k}"] * group.num_rows)) for k in range(16)])
    backend = CPURecompute(DEFAULT_POLICY)
    recompute_groups(group, backend)  # warm-up
    results: list = []
    small = _peak(lambda: results.append(recompute_groups(group, backend)))
    large = _peak(lambda: results.append(recompute_groups(many, backend)))
    assert large < 3 * small, (small, large)  # all at once, 16 groups held 16 times one group's objects
    # every copy of the group got the same log-probs as the group alone
    alone = results[0].sort_by("sample_idx")["old_logprobs"].to_pylist()
    for k in range(16):
        copy = results[1].filter(pc.equal(results[1]["prompt_id"], f"{first}-{k}")).sort_by("sample_idx")
        assert copy["old_logprobs"].to_pylist() == alone
