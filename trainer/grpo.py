"""The GRPO/DAPO update on OpenRLHF's `Actor` and `PolicyLoss` (docs/saar.md), one process, CPU or one GPU.

Per mini-batch (whole prompt groups): gradients are accumulated over micro-batches with the loss
normalised by the mini-batch's token count (OpenRLHF's `batch_num_tokens`), so accumulation equals
one big token-mean batch; then grad-clip, AdamW step, warmup schedule step. Progress is saved after
every mini-batch, so an interrupted update resumes to exactly the weights of an uninterrupted one.
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Callable

import torch
from transformers import get_constant_schedule_with_warmup

from pipeline.config import TrainConfig
from storage.errors import CleanerError
from pipeline.trajectory import PurifiedTrajectory
from trainer.batches import micro_batches, mini_batches
from trainer.chunked_actor import action_log_probs
from trainer.openrlhf_compat import openrlhf_models
from trainer.optim import param_groups


class UpdateError(CleanerError, RuntimeError):
    """An update that cannot run on its input; nothing is written."""


@dataclass
class StepMetrics:
    step: int
    loss: float
    clip_ratio: float
    approx_kl: float
    grad_norm: float
    entropy: float | None  # None: not measured (train.log_entropy off), never 0
    tokens: int
    lr: float
    seconds: float


@dataclass
class UpdateProgress:
    minibatches_done: int = 0
    metrics: list[StepMetrics] = field(default_factory=list)


def warmup_schedule(optimizer, cfg: TrainConfig) -> torch.optim.lr_scheduler.LambdaLR:
    """Linear warmup over cfg.warmup_steps, then constant, the same under every strategy: optimizer
    step s (0-based) runs at lr * min(1, (s + 1) / warmup_steps) (at lr when warmup_steps is 0 or 1).

    transformers' constant-with-warmup schedule gives its step t the factor t / warmup_steps, whose
    first step would run at lr 0, so it is started one step in (`last_epoch=0`): its counter is
    always global_step + 1 (`load_schedule_state` relies on that)."""
    for group in optimizer.param_groups:
        group.setdefault("initial_lr", group["lr"])  # what torch requires of a schedule that does not start at -1
    return get_constant_schedule_with_warmup(optimizer, cfg.warmup_steps, last_epoch=0)


def load_schedule_state(scheduler, state: dict, global_step: int) -> None:
    """Load a schedule's state; one saved before the schedule was transformers' counted steps done
    (last_epoch == global_step), not global_step + 1, and is moved on by one so the LR stays exact."""
    state = dict(state)
    if state.get("last_epoch") == global_step:
        state["last_epoch"] = global_step + 1
    scheduler.load_state_dict(state)


def build_optimizer(model: torch.nn.Module, cfg: TrainConfig):
    opt = torch.optim.AdamW(param_groups(model, cfg.weight_decay), lr=cfg.lr, betas=(0.9, 0.999))
    return opt, warmup_schedule(opt, cfg)


def make_actor(model: torch.nn.Module, temperature: float):
    actor = openrlhf_models().Actor(model, attn_implementation="eager")
    actor.packing_samples = False  # not set when Actor wraps a model object
    actor.temperature = temperature
    return actor


def policy_loss(cfg: TrainConfig):
    """OpenRLHF's PolicyLoss: clip-higher, dual-clip, token-level mean."""
    return openrlhf_models().PolicyLoss(clip_eps_low=cfg.clip_eps_low, clip_eps_high=cfg.clip_eps_high,
                                        dual_clip=cfg.dual_clip, token_level_loss=True,
                                        policy_loss_type=cfg.policy_loss_type)


