"""The CPU engine's own Qwen3 forward (rollout_gen/engines/qwen3_forward.py) against transformers'
forward of the same model: bit-identical logits and KV on the engine's batch layouts (left padding,
padding between a kept prefix and new tokens, chunked prefill, decoding steps, positions past the
first cos/sin table), on the committed policy and on a grouped-query model with biases; other
models go through their own forward."""

from __future__ import annotations

import pytest
import torch
from transformers import (
    AutoModelForCausalLM,
    DynamicCache,
    LlamaConfig,
    LlamaForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
)

from pipeline.config import DEFAULT_POLICY
from rollout_gen.engines.qwen3_forward import Qwen3Forward, engine_forward, model_forward


def _policy() -> torch.nn.Module:
    return AutoModelForCausalLM.from_pretrained(DEFAULT_POLICY, dtype=torch.float32, attn_implementation="eager").eval()


def _grouped_query() -> torch.nn.Module:
    torch.manual_seed(0)
    cfg = Qwen3Config(
        vocab_size=300,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        attention_bias=True,
        max_position_embeddings=4096,
    )
    model = Qwen3ForCausalLM._from_config(cfg, attn_implementation="eager").eval()
    with torch.no_grad():  # biases start at zero: make them count
        for p in model.parameters():
            p.add_(0.02 * torch.randn_like(p))
    return model


def _run(forward, vocab: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """The engine's layouts: three rows with a kept prefix of different lengths (zeros between it and
    the new tokens), new tokens left-padded and forwarded in two chunks, then decoding steps; one row
    sits at positions past 1024."""
    g = torch.Generator().manual_seed(1)
    b, past, new = 3, 40, 24
    past_mask = torch.ones(b, past, dtype=torch.long)
    past_mask[1, :15] = 0
    past_mask[2, :] = 0
    mask = torch.ones(b, new, dtype=torch.long)
    mask[0, :9] = 0
    ids = torch.randint(3, vocab, (b, past + new), generator=g)
    start = torch.tensor([[0], [1300], [0]])
    full = torch.cat([past_mask, mask], dim=1)
    pos = (start + full.cumsum(-1) - 1).clamp(min=0)
    cache, logits = DynamicCache(), []
    with torch.inference_mode():
        forward(ids[:, :past], past_mask, pos[:, :past], cache)
        for a, z in ((past, past + 10), (past + 10, past + new)):  # chunked prefill through the cache
            logits.append(forward(ids[:, a:z], full[:, :z], pos[:, a:z], cache))
        last = pos[:, -1:]
        for _ in range(4):
            full = torch.cat([full, torch.ones(b, 1, dtype=torch.long)], dim=1)
            last = last + 1
            logits.append(forward(torch.randint(3, vocab, (b, 1), generator=g), full, last, cache))
    return logits, [t for layer in cache.layers for t in (layer.keys, layer.values)]


@pytest.mark.parametrize("build", [_policy, _grouped_query], ids=["committed policy", "grouped-query with biases"])
def test_the_engines_qwen3_forward_gives_the_models_own_logits_bit_for_bit(build):
    model = build()
    ours = engine_forward(model)
    assert isinstance(ours, Qwen3Forward)
    got, got_kv = _run(ours, model.config.vocab_size)
    want, want_kv = _run(model_forward(model), model.config.vocab_size)
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    assert all(torch.equal(a, b) for a, b in zip(got_kv, want_kv))


def test_other_models_go_through_their_own_forward():
    torch.manual_seed(0)
    llama = LlamaForCausalLM._from_config(
        LlamaConfig(vocab_size=300, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4),
        attn_implementation="eager",
    ).eval()
    sdpa = AutoModelForCausalLM.from_pretrained(DEFAULT_POLICY, dtype=torch.float32, attn_implementation="sdpa").eval()
    ids = torch.randint(3, 300, (1, 12), generator=torch.Generator().manual_seed(2))
    for model in (llama, sdpa):
        forward = engine_forward(model)
        assert not isinstance(forward, Qwen3Forward)
        with torch.inference_mode():  # the engine's call convention reaches the model's own forward
            got = forward(ids, torch.ones_like(ids), torch.arange(12)[None], DynamicCache())
            assert torch.allclose(got, model(ids).logits[:, -1], atol=1e-5)
