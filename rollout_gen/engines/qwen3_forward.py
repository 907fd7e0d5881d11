"""The CPU engine's forward pass for Qwen3 checkpoints: the float operations of transformers' eager
Qwen3 forward, in the same order on the same weights (so the logits are bit-identical, tested), without
the machinery a general model call carries (module hooks, output capturing, config lookups, mask
factories). On the tiny policy that machinery is most of a decoding step: rows forwarded one at a
time, which is what bounds an asynchronous rollout, spend more time in it than in arithmetic.

Other architectures go through the model's own forward (`model_forward`)."""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F
from transformers import DynamicCache

# (ids [B, q], mask [B, past + q], positions [B, q], cache) -> logits of the last position [B, V]
Forward = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, DynamicCache], torch.Tensor]


def model_forward(model: torch.nn.Module) -> Forward:
    def forward(ids, mask, pos, cache):
        return model(
            input_ids=ids,
            attention_mask=mask,
            position_ids=pos,
            past_key_values=cache,
            use_cache=True,
            logits_to_keep=1,
        ).logits[:, -1, :]

    return forward


def engine_forward(model: torch.nn.Module) -> Forward:
    """The fastest forward that gives this model's own logits bit for bit."""
    cfg = model.config
    plain = (
        cfg.model_type == "qwen3"
        and cfg._attn_implementation == "eager"
        and set(cfg.layer_types) == {"full_attention"}
        and cfg.hidden_act == "silu"
        and (cfg.rope_parameters or {}).get("rope_type", "default") == "default"
    )
    return Qwen3Forward(model) if plain else model_forward(model)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class Qwen3Forward:
    """Qwen3ForCausalLM's eager forward in float32 (see the module docstring), with fewer operations
    than the model's own, each giving the same floats: RMSNorm is torch's own kernel, the q and k heads
    are normalised and rotated together, and cos/sin come from a table. The projections keep their
    own weight tensors: a matrix product's rounding can depend on where its weight sits in memory
    (alignment), so fusing q, k and v into one matrix would change some logits in the last bit."""

    def __init__(self, model: torch.nn.Module) -> None:
        if model.dtype != torch.float32:
            raise ValueError("Qwen3Forward computes in float32: load the model with dtype=torch.float32")
        cfg = model.config
        self.eps = cfg.rms_norm_eps
        self.hidden = cfg.hidden_size
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        self.heads, self.kv_heads = cfg.num_attention_heads, cfg.num_key_value_heads
        self.scaling = self.head_dim**-0.5
        self.embed = model.model.embed_tokens.weight
        self.norm = model.model.norm.weight
        self.lm_head = model.lm_head.weight
        # cos/sin of every position so far, from the model's own rotary module (a row of the table is
        # the value that module gives for that position alone: tested)
        self._rotary = model.model.rotary_emb
        self._cos = self._sin = torch.zeros(0, self.head_dim, device=self.embed.device)
        self.layers = []
        for layer in model.model.layers:
            a, m = layer.self_attn, layer.mlp
            qk_norm = torch.cat(
                [a.q_norm.weight.detach().expand(self.heads, -1), a.k_norm.weight.detach().expand(self.kv_heads, -1)]
            )
            self.layers.append(
                (
                    layer.input_layernorm.weight,
                    *((p.weight, p.bias) for p in (a.q_proj, a.k_proj, a.v_proj)),
                    qk_norm,
                    (a.o_proj.weight, a.o_proj.bias),
                    layer.post_attention_layernorm.weight,
                    m.gate_proj.weight,
                    m.up_proj.weight,
                    m.down_proj.weight,
                )
            )

    def _rope(self, pos: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        need = int(pos.max()) + 1
        if need > len(self._cos):
            n = max(need, 2 * len(self._cos), 1024)
            cos, sin = self._rotary(self.embed[:1], torch.arange(n, device=self.embed.device)[None])
            self._cos, self._sin = cos[0], sin[0]
        return self._cos[pos].unsqueeze(1), self._sin[pos].unsqueeze(1)

    def _repeat(self, x: torch.Tensor) -> torch.Tensor:
        groups = self.heads // self.kv_heads
        return x if groups == 1 else x.repeat_interleave(groups, dim=1)

    @torch.inference_mode()
    def __call__(self, ids: torch.Tensor, mask: torch.Tensor, pos: torch.Tensor, cache: DynamicCache) -> torch.Tensor:
        h = self._residual(ids, mask, pos, cache)
        return F.linear(F.rms_norm(h[:, -1:], (self.hidden,), self.norm, self.eps), self.lm_head)[:, -1, :]

    @torch.inference_mode()
    def hidden_states(
        self, ids: torch.Tensor, mask: torch.Tensor, pos: torch.Tensor, cache: DynamicCache
    ) -> torch.Tensor:
        """The final (normalised) hidden state of every position: what lm_head turns into each one's logits."""
        return F.rms_norm(self._residual(ids, mask, pos, cache), (self.hidden,), self.norm, self.eps)

    def _residual(self, ids: torch.Tensor, mask: torch.Tensor, pos: torch.Tensor, cache: DynamicCache) -> torch.Tensor:
        b, q = ids.shape
        hq, hk, d, eps = self.heads, self.kv_heads, self.head_dim, self.eps
        h = F.embedding(ids, self.embed)
        cos, sin = self._rope(pos)
        # the additive mask transformers builds for eager attention: causal over the batch's columns and
        # the 2D padding mask; finfo.min, not -inf, so a fully masked (padding) query row stays finite
        k_len = mask.shape[1]
        allowed = mask.bool()[:, None, None, :]
        if q > 1:
            columns = torch.arange(k_len, device=ids.device)
            causal = columns[None, :] <= columns[k_len - q :, None]
            allowed = allowed & causal[None, None]
        bias = torch.where(allowed, torch.tensor(0.0, device=ids.device), torch.finfo(torch.float32).min)
        for i, (norm_in, wq, wk, wv, qk_norm, o, norm_post, gate, up, down) in enumerate(self.layers):
            x = F.rms_norm(h, (self.hidden,), norm_in, eps)
            qk = torch.cat([F.linear(x, *wq).view(b, q, hq, d), F.linear(x, *wk).view(b, q, hk, d)], dim=2)
            qk = (qk_norm * F.rms_norm(qk, (d,), None, eps)).transpose(1, 2)
            qk = qk * cos + _rotate_half(qk) * sin
            ks, vs = cache.update(qk[:, hq:], F.linear(x, *wv).view(b, q, hk, d).transpose(1, 2), i)
            scores = torch.matmul(qk[:, :hq], self._repeat(ks).transpose(2, 3)) * self.scaling + bias
            att = torch.matmul(scores.softmax(dim=-1, dtype=torch.float32), self._repeat(vs))
            h = h + F.linear(att.transpose(1, 2).contiguous().reshape(b, q, -1), *o)
            x = F.rms_norm(h, (self.hidden,), norm_post, eps)
            h = h + F.linear(F.silu(F.linear(x, gate)) * F.linear(x, up), down)
        return h
