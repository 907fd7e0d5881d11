"""The Qwen3 layout (the real Qwen3 tokenizer, 151,936 ids, tied embeddings, Qwen3's chat template) through
vLLM's real CPU server, started by cleaner. vLLM's CPU attention serves head sizes from 32 up, and the
committed `cleaner init-policy` weights have head_dim 16: that policy is refused in one line, and the rest
runs on an init-policy of the same layout with head_dim 32 and random weights (so it never calls the tool):
ids above 65,535 go over HTTP and come back exact, sampled log-probs are the checkpoint's over the whole
vocabulary, and a checkpoint loaded in place is served whole, its tied lm_head included (vLLM's CPU reload
alone leaves that at the old weights)."""

from __future__ import annotations

import os

import pytest
import torch
from transformers import AutoModelForCausalLM

from flows.init_policy import InitPolicyConfig, init_policy
from pipeline.config import load_config
from pipeline.engines.vllm import connect
from pipeline.trajectory import trajectory_from_row
from purifier.saar import purify
from pipeline.chat import load_chat
from rollout_gen.stage import run_rollout_stage
from storage.layout import RunLayout
from storage.schemas import RAW
from storage.shards import read_shard
from tests.vllm_helpers import perturbed_copy, requires_vllm

pytestmark = [requires_vllm, pytest.mark.slow]
TOL = 1e-4  # fp32 server vs a float64 log_softmax of the fp32 logits (151,936-way)
os.environ.setdefault("HF_HUB_OFFLINE", "1")


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    root = tmp_path_factory.mktemp("vllm-qwen3")
    policy = root / "policy"
    init_policy(policy, InitPolicyConfig(head_dim=32, steps=0), log=lambda *_: None)
    cfg = load_config(
        None,
        [
            f"storage.root={root}",
            f"rollout.policy={policy}",
            "rollout.engine=vllm",
            "rollout.tasks_per_iteration=3",
            "rollout.samples_per_prompt=4",
            "rollout.max_turn_tokens=80",
            "rollout.max_prompt_tokens=512",
            "rollout.max_response_tokens=400",
            "rollout.saar.similarity_on=code",
            "rollout.seed=1",
        ],
    )
    run_rollout_stage(cfg, "q3", 0, policy, show_progress=False)  # starts the server (rollout.vllm_urls empty)
    raw = [trajectory_from_row(r) for r in read_shard(RunLayout(root, "q3").raw_dir(0), RAW).to_pylist()]
    return cfg, policy, raw


def _forward(checkpoint, seq: list[int]) -> list[float]:
    model = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32, attn_implementation="eager").eval()
    with torch.no_grad():
        lp = torch.log_softmax(model(torch.tensor([seq])).logits[0].double(), -1)
    return [lp[k - 1, seq[k]].item() for k in range(1, len(seq))]


def test_the_committed_init_policy_is_refused_in_one_line(tmp_path):
    from pipeline.config import DEFAULT_VLLM_VENV
    from pipeline.engines.vllm_server import VLLMServerError, start_servers

    policy = tmp_path / "policy"
    init_policy(policy, log=lambda *_: None)
    with pytest.raises(VLLMServerError) as e:
        start_servers(policy, 1, DEFAULT_VLLM_VENV)
    assert "head_dim 16" in str(e.value) and "\n" not in str(e.value)


def test_qwen3_ids_round_trip_and_live_saar_is_relived(run):
    _, policy, raw = run
    assert len(raw) == 12
    assert all(max(t.prompt_ids) > 65_535 for t in raw) and any(max(t.lived_ids) > 65_535 for t in raw)
    assert all(len(t.lived_ids) == len(t.lived_logprobs) for t in raw)
    chat = load_chat(policy)
    for t in raw:
        assert purify(t, t.gamma_live, "saar", chat.decode).response_ids == t.lived_ids


def test_qwen3_sampled_log_probs_are_the_checkpoints(run):
    _, policy, raw = run
    chat = load_chat(policy)
    worst = 0.0
    for t in raw[:4]:
        valid = purify(t, t.gamma_live, "saar", chat.decode).logprob_valid
        ref = _forward(policy, t.prompt_ids + t.lived_ids)[len(t.prompt_ids) - 1 :]
        worst = max(
            [worst] + [abs(r - lp) for r, lp, m, v in zip(ref, t.lived_logprobs, t.lived_mask, valid) if m and v]
        )
    assert worst <= TOL


def test_a_qwen3_checkpoint_loaded_in_place_is_served_whole(run, tmp_path):
    cfg, policy, raw = run
    new = perturbed_copy(policy, tmp_path / "perturbed", 0.05)
    engine = connect(cfg.rollout, new)  # the same started server, loading `new` in place
    try:
        seq = raw[0].prompt_ids + raw[0].lived_ids
        (scored,) = engine.score([seq], [1])
    finally:
        engine.serve(policy)
        engine.close()
    ref_new, ref_old = _forward(new, seq), _forward(policy, seq)
    assert max(abs(a - b) for a, b in zip(ref_new, scored)) <= TOL
    assert max(abs(a - b) for a, b in zip(ref_old, scored)) > 100 * TOL
