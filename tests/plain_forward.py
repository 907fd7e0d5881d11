"""Reference log-probs for tests and benchmarks: one plain forward of a whole sequence, no KV cache and no
chunked prefill, to hold the engines' and the purifier's incremental log-probs against."""

from __future__ import annotations

import torch

from pipeline.logprobs import DEFAULT_CHUNK, split_causal_lm, token_logprobs


def sequence_logprobs(
    model: torch.nn.Module, ids: list[int], start: int = 1, temperature: float = 1.0, chunk: int = DEFAULT_CHUNK
) -> list[float]:
    """log p(ids[k] | ids[:k]) for k in [start, len(ids)) with one body forward and chunked lm_head."""
    body, head = split_causal_lm(model)
    with torch.inference_mode():
        hidden = body(input_ids=torch.tensor([ids])).last_hidden_state[0]
        targets = torch.tensor(ids[start:])
        return token_logprobs(hidden[start - 1 : len(ids) - 1], targets, head, temperature, chunk).tolist()
