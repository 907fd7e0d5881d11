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

It applies to a plain transformers model (the local strategy) and to one a DeepSpeed engine wraps. The
engine's call must stay the entry point: ZeRO-3 gathers each submodule's weights in hooks around the
engine's forward, and the engine hooks the forward's outputs to start its backward (gradient
accumulation boundary, ZeRO's reduce buckets). So `serve_through_engine` gives the wrapped model a
forward that, asked with `chunked=`, runs these same steps on its own body and lm_head, inside the
engine's forward. Anything else (packed samples, a vision model) calls `Actor.forward` itself.
"""

from __future__ import annotations

import types
from dataclasses import dataclass

import torch
from transformers import PreTrainedModel

from pipeline.logprobs import DEFAULT_CHUNK, _chunk_logprobs, split_causal_lm, token_entropy, token_logprobs

# logits one lm_head call may hold (positions × vocabulary): DEFAULT_CHUNK positions at Qwen3's vocabulary,
# ~311 MB in float32 (what bounds the update's memory at 151,936 ids, benchmarks/bench_scale.py)
LOGIT_BUDGET = DEFAULT_CHUNK * 151_936


def positions_per_call(vocab: int) -> int:
    return max(1, LOGIT_BUDGET // vocab)


@dataclass(frozen=True)
class ChunkedCall:
    """What a served model's forward needs beside the sequences and the attention mask."""

    action_mask: torch.Tensor
    temperature: float
    return_entropy: bool = False
    chunk: int | None = None


def _wrapped(actor) -> PreTrainedModel | None:
    """The transformers model the actor trains: its own model, or the one its DeepSpeed engine wraps once served."""
    model = actor.model
    if isinstance(model, PreTrainedModel):
        return model
    inner = getattr(model, "module", None)
    if isinstance(inner, PreTrainedModel) and getattr(inner, "serves_chunked_log_probs", False):
        return inner
    return None


def supports_chunking(actor) -> bool:
    return _wrapped(actor) is not None and not actor.packing_samples and not getattr(actor, "is_vlm", False)


def _served_forward(self: PreTrainedModel, *args, chunked: ChunkedCall | None = None, **kwargs):
    if chunked is None:
        return type(self).forward(self, *args, **kwargs)
    return chunked_log_probs(self, *args, chunked=chunked, **kwargs)


def serve_through_engine(model: PreTrainedModel) -> None:
    """Let `model`'s DeepSpeed engine run chunked log-probs in its own forward: `engine(seqs, attention_mask=m,
    chunked=ChunkedCall(...))`. Every other call is the model's own forward. Bound to the instance (a deep copy
    rebinds it to the copy); the flag tells `action_log_probs` the route is there."""
    model.forward = types.MethodType(_served_forward, model)
    model.serves_chunked_log_probs = True


def chunked_log_probs(
    model: PreTrainedModel, sequences: torch.Tensor, attention_mask: torch.Tensor, *, chunked: ChunkedCall
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """`Actor.forward`'s steps on `model`'s body, with lm_head taken only at the action positions."""
    action_mask = chunked.action_mask
    body, head = split_causal_lm(model)
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
    # out_features, not weight.shape: ZeRO-3 leaves a partitioned weight an empty shard outside its module's call
    step = chunked.chunk or positions_per_call(getattr(head, "out_features", None) or head.weight.shape[0])
    if h.shape[0] <= step:  # one call; its logits fit the budget, so backward may keep them
        picked = _chunk_logprobs(h, targets, head, chunked.temperature)
    else:
        picked = token_logprobs(h, targets, head, chunked.temperature, step)
    log_probs = torch.zeros(action_mask.shape, dtype=torch.float32, device=hidden.device)
    log_probs[where] = picked
    action = log_probs * action_mask.float()
    entropy = None
    if chunked.return_entropy:  # a metric: no gradient
        entropy = torch.zeros(action_mask.shape, dtype=torch.float32, device=hidden.device)
        entropy[where] = token_entropy(h, head, chunked.temperature, step)
    return action, entropy


def action_log_probs(
    actor,
    sequences: torch.Tensor,
    action_mask: torch.Tensor,
    attention_mask: torch.Tensor,
    return_entropy: bool = False,
    chunk: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(action log-probs masked by action_mask, entropy at the action positions or None), both shaped like
    action_mask, as `Actor.forward`. chunk: positions per lm_head call (None: as many as LOGIT_BUDGET allows)."""
    if not supports_chunking(actor):
        logp, out = actor(
            sequences, action_mask, attention_mask=attention_mask, return_output=True, return_entropy=return_entropy
        )
        # Actor.forward's entropy covers every position (B, T−1): the action positions' part, like the chunked route
        return logp, (out.entropy[:, -action_mask.shape[1] :] if return_entropy else None)
    call = ChunkedCall(action_mask, actor.temperature, return_entropy, chunk)
    if isinstance(actor.model, PreTrainedModel):
        return chunked_log_probs(actor.model, sequences, attention_mask, chunked=call)
    return actor.model(sequences, attention_mask=attention_mask, chunked=call)  # the engine's forward
