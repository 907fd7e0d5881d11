"""Chunked log-probs (pipeline/logprobs.py) equal the unchunked full-vocabulary computation: the
primitive itself at Qwen3's vocabulary, the update's actor log-probs and their gradients, the CPU
recompute and the CPU engine's chunked prefill."""

from __future__ import annotations

import random

import pytest
import torch
from transformers import AutoModelForCausalLM, Qwen3ForCausalLM

from pipeline.config import DEFAULT_POLICY, TrainConfig
from pipeline.logprobs import split_causal_lm, token_entropy, token_logprobs
from pipeline.trajectory import PurifiedTrajectory
from purifier.recompute import CPURecompute
from pipeline.engines.base import SamplingParams
from rollout_gen.engines.cpu import CPUEngine
from trainer.chunked_actor import action_log_probs
from trainer.grpo import GRPOUpdate
from flows.init_policy import InitPolicyConfig, qwen3_config


@pytest.fixture(scope="module")
def qwen3_random():
    torch.manual_seed(0)
    return Qwen3ForCausalLM(qwen3_config(InitPolicyConfig(steps=0))).float().eval()


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_token_logprobs_equal_full_log_softmax_at_qwen3_vocab(qwen3_random, temperature):
    body, head = split_causal_lm(qwen3_random)
    ids = torch.randint(0, 151_936, (2, 37))
    with torch.no_grad():
        hidden = body(input_ids=ids).last_hidden_state
        full = torch.log_softmax(qwen3_random(ids).logits.float() / temperature, -1)
        want = full.gather(-1, ids[:, :, None])[..., 0]
        got = token_logprobs(hidden, ids, head, temperature, chunk=10)  # 8 chunks, the last one short
        ent = token_entropy(hidden, head, temperature, chunk=10)
    assert full.shape[-1] == 151_936
    assert torch.allclose(got, want, atol=1e-5)
    assert torch.allclose(ent, -(full.exp() * full).sum(-1), atol=1e-4)


def test_update_log_probs_and_gradients_equal_openrlhf_actor():
    cfg = TrainConfig(log_entropy=True)
    m1 = AutoModelForCausalLM.from_pretrained(DEFAULT_POLICY, dtype=torch.float32, attn_implementation="eager")
    m2 = AutoModelForCausalLM.from_pretrained(DEFAULT_POLICY, dtype=torch.float32, attn_implementation="eager")
    a1, a2 = GRPOUpdate(m1, cfg, temperature=0.8).actor, GRPOUpdate(m2, cfg, temperature=0.8).actor
    g = torch.Generator().manual_seed(0)
    seq = torch.randint(3, 1000, (3, 29), generator=g)
    att = torch.ones_like(seq)
    att[1, 20:] = 0  # right padding, as collate() writes it
    act = (torch.rand((3, 28), generator=g) < 0.7).float() * att[:, 1:]
    old, adv = torch.randn((3, 28), generator=g) * 0.3 - 2.0, torch.randn((3, 28), generator=g)
    want, out = a1(seq, act, attention_mask=att, return_output=True, return_entropy=True)
    got, entropy = action_log_probs(a2, seq, act, att, return_entropy=True, chunk=9)
    assert torch.allclose(got, want, atol=1e-5)
    assert torch.allclose(entropy * act, out.entropy * act, atol=1e-4)
    loss_fn = GRPOUpdate(m1, cfg).loss_fn
    loss_fn(want, old, adv, action_mask=act)[0].backward()
    loss_fn(got, old, adv, action_mask=act)[0].backward()
    for (name, p1), (_, p2) in zip(m1.named_parameters(), m2.named_parameters()):
        assert torch.allclose(p1.grad, p2.grad, atol=1e-5), name


def _rows(n: int, prompt_len: int, seed: int) -> list[PurifiedTrajectory]:
    rng = random.Random(seed)
    prompt = [rng.randrange(5, 1000) for _ in range(prompt_len)]
    rows = []
    for i in range(n):
        resp = [rng.randrange(5, 1000) for _ in range(rng.randint(3, 40))]
        valid = [int(rng.random() < 0.5) for _ in resp]
        rows.append(
            PurifiedTrajectory(
                "r",
                0,
                "p",
                i,
                "saar",
                0.5,
                f"k{i}",
                prompt,
                resp,
                [1] * len(resp),
                [0.0] * len(resp),
                valid,
                1.0,
                0.5,
                [],
                -1,
                0,
                True,
            )
        )
    return rows


def test_chunked_recompute_equals_a_full_forward():
    rows = _rows(5, 23, seed=1)
    got = CPURecompute(DEFAULT_POLICY, temperature=0.9, chunk_tokens=16).group(rows)  # chunks of 3 positions
    model = AutoModelForCausalLM.from_pretrained(DEFAULT_POLICY, dtype=torch.float32, attn_implementation="eager")
    checked = 0
    for r, g in zip(rows, got):
        with torch.no_grad():
            logp = torch.log_softmax(model(torch.tensor([r.prompt_ids + r.response_ids])).logits[0] / 0.9, -1)
        p = len(r.prompt_ids)
        for i, tok in enumerate(r.response_ids):
            if not r.logprob_valid[i]:
                assert abs(g.old_logprobs[i] - logp[p + i - 1, tok].item()) <= 1e-5, (r.raw_key, i)
                checked += 1
            else:
                assert g.old_logprobs[i] == 0.0  # kept as sampled
    assert checked > 30


def test_chunked_prefill_samples_exactly_like_one_forward():
    contexts = [[random.Random(k).randrange(5, 1000) for _ in range(n)] for k, n in enumerate((40, 57, 33))]
    shared = [0, 0, 0]
    params = SamplingParams(12, 1.0, 1.0, ())
    big, small = CPUEngine(DEFAULT_POLICY, chunk_tokens=100_000), CPUEngine(DEFAULT_POLICY, chunk_tokens=12)
    want = big.generate(contexts, params, seeds=[1, 2, 3], shared_prefix=shared)
    got = small.generate(contexts, params, seeds=[1, 2, 3], shared_prefix=shared)
    assert [g.output_ids for g in got] == [w.output_ids for w in want]
    for g, w in zip(got, want):
        assert max(abs(a - b) for a, b in zip(g.logprobs, w.logprobs)) <= 1e-5
