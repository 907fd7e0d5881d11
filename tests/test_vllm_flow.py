"""The training flow on vLLM's real CPU server (no double): `cleaner train` with rollout.engine=vllm and
purify.recompute=vllm, two iterations, in its own process like a user's. Its shards must decode to
multi-turn tool conversations with SAAR splices, live SAAR must be relived exactly offline, the recomputed
log-probs must be the model's, and iteration 1 must have sampled from the updated checkpoint."""

from __future__ import annotations

import math

import pytest
import torch
from transformers import AutoModelForCausalLM

from pipeline.config import DEFAULT_POLICY, load_config
from pipeline.chat import load_chat
from pipeline.trajectory import purified_from_row, trajectory_from_row
from purifier.saar import purify
from storage.checkpoints import policy_version
from storage.layout import RunLayout
from storage.schemas import PURIFIED, RAW
from storage.shards import read_manifest, read_shard
from tests.flow_helpers import cleaner, tiny_config
from tests.test_purify_golden import check_invariants
from tests.vllm_helpers import requires_vllm, shared_url

pytestmark = [requires_vllm, pytest.mark.slow]

TOL = 1e-4  # fp32 on both sides; vLLM's CPU kernels and transformers' eager attention differ by ~1e-6 here


@pytest.fixture(scope="module")
def flow(tmp_path_factory):
    root = tmp_path_factory.mktemp("vllm-flow")
    # the tiny run (two iterations, saar and raw at γ 0.5) sampled and recomputed by the vLLM server
    cfg_file = tiny_config(
        root,
        "flow.yaml",
        flow={"run_id": "v", "iterations": 2, "tensorboard": False},
        rollout={
            "engine": "vllm",
            "vllm_urls": [shared_url()],
            "tasks_per_iteration": 8,
            "samples_per_prompt": 4,
            "max_response_tokens": 512,
            "max_prompt_tokens": 256,
            "seed": 1,
        },
        purify={"recompute": "vllm"},
        train={"lr": 2.0e-4},
    )
    p = cleaner(["train", "-c", str(cfg_file)], root)
    out, _ = p.communicate(timeout=900)
    assert p.returncode == 0, out[-3000:]
    cfg = load_config(cfg_file, [])
    layout = RunLayout(root, "v")
    raws = {i: [trajectory_from_row(r) for r in read_shard(layout.raw_dir(i), RAW).to_pylist()] for i in (0, 1)}
    saar = {
        i: [purified_from_row(r) for r in read_shard(layout.purified_dir(i, "saar", 0.5), PURIFIED).to_pylist()]
        for i in (0, 1)
    }
    return cfg, layout, raws, saar, out


def _forward(checkpoint):
    model = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32, attn_implementation="eager").eval()

    def logp(prompt: list[int], response: list[int]) -> list[float]:
        with torch.no_grad():
            lp = torch.log_softmax(model(torch.tensor([prompt + response])).logits[0].double(), -1)
        return [lp[len(prompt) + i - 1, t].item() for i, t in enumerate(response)]

    return logp


def test_flow_commits_multi_turn_tool_conversations_with_saar_splices(flow):
    cfg, layout, raws, saar, _ = flow
    chat = load_chat(DEFAULT_POLICY)
    for i in (0, 1):
        assert read_manifest(layout.raw_dir(i)).rows == 32
        assert read_manifest(layout.purified_dir(i, "raw", 0.0)) is not None
    trajectories = raws[0] + raws[1]
    calls = [a for t in trajectories for p in t.positions for a in p.attempts if a.call_start >= 0]
    assert any(len(t.positions) >= 2 for t in trajectories)  # several tool turns in one conversation
    assert any(a.failed for a in calls) and any(a.attempt_idx > 0 for a in calls)  # failures and live retries
    for t in trajectories:
        prompt = chat.decode(t.prompt_ids)
        assert prompt.startswith("<|im_start|>") and t.question in prompt
        # as lived: every tool response is one whole turn between assistant turns
        check_invariants(t, purify(t, t.gamma_live, "saar", chat.decode), chat)
    spliced = [r for i in (0, 1) for r in saar[i] if r.splices]
    assert spliced, "no SAAR splice in 64 trajectories"
    for i in (0, 1):
        by_key = {t.key: t for t in raws[i]}
        for r in saar[i]:
            check_invariants(by_key[r.raw_key], r, chat)  # every mask-0 run is one whole tool-response turn
    for r in spliced:
        assert "<tool_response>" in chat.decode(r.response_ids)


def test_live_saar_is_relived_offline_on_vllm_shards(flow):
    """Purifying at the live γ with the live measure rebuilds exactly what was lived (tests/test_saar_fidelity)."""
    _, _, raws, _, _ = flow
    chat = load_chat(DEFAULT_POLICY)
    for t in raws[0] + raws[1]:
        p = purify(t, t.gamma_live, "saar", chat.decode)
        assert p.response_ids == t.lived_ids and p.loss_mask == t.lived_mask, t.key


def test_recomputed_log_probs_are_the_sampling_checkpoints(flow):
    """purify.recompute=vllm filled every re-contexted token with the log-prob of the checkpoint that sampled the
    shard (the server was serving checkpoint 1 by then for iteration 1, checkpoint 0 for iteration 0)."""
    cfg, layout, _, saar, _ = flow
    checked = 0
    for i, ckpt in ((0, DEFAULT_POLICY), (1, layout.checkpoint_dir(1))):
        logp = _forward(ckpt)
        for r in [r for r in saar[i] if r.recompute_from >= 0][:6]:
            ref = logp(r.prompt_ids, r.response_ids)
            for k, (m, v) in enumerate(zip(r.loss_mask, r.logprob_valid)):
                if m and not v:
                    assert abs(ref[k] - r.old_logprobs[k]) <= TOL, (i, r.raw_key, k)
                    checked += 1
    assert checked > 0


def test_iteration_1_samples_from_the_updated_weights(flow):
    """After the update the server serves checkpoint 1: iteration 1's sampled log-probs equal checkpoint 1's
    forward within TOL, and are farther than that from checkpoint 0's."""
    _, layout, raws, _, _ = flow
    new, old = layout.checkpoint_dir(1), DEFAULT_POLICY
    assert read_manifest(layout.raw_dir(1)).extra["policy_version"] == policy_version(new) != policy_version(old)
    fwd_new, fwd_old = _forward(new), _forward(old)
    chat = load_chat(DEFAULT_POLICY)
    d_new, d_old = [], []
    for t in raws[1][:8]:
        valid = purify(t, t.gamma_live, "saar", chat.decode).logprob_valid
        ref_new, ref_old = fwd_new(t.prompt_ids, t.lived_ids), fwd_old(t.prompt_ids, t.lived_ids)
        for k, lp in enumerate(t.lived_logprobs):
            if t.lived_mask[k] and valid[k]:
                d_new.append(abs(ref_new[k] - lp))
                d_old.append(abs(ref_old[k] - lp))
    assert max(d_new) <= TOL
    assert sum(d_old) / len(d_old) > 10 * TOL and not math.isclose(max(d_old), max(d_new))


def test_the_flow_said_what_it_did(flow):
    *_, out = flow
    assert "Traceback" not in out
