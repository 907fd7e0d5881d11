"""OpenRLHF `Actor.forward`'s action log-probs, computed without full-vocabulary logits.

`Actor.forward` (openrlhf/models/actor.py, unpacked path) runs the whole model, casts all logits to
float32 ([B, T, 151,936] at Qwen3's vocabulary: ~5 GB per 8k-token row, kept for backward) and
takes log-probs of the rolled sequence. This wrapper does exactly the same steps — the same position
ids, roll, temperature, `[:, :-1]` and action-mask slicing — but runs the model's body for hidden
states and `pipeline.logprobs.token_logprobs` (chunked, checkpointed lm_head + logsumexp) for the
log-probs, so the PolicyLoss that consumes them, and its gradients, are unchanged (tested).

It applies when the actor wraps a plain transformers model (the local strategy). Under DeepSpeed
the actor's model is an engine whose ZeRO-3 hooks gather weights only inside its own forward, so
there the wrapper calls `Actor.forward` itself.
"""
from __future__ import annotations

import torch
from transformers import PreTrainedModel

from pipeline.logprobs import DEFAULT_CHUNK, split_causal_lm, token_entropy, token_logprobs


def supports_chunking(actor) -> bool:
    return isinstance(actor.model, PreTrainedModel) and not actor.packing_samples and not getattr(actor, "is_vlm", False)


def action_log_probs(actor, sequences: torch.Tensor, action_mask: torch.Tensor, attention_mask: torch.Tensor,
                     return_entropy: bool = False, chunk: int = DEFAULT_CHUNK) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(action log-probs (B, T−1) masked by action_mask, entropy (B, T−1) or None), as `Actor.forward`."""
    if not supports_chunking(actor):
        logp, out = actor(sequences, action_mask, attention_mask=attention_mask, return_output=True,
                          return_entropy=return_entropy)
        return logp, (out.entropy if return_entropy else None)
    body, head = split_causal_lm(actor.model)
    position_ids = attention_mask.long().cumsum(-1) - 1
    position_ids.masked_fill_(attention_mask == 0, 1)
    hidden = body(input_ids=sequences, attention_mask=attention_mask, position_ids=position_ids).last_hidden_state
    rolled = torch.roll(sequences, shifts=-1, dims=1)
    log_probs = token_logprobs(hidden, rolled, head, actor.temperature, chunk)[:, :-1]
    action = log_probs[:, -action_mask.shape[1]:] * action_mask.float()
    entropy = token_entropy(hidden.detach(), head, actor.temperature, chunk)[:, :-1] if return_entropy else None
    return action, entropy
