"""The purification stage on a real Beam pipeline (FnApiRunner) over real rollouts of the tiny policy."""

from __future__ import annotations

import shutil
import statistics
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from transformers import AutoModelForCausalLM

from pipeline.config import DEFAULT_POLICY
from pipeline.trajectory import purified_from_row, trajectory_from_row, trajectory_to_row
from purifier.advantages import group_advantages
from purifier import beam_pipeline
from purifier.stage import DeadLetterOverflow, StagingMismatch, run_purify_stage
from pipeline.variants import plan_variants
from storage.catalog import Catalog
from storage.layout import RunLayout
from storage.schemas import DEAD_LETTER, PURIFIED, RAW
from storage.shards import read_manifest, read_shard, write_shard


def cfg_with(cfg, root=None, **purify):
    c = cfg.model_copy(deep=True)
    if root is not None:
        c.storage.root = root
    for k, v in purify.items():
        setattr(c.purify, k, v)
    return c


def purified(cfg, mode, gamma, run="w"):
    d = RunLayout(cfg.storage.root, run).purified_dir(0, mode, gamma)
    return [purified_from_row(r) for r in read_shard(d, PURIFIED).to_pylist()]


@pytest.fixture(scope="module")
def stage(world_rollout, tmp_path_factory):
    root = tmp_path_factory.mktemp("purify")
    shutil.copytree(world_rollout.storage.root / "runs", root / "runs")
    cfg = cfg_with(world_rollout, root, modes=["saar", "raw"], gammas=[0.5])
    results = run_purify_stage(cfg, "w", 0)
    return cfg, results


def test_partitions_committed_with_advantages(stage):
    cfg, results = stage
    assert {(r.mode, r.threshold) for r in results} == {("saar", 0.5), ("raw", 0.0)}
    rows = purified(cfg, "saar", 0.5)
    assert len(rows) == 64 and [(r.prompt_id, r.sample_idx) for r in rows] == sorted(
        (r.prompt_id, r.sample_idx) for r in rows
    )
    groups = {}
    for r in rows:
        groups.setdefault(r.prompt_id, []).append(r)
    for g in groups.values():
        want = group_advantages([r.reward for r in g], "group_norm")
        assert [r.advantage for r in g] == pytest.approx(want)
    with Catalog(cfg.storage.root) as cat:
        cmp = cat.query("SELECT mode, trajectories FROM purify_compare ORDER BY mode").to_pylist()
    assert cmp == [{"mode": "raw", "trajectories": 64}, {"mode": "saar", "trajectories": 64}]


def test_recomputed_logprobs_equal_a_full_forward(stage):
    cfg, _ = stage
    model = AutoModelForCausalLM.from_pretrained(
        DEFAULT_POLICY, dtype=torch.float32, attn_implementation="eager"
    ).eval()
    spliced = 0
    for mode, gamma in (("saar", 0.5), ("raw", 0.0)):
        for r in purified(cfg, mode, gamma):
            seq = torch.tensor([r.prompt_ids + r.response_ids])
            with torch.no_grad():
                logp = torch.log_softmax(model(seq).logits[0].float(), -1)
            p = len(r.prompt_ids)
            for i, tok in enumerate(r.response_ids):
                if r.loss_mask[i]:
                    assert abs(logp[p + i - 1, tok].item() - r.old_logprobs[i]) <= 1e-4, (r.raw_key, mode, i)
            needs = [i for i, (m, v) in enumerate(zip(r.loss_mask, r.logprob_valid)) if m and not v]
            if not needs:
                assert r.tokens_forwarded == 0 and r.recompute_from == -1
            else:
                spliced += 1
                assert r.recompute_from == needs[0]
                assert r.tokens_forwarded == needs[-1] < len(r.response_ids)  # nothing after the last one
    assert spliced > 0


def test_rerun_skips_committed_partitions(stage):
    cfg, _ = stage
    again = run_purify_stage(cfg, "w", 0)
    assert all(r.skipped for r in again)


