"""Supervised fine-tuning on (token ids, loss mask) pairs: how the tiny bootstrap policy is trained.

Loss only on mask-1 (assistant) tokens. Many small optimizer steps on one torch thread: on this 2-core
machine that is what makes the copy skill appear (measured on the bootstrap task: in the same 10 minutes,
batch 8 reached 93% accuracy and batch 16 none — copying operands into the code appears only after
~1.5–2.5k steps); the schedule warms up, holds, and only decays over the last part of training so it does
not kill that late jump.
"""

from __future__ import annotations

import math
import random
import time
from dataclasses import dataclass, field
from typing import Callable

import torch

from storage.errors import CleanerError
from trainer.optim import param_groups


@dataclass
class SFTConfig:
    steps: int = 3000
    batch_size: int = 8
    lr: float = 3e-3
    warmup_steps: int = 100
    decay_fraction: float = 0.2  # linear decay to 10% over the last part of training
    weight_decay: float = 0.01
    grad_clip: float = 1.0
    seed: int = 0
    threads: int = 1
    log_every: int = 100


@dataclass
class SFTResult:
    losses: list[tuple[int, float]] = field(default_factory=list)
    wall_s: float = 0.0
    tokens: int = 0

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.wall_s if self.wall_s else 0.0


def lr_factor(step: int, cfg: SFTConfig) -> float:
    """Warm up ((step+1)/warmup_steps), hold, then decay linearly to 10%. Kept hand-written: the nearest
    library schedule, transformers' warmup-stable-decay with min_lr_ratio=0.1, also lifts the warmup to
    start at 10% and computes the decay as (1-p)*0.9+0.1, which differs from 1-0.9p in the last bit at
    258 of the 600 decay steps of the bootstrap, so the committed policy could not be rebuilt exactly."""
    if step < cfg.warmup_steps:
        return (step + 1) / cfg.warmup_steps
    decay_start = int(cfg.steps * (1 - cfg.decay_fraction))
    if step < decay_start:
        return 1.0
    return 1.0 - 0.9 * (step - decay_start) / max(1, cfg.steps - decay_start)


def collate(examples: list[tuple[list[int], list[int]]], pad_id: int) -> dict[str, torch.Tensor]:
    width = max(len(ids) for ids, _ in examples)
    input_ids = torch.full((len(examples), width), pad_id, dtype=torch.long)
    attention = torch.zeros((len(examples), width), dtype=torch.long)
    labels = torch.full((len(examples), width), -100, dtype=torch.long)
    for i, (ids, mask) in enumerate(examples):
        n = len(ids)
        input_ids[i, :n] = torch.tensor(ids)
        attention[i, :n] = 1
        m = torch.tensor(mask, dtype=torch.bool)
        labels[i, :n] = torch.where(m, torch.tensor(ids), torch.tensor(-100))
    return {"input_ids": input_ids, "attention_mask": attention, "labels": labels}


def train_sft(
    model: torch.nn.Module,
    data: list[tuple[list[int], list[int]]],
    pad_id: int,
    cfg: SFTConfig,
    progress: Callable[[int, float], None] | None = None,
) -> SFTResult:
    torch.set_num_threads(cfg.threads)
    torch.manual_seed(cfg.seed)
    rng = random.Random(cfg.seed)
    opt = torch.optim.AdamW(param_groups(model, cfg.weight_decay), lr=cfg.lr, betas=(0.9, 0.95))
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: lr_factor(s, cfg))
    model.train()
    result = SFTResult()
    order: list[int] = []
    running = None
    t0 = time.perf_counter()
    if len(data) < cfg.batch_size:  # else an IndexError at the first step
        raise CleanerError(f"{len(data)} SFT examples cannot fill one batch of {cfg.batch_size}: give a larger corpus")
    for step in range(cfg.steps):
        if len(order) < cfg.batch_size:
            order = list(range(len(data)))
            rng.shuffle(order)
        batch = collate([data[order.pop()] for _ in range(cfg.batch_size)], pad_id)
        loss = model(**batch).loss
        if not math.isfinite(loss.item()):
            raise FloatingPointError(f"SFT loss became {loss.item()} at step {step}")
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
        opt.step()
        sched.step()
        result.tokens += int(batch["attention_mask"].sum())
        running = loss.item() if running is None else 0.98 * running + 0.02 * loss.item()
        if step % cfg.log_every == 0 or step == cfg.steps - 1:
            result.losses.append((step, running))
            if progress:
                progress(step, running)
    result.wall_s = time.perf_counter() - t0
    model.eval()
    return result
