"""The optimizer's parameter groups, one rule for every optimizer cleaner builds (the GRPO update and
SFT): weight decay on matrices, none on norms, biases and other 1-D parameters. For the Qwen3-shaped
policies this is the split OpenRLHF's DeepSpeed strategy makes by name (bias, *norm.weight), which is
why the ZeRO update reproduces the local one's weights (tests/test_trainer_deepspeed.py)."""

from __future__ import annotations

import torch


def param_groups(model: torch.nn.Module, weight_decay: float) -> list[dict]:
    decay, no_decay = [], []
    for name, p in model.named_parameters():
        (no_decay if p.ndim < 2 or "norm" in name else decay).append(p)
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
