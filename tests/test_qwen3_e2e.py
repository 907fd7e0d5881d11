"""A Qwen3-layout policy (real Qwen3 tokenizer, vocabulary 151,936) end to end: rollout over the SGLang
HTTP contract double → purify (Beam, SAAR on the `code` target, shallow and deep) → recompute → update
→ next rollout on the updated checkpoint (CPU engine). Ids above 65,535 everywhere, `<think>` blocks
before calls, the call marker is the single token 151657."""

from __future__ import annotations

import os

import pyarrow as pa
import pytest
import torch
from transformers import AutoModelForCausalLM

from pipeline.config import ALWAYS_DEEP, load_config
from pipeline.qwen3_tokenizer import TOOL_CALL_ID
from pipeline.trajectory import purified_from_row, trajectory_from_row
from purifier.stage import run_purify_stage
from rollout_gen.stage import run_rollout_stage
from storage.checkpoints import policy_version
from storage.layout import RunLayout
from storage.schemas import PURIFIED, RAW
from storage.shards import read_shard
from tests.sglang_contract_double import SGLangContractDouble
from flows.init_policy import init_policy
from trainer.stage import run_update_stage

THINK, END_THINK = 151667, 151668
os.environ.setdefault("HF_HUB_OFFLINE", "1")


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    root = tmp_path_factory.mktemp("qwen3")
    policy = root / "policy"
    init_policy(policy, log=lambda *_: None)
    server = SGLangContractDouble(policy)
    cfg = load_config(
        None,
        [
            f"storage.root={root}",
            f"rollout.policy={policy}",
            "rollout.engine=sglang",
            f"rollout.sglang_url={server.url}",
            "rollout.tasks_per_iteration=3",
            "rollout.samples_per_prompt=4",
            "rollout.max_turn_tokens=80",
            "rollout.max_prompt_tokens=512",
            "rollout.max_response_tokens=400",
            "rollout.saar.similarity_on=code",
            "purify.modes=[saar]",
            f"purify.gammas=[0.3,{ALWAYS_DEEP}]",
            "train.gamma=0.3",
            "train.mini_batches=1",
            "rollout.seed=1",
        ],
    )
    try:
        run_rollout_stage(cfg, "q3", 0, policy, show_progress=False)
    finally:
        server.close()
    raw = read_shard(RunLayout(root, "q3").raw_dir(0), RAW)
    return cfg, policy, server, raw


def test_rollout_over_http_keeps_real_ids_think_blocks_and_the_single_token_marker(run):
    cfg, policy, server, raw = run
    assert raw.schema.field("lived_ids").type == pa.list_(pa.int32())  # 151,936 > 65,535 fits, no narrowing
    sent = [ids for req in server.requests if req["path"] == "/generate" for ids in req["input_ids"]]
    assert sent and all(max(ids) > 65_535 for ids in sent)  # the prompt's <|im_start|> etc. went over HTTP
    trajectories = [trajectory_from_row(r) for r in raw.to_pylist()]
    calls = [a for t in trajectories for p in t.positions for a in p.attempts if a.call_start >= 0]
    assert len(calls) >= 6 and max(max(t.lived_ids) for t in trajectories) >= TOOL_CALL_ID
    for a in calls:
        assert a.turn_ids[a.call_start] == TOOL_CALL_ID  # exact id: 151657 mod 2**16 would be 20585
    # <think> … </think> first, as the small policy was trained to write (a sampled turn may stray)
    thinking = [a for a in calls if a.turn_ids[0] == THINK and END_THINK in a.turn_ids[: a.call_start]]
    assert len(thinking) >= 0.8 * len(calls), (len(thinking), len(calls))
    assert any(a.failed for a in calls) and any(a.attempt_idx > 0 for a in calls)  # real failures and retries


def purified(cfg, gamma):
    d = RunLayout(cfg.storage.root, "q3").purified_dir(0, "saar", gamma, "rapidfuzz-code")  # the `code` target
    return [purified_from_row(r) for r in read_shard(d, PURIFIED).to_pylist()]


def test_purify_update_and_next_rollout(run):
    cfg, policy, _, raw = run
    run_purify_stage(cfg, "q3", 0)
    shallow, deep = purified(cfg, 0.3), purified(cfg, ALWAYS_DEEP)
    kinds = lambda rows: {s.kind for r in rows for s in r.splices}  # noqa: E731
    assert "shallow" in kinds(shallow) and kinds(deep) == {"deep"}
    model = AutoModelForCausalLM.from_pretrained(policy, dtype=torch.float32, attn_implementation="eager").eval()
    recomputed = 0
    for r in [r for r in shallow + deep if r.recompute_from >= 0][:4]:
        with torch.no_grad():  # the unchunked reference: full-vocabulary logits of the whole sequence
            logits = model(torch.tensor([r.prompt_ids + r.response_ids])).logits[0]
        p = len(r.prompt_ids)
        for i, tok in enumerate(r.response_ids):
            if r.loss_mask[i]:
                # float64: a float32 log_softmax over 151,936 peaked logits is itself ~1e-4 off here
                want = torch.log_softmax(logits[p + i - 1].double(), -1)[tok].item()
                assert abs(want - r.old_logprobs[i]) <= 1e-4, (r.raw_key, i)
                recomputed += not r.logprob_valid[i]
    assert recomputed > 0
    target = run_update_stage(cfg, "q3", 0, log=lambda *_: None)
    assert policy_version(target) != policy_version(policy)
    cpu = cfg.model_copy(deep=True)
    cpu.rollout.engine = "cpu"
    manifest = run_rollout_stage(cpu, "q3", 1, target, show_progress=False)
    assert manifest.rows == 12 and manifest.extra["policy_version"] == policy_version(target)
    nxt = [trajectory_from_row(r) for r in read_shard(RunLayout(cfg.storage.root, "q3").raw_dir(1), RAW).to_pylist()]
    assert any(
        a.turn_ids[a.call_start] == TOOL_CALL_ID
        for t in nxt
        for p in t.positions
        for a in p.attempts
        if a.call_start >= 0
    )
