"""Phase 1 end to end with the real tiny policy, the real sandbox, real Parquet and DuckDB."""

from __future__ import annotations

import pytest
import torch

from pipeline.config import DEFAULT_POLICY, load_config
from pipeline.trajectory import trajectory_from_row
from purifier.saar import purify
from rollout_gen.stage import run_rollout_stage
from pipeline.chat import load_chat
from storage.catalog import Catalog
from storage.layout import RunLayout
from storage.schemas import RAW
from storage.shards import read_shard


@pytest.fixture(scope="module")
def rollout(tmp_path_factory):
    root = tmp_path_factory.mktemp("ws")
    cfg = load_config(
        None,
        [f"storage.root={root}", "rollout.tasks_per_iteration=16", "rollout.samples_per_prompt=4", "rollout.seed=3"],
    )
    manifest = run_rollout_stage(cfg, "e2e", 0, DEFAULT_POLICY, show_progress=False)
    rows = read_shard(RunLayout(root, "e2e").raw_dir(0), RAW).to_pylist()
    return cfg, manifest, [trajectory_from_row(r) for r in rows]


def test_raw_shard_has_real_failures_retries_and_recoveries(rollout):
    cfg, manifest, trajectories = rollout
    assert manifest.rows == len(trajectories) == 64
    attempts = [a for t in trajectories for p in t.positions for a in p.attempts]
    assert any(a.failed and a.result.error_class == "model" for a in attempts)
    assert any(a.attempt_idx > 0 for a in attempts)
    assert any(p.outcome == "recovered" for t in trajectories for p in t.positions)
    assert {t.reward for t in trajectories} == {1.0, -1.0}
    # the same group shares one prompt
    by_prompt = {}
    for t in trajectories:
        by_prompt.setdefault(t.prompt_id, set()).add(tuple(t.prompt_ids))
    assert len(by_prompt) == 16 and all(len(v) == 1 for v in by_prompt.values())
    with Catalog(cfg.storage.root) as cat:
        n = cat.query("SELECT count(*) AS n FROM raw_trajectories").to_pylist()[0]["n"]
        failures = cat.query("SELECT count(*) AS n FROM raw_attempts WHERE status = 'failure'").to_pylist()[0]["n"]
    assert n == 64 and failures == sum(a.failed for a in attempts)


def test_lived_sequence_is_the_concatenation_of_its_turns(rollout):
    cfg, _, trajectories = rollout
    chat = load_chat(DEFAULT_POLICY)
    for t in trajectories:
        assert len(t.lived_mask) == len(t.lived_ids) == len(t.lived_logprobs)
        rebuilt = purify(t, t.gamma_live, "saar", chat.decode)
        assert rebuilt.response_ids == t.lived_ids, t.key
        assert rebuilt.loss_mask == t.lived_mask
        for p in t.positions:
            for a in p.attempts:
                assert len(a.logprobs) == len(a.turn_ids)


def test_sampled_logprobs_equal_a_full_forward(rollout):
    _, _, trajectories = rollout
    chat = load_chat(DEFAULT_POLICY)
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(
        DEFAULT_POLICY, dtype=torch.float32, attn_implementation="eager"
    ).eval()
    checked = 0
    for t in trajectories:
        valid = purify(t, t.gamma_live, "saar", chat.decode).logprob_valid
        seq = torch.tensor([t.prompt_ids + t.lived_ids])
        with torch.no_grad():
            logp = torch.log_softmax(model(seq).logits[0].float(), -1)
        p = len(t.prompt_ids)
        for i, tok in enumerate(t.lived_ids):
            if t.lived_mask[i] and valid[i]:
                assert abs(logp[p + i - 1, tok].item() - t.lived_logprobs[i]) <= 1e-4, (t.key, i)
                checked += 1
    assert checked > 1000


def test_rerun_keeps_the_committed_shard(rollout):
    cfg, manifest, _ = rollout
    again = run_rollout_stage(cfg, "e2e", 0, DEFAULT_POLICY, show_progress=False)
    assert again == manifest


def test_a_committed_rollout_is_kept_when_only_the_engine_threads_change(world_copy):
    """rollout.engine_tuning.threads is speed only: `cleaner train` resumed a run with other threads (run.json leaves
    them out) while `cleaner rollout` on the same committed iteration refused the shard as "other rollout settings".
    Both keep it now; a setting that changes the rows still refuses."""
    from pipeline.config import DEFAULT_POLICY
    from rollout_gen.stage import run_rollout_stage
    from storage.layout import RunLayout
    from storage.shards import ShardError, read_manifest

    committed = read_manifest(RunLayout(world_copy.storage.root, "w").raw_dir(0))
    faster = world_copy.model_copy(deep=True)
    faster.rollout.engine_tuning.threads = 2
    assert run_rollout_stage(faster, "w", 0, DEFAULT_POLICY, show_progress=False) == committed
    other = world_copy.model_copy(deep=True)
    other.rollout.temperature = 0.7
    with pytest.raises(ShardError, match="committed with other rollout settings"):
        run_rollout_stage(other, "w", 0, DEFAULT_POLICY, show_progress=False)
