"""Token log-probs without full-vocabulary logits for whole sequences: the one place that computes them.

At Qwen3's vocabulary (151,936) one float32 logit row is 0.6 MB, so an 8k-token sequence's logits
are ~5 GB per row (and a log_softmax over them doubles it). Everything that needs log-probs of
given tokens (the CPU recompute, the update's policy log-probs, the engine's prefill, the SGLang
contract double) goes through `token_logprobs`: hidden states → lm_head → logsumexp per chunk of
positions, gathering only the target tokens, so at most `chunk` positions' logits exist at once.
Under autograd every chunk is checkpointed: backward recomputes one chunk's logits at a time
instead of keeping all of them for the softmax gradient.

What must hold for a model (checked by `split_causal_lm`): logits = lm_head(final hidden state),
with no logit soft-capping or scaling in between (true of Qwen2/2.5/3, Llama, Mistral).
"""

from __future__ import annotations

from functools import partial

import torch
from torch.utils.checkpoint import checkpoint

DEFAULT_CHUNK = 512  # positions per lm_head call: 512 × 151,936 × 4 B ≈ 311 MB of logits


def logits_transform(config: object) -> str | None:
    """The config attribute by which a model transforms its logits after lm_head (None: it does not)."""
    for attr in ("final_logit_softcapping", "logit_scale", "output_multiplier_scale"):
        if getattr(config, attr, None) not in (None, 1, 1.0):
            return attr
    return None


def split_causal_lm(model: torch.nn.Module) -> tuple[torch.nn.Module, torch.nn.Module]:
    """(body returning final hidden states, lm_head) of a transformers causal LM."""
    attr = logits_transform(getattr(model, "config", None))
    if attr is not None:
        raise ValueError(
            f"{type(model).__name__} transforms its logits ({attr}); chunked log-probs assume logits = lm_head(hidden)"
        )
    head = model.get_output_embeddings()
    body = getattr(model, "base_model", None)
    if head is None or body is None or body is model:
        raise ValueError(f"{type(model).__name__} has no separate body and lm_head")
    return body, head


def _logits(hidden: torch.Tensor, head: torch.nn.Module, temperature: float) -> torch.Tensor:
    logits = head(hidden).float()
    return logits if temperature == 1.0 else logits / temperature


def _chunk_logprobs(
    hidden: torch.Tensor, targets: torch.Tensor, head: torch.nn.Module, temperature: float
) -> torch.Tensor:
    logits = _logits(hidden, head, temperature)
    return logits.gather(-1, targets[:, None])[:, 0] - torch.logsumexp(logits, dim=-1)


def _chunk_entropy(hidden: torch.Tensor, head: torch.nn.Module, temperature: float) -> torch.Tensor:
    logp = torch.log_softmax(_logits(hidden, head, temperature), dim=-1)
    return -(logp.exp() * logp).sum(-1)


def token_logprobs(
    hidden: torch.Tensor,
    targets: torch.Tensor,
    head: torch.nn.Module,
    temperature: float = 1.0,
    chunk: int = DEFAULT_CHUNK,
) -> torch.Tensor:
    """log softmax(head(hidden) / T)[targets] for hidden (..., H) and targets (...): float32, shape (...)."""
    shape = targets.shape
    flat_h = hidden.reshape(-1, hidden.shape[-1])
    flat_t = targets.reshape(-1).long()
    grad = torch.is_grad_enabled() and (flat_h.requires_grad or any(p.requires_grad for p in head.parameters()))
    # under autograd, keep only each chunk's hidden states; backward recomputes its logits
    run = partial(checkpoint, _chunk_logprobs, use_reentrant=False) if grad else _chunk_logprobs
    parts = [
        run(flat_h[a : a + chunk], flat_t[a : a + chunk], head, temperature) for a in range(0, flat_t.numel(), chunk)
    ]
    if not parts:
        return torch.zeros(shape, dtype=torch.float32, device=hidden.device)
    return torch.cat(parts).reshape(shape)


@torch.no_grad()
def token_entropy(
    hidden: torch.Tensor, head: torch.nn.Module, temperature: float = 1.0, chunk: int = DEFAULT_CHUNK
) -> torch.Tensor:
    """Entropy of softmax(head(hidden) / T) per position, chunked like `token_logprobs` (a metric: no grad)."""
    flat_h = hidden.reshape(-1, hidden.shape[-1])
    parts = [_chunk_entropy(flat_h[a : a + chunk], head, temperature) for a in range(0, flat_h.shape[0], chunk)]
    return torch.cat(parts).reshape(hidden.shape[:-1]) if parts else hidden.new_zeros(hidden.shape[:-1])


def score_turn(
    body: torch.nn.Module,
    head: torch.nn.Module,
    context: list[int],
    turn: list[int],
    temperature: float = 1.0,
    chunk_tokens: int = 1024,
    cache=None,
    cached: int = 0,
    hidden_states=None,
) -> list[float]:
    """log π(turn[k] | context, turn[:k]) for every k, at the sampling temperature: a rollback's importance-
    ratio numerator (saar_is). The live loop (CPU engine) and the purifier (CPU recompute) both call this one
    function, so the same weights give them the same numbers. Chunks go through a KV cache: memory is
    bounded at any context length. `cache` may already hold the first `cached` context tokens (the engine's
    kept KV), and `hidden_states(ids, positions, cache)` replace `body` (the engine's own forward)."""
    from transformers import DynamicCache

    seq = list(context) + list(turn)
    cache, out = cache if cache is not None else DynamicCache(), []
    device = head.weight.device  # the model's: every tensor here is made there
    with torch.inference_mode():
        for a in range(cached, len(seq) - 1, chunk_tokens):
            b = min(len(seq) - 1, a + chunk_tokens)
            ids = torch.tensor([seq[a:b]], device=device)
            hidden = (
                hidden_states(ids, torch.arange(a, b, device=device)[None], cache)
                if hidden_states
                else body(input_ids=ids, past_key_values=cache, use_cache=True).last_hidden_state
            )
            lo = max(a, len(context) - 1)  # position lo predicts seq[lo + 1]; the turn starts at len(context)
            if lo < b:
                targets = torch.tensor([seq[lo + 1 : b + 1]], device=device)
                out += token_logprobs(hidden[:, lo - a :], targets, head, temperature)[0].tolist()
    return out