def test_replay_gammas_never_touch_raw(stage):
    cfg, _ = stage
    raw_dir = RunLayout(cfg.storage.root, "w").raw_dir(0)
    before = {p.name: p.read_bytes() for p in raw_dir.iterdir()}
    run_purify_stage(cfg, "w", 0, plan_variants(cfg, ["saar"], [0.0, 1.01]))
    assert {p.name: p.read_bytes() for p in raw_dir.iterdir()} == before
    low = [s for r in purified(cfg, "saar", 0.0) for s in r.splices]
    high = [s for r in purified(cfg, "saar", 1.01) for s in r.splices]
    assert low and all(s.kind == "shallow" or s.split_failed for s in low)
    assert high and all(s.kind == "deep" for s in high)
    mid = statistics.median(s.similarity for s in low)  # in this world the JSON wrapper keeps similarity high
    run_purify_stage(cfg, "w", 0, plan_variants(cfg, ["saar"], [mid]))
    kinds = {s.kind for r in purified(cfg, "saar", mid) for s in r.splices}
    assert kinds == {"shallow", "deep"}
    assert [s.kind for r in purified(cfg, "saar", 0.5) for s in r.splices].count("deep") == 0


def test_output_is_byte_identical_across_runs(stage, tmp_path):
    cfg, _ = stage
    shutil.copytree(
        cfg.storage.root / "runs" / "w" / "iteration=0000" / "raw", tmp_path / "runs" / "w" / "iteration=0000" / "raw"
    )
    other = cfg_with(cfg, tmp_path, modes=["saar"], gammas=[0.5])
    run_purify_stage(other, "w", 0)
    a = read_manifest(RunLayout(cfg.storage.root, "w").purified_dir(0, "saar", 0.5))
    b = read_manifest(RunLayout(tmp_path, "w").purified_dir(0, "saar", 0.5))
    assert [p.crc32 for p in a.parts] == [p.crc32 for p in b.parts]


def _corrupt_run(cfg, root, bad: int) -> None:
    rows = read_shard(RunLayout(cfg.storage.root, "w").raw_dir(0), RAW).to_pylist()
    trajs = [trajectory_from_row(r) for r in rows]
    broken = [t for t in trajs if t.positions][:bad]
    for t in broken:
        t.positions[0].attempts[0].call_start = 99_999
    table = pa.Table.from_pylist([trajectory_to_row(t) for t in trajs], schema=RAW)
    write_shard(RunLayout(root, "w").raw_dir(0), table, RAW, "corrupt", inputs=[str(DEFAULT_POLICY)])


def test_bad_rows_go_to_dead_letters(stage, tmp_path):
    cfg, _ = stage
    _corrupt_run(cfg, tmp_path, bad=2)
    c = cfg_with(cfg, tmp_path, modes=["saar"], gammas=[0.5], max_dead_letter_fraction=0.05)
    (res,) = run_purify_stage(c, "w", 0)
    assert res.rows == 62 and res.dead == 2
    dead = read_shard(RunLayout(tmp_path, "w").dead_letter_dir(0, "saar", 0.5), DEAD_LETTER).to_pylist()
    assert all("call_start 99999 out of range" in d["reason"] for d in dead)


def test_too_many_bad_rows_fail_loudly_and_commit_nothing(stage, tmp_path):
    cfg, _ = stage
    _corrupt_run(cfg, tmp_path, bad=10)
    c = cfg_with(cfg, tmp_path, modes=["saar"], gammas=[0.5], max_dead_letter_fraction=0.05)
    with pytest.raises(DeadLetterOverflow, match=r"10/64 rows could not be purified"):
        run_purify_stage(c, "w", 0)
    assert read_manifest(RunLayout(tmp_path, "w").purified_dir(0, "saar", 0.5)) is None


def test_a_staged_file_lost_by_the_sink_fails_the_stage_and_commits_nothing(stage, tmp_path, monkeypatch):
    """WriteToFiles only logs a failed rename; the stage checks staged rows against the pipeline's counters."""
    cfg, _ = stage
    shutil.copytree(
        cfg.storage.root / "runs" / "w" / "iteration=0000" / "raw", tmp_path / "runs" / "w" / "iteration=0000" / "raw"
    )
    real_run = beam_pipeline.run

    def run_then_lose_a_file(job):
        counters = real_run(job)
        buckets = sorted(Path(job.staging).glob("mode=saar/gamma=0.50/purified-*.parquet"))  # one per bucket
        assert len(buckets) > 1
        lost_rows.append(pq.read_metadata(buckets[0]).num_rows)
        buckets[0].unlink()
        return counters

    lost_rows: list[int] = []
    monkeypatch.setattr(beam_pipeline, "run", run_then_lose_a_file)
    c = cfg_with(cfg, tmp_path, modes=["saar"], gammas=[0.5])
    with pytest.raises(
        StagingMismatch,
        match=r"staged rows for mode=saar/gamma=0.50/purified, but the pipeline "
        r"produced 64",
    ) as e:
        run_purify_stage(c, "w", 0)
    assert f"{64 - lost_rows[0]} staged rows" in str(e.value)
    assert read_manifest(RunLayout(tmp_path, "w").purified_dir(0, "saar", 0.5)) is None