class GRPOUpdate:
    """The local strategy: every group of a mini-batch is trained in this process.

    A distributed strategy overrides the hooks below (`my_groups`, `reduce`, `backward`, `step`);
    the loss, its token-mean over the whole mini-batch and the metrics stay the same.
    """

    world_size = 1

    def __init__(self, model: torch.nn.Module, cfg: TrainConfig, temperature: float = 1.0) -> None:
        self.cfg = cfg
        self.model = model
        self.actor = make_actor(model, temperature)
        self.loss_fn = policy_loss(cfg)
        self.optimizer, self.scheduler = build_optimizer(model, cfg)
        self.global_step = 0

    # -- strategy hooks -------------------------------------------------------------------------
    def my_groups(self, groups: list[list[PurifiedTrajectory]]) -> list[list[PurifiedTrajectory]]:
        return groups

    def reduce(self, values: list[float]) -> list[float]:
        """Sum per-rank values over the ranks."""
        return values

    def zero_grad(self) -> None:
        self.optimizer.zero_grad(set_to_none=True)

    def backward(self, loss: torch.Tensor, last: bool) -> None:
        loss.backward()

    def step(self) -> float:
        """Clip, step optimizer and schedule; returns the pre-clip gradient norm."""
        grad_norm = float(torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.cfg.grad_clip))
        if not math.isfinite(grad_norm):
            raise FloatingPointError(f"gradient norm is {grad_norm} at optimizer step {self.global_step}")
        self.optimizer.step()
        self.scheduler.step()
        return grad_norm

    def state_dict(self) -> dict:
        return {"optimizer": self.optimizer.state_dict(), "scheduler": self.scheduler.state_dict(),
                "global_step": self.global_step}

    def load_state_dict(self, state: dict) -> None:
        self.optimizer.load_state_dict(state["optimizer"])
        load_schedule_state(self.scheduler, state["scheduler"], state["global_step"])
        self.global_step = state["global_step"]

    def minibatch(self, groups: list[list[PurifiedTrajectory]], pad_id: int) -> StepMetrics:
        t0 = time.perf_counter()
        self.model.train()
        micros = micro_batches(self.my_groups(groups), self.cfg.micro_batch_tokens, pad_id)
        # the loss is a token mean over the whole mini-batch, whichever rank holds which groups
        tokens = int(self.reduce([float(sum(m.num_actions for m in micros))])[0])
        self.zero_grad()
        loss_sum = clip = kl = ent = 0.0
        for i, m in enumerate(micros):
            # Actor.forward's log-probs without its full-vocabulary logits (trainer/chunked_actor.py)
            logp, entropy = action_log_probs(self.actor, m.sequences, m.action_mask, m.attention_mask,
                                             return_entropy=self.cfg.log_entropy)
            loss, clip_ratio, ppo_kl, _, _ = self.loss_fn(logp, m.old_log_probs, m.advantages, action_mask=m.action_mask,
                                                          batch_num_tokens=max(1, tokens), dp_size=self.world_size)
            if not torch.isfinite(loss):
                raise FloatingPointError(f"policy loss is {loss.item()} at optimizer step {self.global_step} "
                                         f"(rows {m.rows[:3]}...); no checkpoint written")
            self.backward(loss, last=i == len(micros) - 1)
            share = m.num_actions / max(1, tokens)
            loss_sum += loss.item() / self.world_size  # undo dp_size: the sum over ranks is the mini-batch loss
            clip += clip_ratio.item() * share
            kl += ppo_kl.item() * share
            if self.cfg.log_entropy:
                ent += float((entropy.detach() * m.action_mask).sum() / max(1, m.num_actions)) * share
        loss_sum, clip, kl, ent = self.reduce([loss_sum, clip, kl, ent])
        lr = self.scheduler.get_last_lr()[0]
        grad_norm = self.step()
        self.global_step += 1
        self.model.eval()
        return StepMetrics(self.global_step, loss_sum, clip, kl, grad_norm, ent if self.cfg.log_entropy else None,
                           tokens, lr, time.perf_counter() - t0)

    def run(self, rows: list[PurifiedTrajectory], pad_id: int, progress: UpdateProgress,
            after_minibatch: Callable[[UpdateProgress], None] | None = None, stop_after: int | None = None) -> UpdateProgress:
        torch.manual_seed(self.cfg.seed)
        schedule = [mb for _ in range(self.cfg.epochs) for mb in mini_batches(rows, self.cfg.mini_batches)]
        for k, groups in enumerate(schedule):
            if k < progress.minibatches_done:
                continue  # done before an interruption
            if stop_after is not None and k >= stop_after:
                break
            progress.metrics.append(self.minibatch(groups, pad_id))
            progress.minibatches_done = k + 1
            if after_minibatch:
                after_minibatch(progress)
        return progress


def total_minibatches(rows: list[PurifiedTrajectory], cfg: TrainConfig) -> int:
    return cfg.epochs * len(mini_batches(rows, cfg.mini_batches))
