"""A checkpoint's causal LM as every stage loads it (rollout, recompute, update): refused in one line when it
cannot be what the project computes with, before anything is sampled, purified or trained.

- Its weights must be the ones its config.json describes. A config of another architecture (Qwen2's beside
  Qwen3 weights) still loads in transformers, with the missing weights initialised at random and the others
  dropped; the run would then sample from, and train, another model.
- Its logits must be lm_head(hidden): every log-prob here (pipeline/logprobs.py) is computed in chunks from the
  body's hidden states, so a model that caps or scales its logits (Gemma 2) would be scored unlike it samples.
"""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import AutoModelForCausalLM
from transformers.utils import logging as hf_logging

from pipeline.logprobs import logits_transform
from storage.errors import CheckpointError, first_line


def load_causal_lm(
    checkpoint: Path,
    attn_implementation: str,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str | None = None,
) -> torch.nn.Module:
    """The checkpoint's model, its weights and buffers on `device` (None: the CPU)."""
    device = torch.device(device) if isinstance(device, str) else device
    config = Path(checkpoint) / "config.json"
    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()  # its load report (a dozen lines): the one line below says what matters
    try:
        model, info = AutoModelForCausalLM.from_pretrained(
            checkpoint, dtype=dtype, output_loading_info=True, attn_implementation=attn_implementation
        )
    except (ValueError, KeyError, OSError) as e:  # an unknown model_type, a config transformers refuses
        raise CheckpointError(f"{config}: transformers cannot build this model ({first_line(e)})") from None
    finally:
        hf_logging.set_verbosity(verbosity)
    missing, unexpected = sorted(info.get("missing_keys") or []), sorted(info.get("unexpected_keys") or [])
    if missing or unexpected:
        said = "; ".join(
            f"{what} {len(keys)} ({', '.join(keys[:2])}{', …' if len(keys) > 2 else ''})"
            for what, keys in (("missing", missing), ("unexpected", unexpected))
            if keys
        )
        raise CheckpointError(
            f"{config}: its architectures {model.config.architectures} do not fit the weight "
            f"files: {said}; the config is another model's"
        )
    attr = logits_transform(model.config)
    if attr is not None:
        raise CheckpointError(
            f"{config}: {type(model).__name__} transforms its logits ({attr}), and log-probs here "
            "are lm_head(hidden): sampling and training would score tokens differently"
        )
    return model if device is None or device.type == "cpu" else model.to(device)
