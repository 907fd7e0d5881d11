"""Purification's Python objects are bounded by one slice of a raw part and by one prompt group, not by the part
or the bucket: at 16k tokens a row is ~2 MB of Python objects, and a raw part holds up to storage.rows_per_part
rows (benchmarks/bench_purify_memory.py measures the whole stage's RSS). Measured with tracemalloc, which sees
Python allocations (the lists purification builds per row) and not Arrow's buffers, on real rollouts."""

from __future__ import annotations

import dataclasses
import tracemalloc
from pathlib import Path

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from pipeline.config import DEFAULT_POLICY
from pipeline.modes import Variant
from pipeline.trajectory import trajectory_from_row, trajectory_to_row
from purifier.batch import SORT, purify_batch, recompute_groups, token_slices
from purifier.beam_pipeline import PurifyBatches, PurifyJob, _tokenizer_decode
from purifier.recompute import CPURecompute
from storage.layout import RunLayout
from storage.schemas import RAW
from storage.shards import read_shard, write_shard

VARIANTS = (Variant.of("saar", 0.5), Variant.of("raw"))


def _replicated(cfg, copies: int) -> pa.Table:
    """The world rollout's rows `copies` times, each copy under its own prompt ids."""
    rows = [trajectory_from_row(r) for r in read_shard(RunLayout(cfg.storage.root, "w").raw_dir(0), RAW).to_pylist()]
    return pa.Table.from_pylist(
        [
            trajectory_to_row(dataclasses.replace(t, prompt_id=f"{t.prompt_id}-{k}"))
            for k in range(copies)
            for t in rows
        ],
        schema=RAW,
    )


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


def _raw_part(table: pa.Table, directory: Path) -> tuple[str, dict]:
    """`table` committed as a one-part raw shard: the (folder, part entry) PurifyBatches reads."""
    manifest = write_shard(directory, table, RAW, "mem", inputs=[str(DEFAULT_POLICY)])
    return str(directory), dataclasses.asdict(manifest.parts[0])


def test_purify_batches_holds_one_slice_of_a_part_at_a_time(world_rollout, tmp_path):
    one, eight = _replicated(world_rollout, 1), _replicated(world_rollout, 8)
    budget = sum(pc.list_value_length(one["lived_ids"]).to_pylist())  # one copy of the rollout per slice
    dofn = PurifyBatches(
        PurifyJob(
            raw_parts=(), variants=VARIANTS, staging=str(tmp_path / "staging"), tokenizer_dir=str(DEFAULT_POLICY)
        ),
        slice_tokens=budget,
    )
    dofn.setup()
    parts = {n: _raw_part(t, tmp_path / n) for n, t in (("one", one), ("eight", eight))}
    outputs: dict[str, list] = {"one": [], "eight": []}
    list(dofn.process(parts["one"]))  # warm-up: caches and lazy imports are not the part's
    small = _peak(lambda: outputs["one"].extend(dofn.process(parts["one"])))
    large = _peak(lambda: outputs["eight"].extend(dofn.process(parts["eight"])))
    # unsliced, eight times the rows built eight times the Python objects at once
    assert large < 2 * small, (small, large)
    # what goes to the GroupByKey is a file per variant and bucket, not rows
    groups = [(key, path) for key, path in outputs["eight"] if not isinstance(key, str)]
    assert {v for (v, _), _ in groups} == set(VARIANTS) and all(isinstance(p, str) for _, p in groups)
    # and the slices purify to the same rows as the whole part at once
    whole = purify_batch(
        eight, list(VARIANTS), _tokenizer_decode(str(DEFAULT_POLICY)), str(tmp_path / "eight" / "part-00000.parquet")
    )
    for variant in VARIANTS:
        got = pa.concat_tables([pq.read_table(p) for (v, _), p in groups if v == variant]).sort_by(SORT)
        # compared as text: advantages are NaN until the group stage sets them, and NaN != NaN
        assert str(got.to_pylist()) == str(whole[variant][0].sort_by(SORT).to_pylist())


