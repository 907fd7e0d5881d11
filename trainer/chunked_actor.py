"""OpenRLHF `Actor.forward`'s action log-probs, computed without full-vocabulary logits.

`Actor.forward` (openrlhf/models/actor.py, unpacked path) runs the whole model, casts all logits to
float32 ([B, T, 151,936] at Qwen3's vocabulary: ~5 GB per 8k-token row, kept for backward) and
takes log-probs of the rolled sequence. This wrapper does exactly the same steps — the same position
ids, roll, temperature, `[:, :-1]` and action-mask slicing — but runs the model's body for hidden
states and takes lm_head + logsumexp only at the action positions (action_mask 1: the only ones
whose log-prob is not multiplied by 0), so the PolicyLoss that consumes them, and its gradients, are
unchanged (tested). Those positions go through lm_head in one call when their logits fit
LOGIT_BUDGET (positions × vocabulary), else through `pipeline.logprobs.token_logprobs` in chunks of
that size, each checkpointed: chunking is paid only where the vocabulary needs it (the tiny policy's
1,024 ids: one call; Qwen3's 151,936: 512 positions a chunk).

It applies when the actor wraps a plain transformers model (the local strategy). Under DeepSpeed
the actor's model is an engine whose ZeRO-3 hooks gather weights only inside its own forward, so
there the wrapper calls `Actor.forward` itself.
"""

from __future__ import annotations

import torch
from transformers import PreTrainedModel

from pipeline.logprobs import DEFAULT_CHUNK, _chunk_logprobs, split_causal_lm, token_entropy, token_logprobs

# logits one lm_head call may hold (positions × vocabulary): DEFAULT_CHUNK positions at Qwen3's vocabulary,
# ~311 MB in float32 (what bounds the update's memory at 151,936 ids, benchmarks/bench_scale.py)
LOGIT_BUDGET = DEFAULT_CHUNK * 151_936


def positions_per_call(vocab: int) -> int:
    return max(1, LOGIT_BUDGET // vocab)


def supports_chunking(actor) -> bool:
    return (
        isinstance(actor.model, PreTrainedModel) and not actor.packing_samples and not getattr(actor, "is_vlm", False)
    )


def action_log_probs(
    actor,
    sequences: torch.Tensor,
    action_mask: torch.Tensor,
    attention_mask: torch.Tensor,
    return_entropy: bool = False,
    chunk: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(action log-probs (B, T−1) masked by action_mask, entropy (B, T−1) at the action positions or None), as
    `Actor.forward`. chunk: positions per lm_head call (None: as many as LOGIT_BUDGET allows)."""
    if not supports_chunking(actor):
        logp, out = actor(
            sequences, action_mask, attention_mask=attention_mask, return_output=True, return_entropy=return_entropy
        )
        return logp, (out.entropy if return_entropy else None)
    body, head = split_causal_lm(actor.model)
    position_ids = attention_mask.long().cumsum(-1) - 1
    position_ids.masked_fill_(attention_mask == 0, 1)
    hidden = body(
        input_ids=sequences, attention_mask=attention_mask, position_ids=position_ids, use_cache=False
    ).last_hidden_state  # training keeps no KV cache
    rolled = torch.roll(sequences, shifts=-1, dims=1)
    width = action_mask.shape[1]
    where = action_mask != 0
    h = hidden[:, :-1][:, -width:][where]  # (N, H): the positions whose next token is trained
    targets = rolled[:, :-1][:, -width:][where]
    step = chunk or positions_per_call(head.weight.shape[0])
    if h.shape[0] <= step:  # one call; its logits fit the budget, so backward may keep them
        picked = _chunk_logprobs(h, targets, head, actor.temperature)
    else:
        picked = token_logprobs(h, targets, head, actor.temperature, step)
    log_probs = torch.zeros(action_mask.shape, dtype=torch.float32, device=hidden.device)
    log_probs[where] = picked
    action = log_probs * action_mask.float()
    entropy = None
    if return_entropy:  # a metric: no gradient
        entropy = torch.zeros(action_mask.shape, dtype=torch.float32, device=hidden.device)
        entropy[where] = token_entropy(h, head, actor.temperature, step)
    return action, entropy