def test_dynamic_filter_drops_uniform_groups(stage, tmp_path):
    cfg, _ = stage
    shutil.copytree(
        cfg.storage.root / "runs" / "w" / "iteration=0000" / "raw", tmp_path / "runs" / "w" / "iteration=0000" / "raw"
    )
    c = cfg_with(cfg, tmp_path, modes=["saar"], gammas=[0.5], dynamic_filter=True)
    run_purify_stage(c, "w", 0)
    rows = purified(c, "saar", 0.5)
    m = read_manifest(RunLayout(tmp_path, "w").purified_dir(0, "saar", 0.5))
    assert len(rows) == 64 - 4 * m.extra["filtered_groups"] and m.extra["filtered_groups"] > 0
    assert all(len({r.reward for r in rows if r.prompt_id == p}) == 2 for p in {r.prompt_id for r in rows})


def test_a_partition_committed_in_chunks_and_parts_holds_the_rows_of_one_sort(stage, tmp_path, monkeypatch):
    """The commit merges the sorted staged buckets a chunk (a row group) at a time, across part boundaries: the
    partition holds the rows, in the order, that one sort of all of them gives, and every part, summary and text
    checks against the manifest."""
    from purifier import commit
    from storage.shards import summary_parts, text_parts

    cfg, _ = stage
    shutil.copytree(
        cfg.storage.root / "runs" / "w" / "iteration=0000" / "raw", tmp_path / "runs" / "w" / "iteration=0000" / "raw"
    )
    monkeypatch.setattr(commit, "COMMIT_TOKENS", 3_000)  # a few rows of the tiny policy's rollouts per chunk
    c = cfg_with(cfg, tmp_path, modes=["saar"], gammas=[0.5])
    c.storage.rows_per_part = 10
    run_purify_stage(c, "w", 0)
    out = RunLayout(tmp_path, "w").purified_dir(0, "saar", 0.5)
    m = read_manifest(out)
    assert [p.rows for p in m.parts] == [10] * 6 + [4]
    assert len(summary_parts(m)) == len(text_parts(m)) == 7
    groups = [pq.ParquetFile(out / p.name).num_row_groups for p in m.parts]
    assert max(groups) > 1  # chunks ended inside parts
    whole = RunLayout(cfg.storage.root, "w").purified_dir(0, "saar", 0.5)
    assert read_shard(out, PURIFIED).equals(read_shard(whole, PURIFIED))  # checksums checked as it is read
    with Catalog(tmp_path) as cat:
        assert cat.query("SELECT count(*) AS n FROM purified_texts").to_pylist() == [{"n": 64}]


def test_variant_keys_have_a_coder_of_their_own(stage, tmp_path, caplog):
    """The GroupByKey's keys (variant, bucket) go through VariantCoder: deterministic, round-trips every field, and
    Beam does not fall back to (and warn about) its pickling coder for the dataclass at every bundle."""
    from pipeline.modes import Variant
    from pipeline.similarity import Measure

    v = Variant.of("saar", 0.3, Measure("difflib", "code"))
    coder = beam_pipeline.VariantCoder()
    assert coder.decode(coder.encode(v)) == v and coder.is_deterministic()
    assert coder.encode(Variant.of("saar", 0.3, Measure("difflib", "code"))) == coder.encode(v)
    cfg, _ = stage
    shutil.copytree(
        cfg.storage.root / "runs" / "w" / "iteration=0000" / "raw", tmp_path / "runs" / "w" / "iteration=0000" / "raw"
    )
    with caplog.at_level("WARNING"):
        run_purify_stage(cfg_with(cfg, tmp_path, modes=["saar"], gammas=[0.5]), "w", 0)
    assert not [r for r in caplog.records if "fallback deterministic coder" in r.getMessage()]