def _arrow_peaks(monkeypatch, module, name: str, peaks: list[int]) -> None:
    """Record the Arrow memory allocated (pa.total_allocated_bytes) each time module.name is called."""
    real = getattr(module, name)

    def spy(*args, **kwargs):
        peaks.append(pa.total_allocated_bytes())
        return real(*args, **kwargs)

    monkeypatch.setattr(module, name, spy)


def test_the_commit_holds_a_chunk_of_the_partition_not_the_partition(tmp_path, monkeypatch):
    """The whole stage (FnApiRunner, recompute on the tiny policy) on a raw part of 16 and of 128 rows of 4,096
    tokens: the Arrow memory held while a partition is committed is one chunk's (and a row group per staged
    bucket file), not the partition's (the commit read every bucket back and sorted the variant whole: 8x the
    rows held 8x the bytes). The raw part is purified in slices, but read as Arrow reads a nested column: its
    row group whole (a rollout writes a part as one row group)."""
    from benchmarks import bench_purify_memory as long_rows
    from pipeline.config import load_config
    from purifier import batch, beam_pipeline, commit
    from purifier.stage import run_purify_stage
    from storage import shards

    tokens = 4096
    monkeypatch.setattr(long_rows, "VOCAB", 1024)  # the tiny policy's vocabulary
    monkeypatch.setattr(long_rows, "TOKENS", tokens)
    raw = long_rows.raw_table(128)
    monkeypatch.setattr(beam_pipeline, "SLICE_TOKENS", 16 * tokens)
    monkeypatch.setattr(commit, "COMMIT_TOKENS", 16 * tokens)
    monkeypatch.setattr(beam_pipeline, "STAGED_ROW_GROUP_TOKENS", 4 * tokens)  # 4 rows, as at 16k tokens
    held: dict[int, tuple[int, int]] = {}
    for rows in (16, 128):
        root = tmp_path / f"rows-{rows}"
        write_shard(RunLayout(root, "mem").raw_dir(0), raw.slice(0, rows), RAW, "mem", inputs=[str(DEFAULT_POLICY)])
        cfg = load_config(None, [f"storage.root={root}", "purify.modes=[saar,raw]", "purify.gammas=[0.5]"])
        purifying, committing = [], []
        with monkeypatch.context() as m:
            _arrow_peaks(m, batch, "purify_batch", purifying)
            _arrow_peaks(m, shards.ShardWriter, "write", committing)
            before = pa.total_allocated_bytes()
            results = run_purify_stage(cfg, "mem", 0)
        assert {r.rows for r in results} == {rows}
        assert len(purifying) == rows // 16  # the part was purified in slices of 16 rows
        held[rows] = (max(purifying) - before, max(committing) - before)
    data = raw.nbytes  # the 128-row part's Arrow bytes: what reading it whole held at least
    small, large = held[16][1], held[128][1]
    assert large < small + data / 4, (small, large, data)


def test_recompute_holds_one_prompt_group_at_a_time(world_rollout):
    raw = _replicated(world_rollout, 1)
    table = purify_batch(raw, [VARIANTS[0]], _tokenizer_decode(str(DEFAULT_POLICY)))[VARIANTS[0]][0]
    spliced = table.filter(pc.greater_equal(table["recompute_from"], 0))
    counts = pc.value_counts(spliced["prompt_id"]).to_pylist()
    first = max(counts, key=lambda c: c["counts"])["values"]  # the group with the most rows to recompute
    group = spliced.filter(pc.equal(spliced["prompt_id"], first))
    assert group.num_rows >= 1
    many = pa.concat_tables(
        [
            group.set_column(
                group.schema.get_field_index("prompt_id"), "prompt_id", pa.array([f"{first}-{k}"] * group.num_rows)
            )
            for k in range(16)
        ]
    )
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
