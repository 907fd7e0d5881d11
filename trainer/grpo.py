"""The GRPO/DAPO update on OpenRLHF's `Actor` and `PolicyLoss` (docs/saar.md), one process, CPU or one GPU
(train.device: the model, every micro-batch and the optimizer's state live there).

Per mini-batch (whole prompt groups): gradients are accumulated over micro-batches with the loss
normalised by the mini-batch's token count (OpenRLHF's `batch_num_tokens`), so accumulation equals
one big token-mean batch; then grad-clip, AdamW step, warmup schedule step. Progress is saved after
every mini-batch, so an interrupted update resumes to exactly the weights of an uninterrupted one.
"""

from __future__ import annotations

import contextlib
import math
import time
from dataclasses import dataclass, field, fields
from typing import Callable

import torch
from transformers import get_constant_schedule_with_warmup

from pipeline.config import TrainConfig
from storage.errors import CleanerError
from pipeline.trajectory import PurifiedTrajectory
from trainer.batches import MicroBatch, micro_batches, mini_batches, trained_rows
from trainer.chunked_actor import action_log_probs
from trainer.correction import correction_of, policy_loss_kwargs
from trainer.dpo import CallPair, DPOWeights, dpo_weights, pair_rows
from trainer.openrlhf_compat import openrlhf_models
from trainer.optim import param_groups


class UpdateError(CleanerError, RuntimeError):
    """An update that cannot run on its input; nothing is written."""


class DivergedError(UpdateError, FloatingPointError):
    """The loss or the gradient norm is not finite: nothing is committed (one line on the command line)."""

    def __init__(self, what: str) -> None:
        super().__init__(
            f"{what}; no checkpoint written: lower train.lr (or check the purified rows' log-probs) "
            "and run the update again"
        )


# Marks a StepMetrics field each rank measures on its own groups as a sum the ranks add up
# (GRPOUpdate.reduce_metrics). The others are the same on every rank: the step, the global gradient norm, the
# mini-batch's tokens (summed before the loss, which divides by them), ...
SUMMED = {"summed": True}


@dataclass
class StepMetrics:
    step: int
    loss: float = field(metadata=SUMMED)
    clip_ratio: float = field(metadata=SUMMED)
    approx_kl: float = field(metadata=SUMMED)
    grad_norm: float
    entropy: float | None = field(metadata=SUMMED)  # None: not measured (train.log_entropy off), never 0
    tokens: int
    lr: float
    seconds: float
    # train.rollout_correction: share of the mini-batch's trained tokens the correction masked or clipped
    # (OpenRLHF's is_filter_ratio, at the token level; a masked row counts all its tokens), and the mean
    # log(π_behaviour / π_old) over them (OpenRLHF's vllm_kl); None: correction off
    correction_filtered: float | None = field(default=None, metadata=SUMMED)
    behaviour_kl: float | None = field(default=None, metadata=SUMMED)
    # train.use_dpo_on_tool_calls (trainer/dpo.py): mean −log σ(β·Δ) over the mini-batch's tool-call pairs,
    # their number, and the share whose chosen-side weight hit train.dpo_max_adjustment_ratio; None: off
    dpo_loss: float | None = field(default=None, metadata=SUMMED)
    dpo_pairs: int | None = field(default=None, metadata=SUMMED)
    dpo_capped: float | None = field(default=None, metadata=SUMMED)


# The summed metrics in field order: the layout of the one tensor every rank reduces, whatever order a rank
# measured them in.
SUMMED_METRICS = tuple(f.name for f in fields(StepMetrics) if f.metadata.get("summed"))


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


def hyperparameters(optimizer) -> list[dict]:
    """Each param group's settings (lr, weight decay, betas, ...) without its parameters."""
    return [{k: v for k, v in group.items() if k != "params"} for group in optimizer.param_groups]


def keep_configured(optimizer, scheduler, configured: list[dict]) -> None:
    """After a saved state is loaded (the previous iteration's, to continue the AdamW moments and the schedule's
    step): the settings this update's config gives, not the saved ones, which `load_state_dict` restores. A
    changed train.lr or weight_decay applies from the next step, on the schedule's factor at that step."""
    for group, settings in zip(optimizer.param_groups, configured):
        group.update(settings)
    scheduler.base_lrs = [group["initial_lr"] for group in optimizer.param_groups]
    lrs = [base * factor(scheduler.last_epoch) for base, factor in zip(scheduler.base_lrs, scheduler.lr_lambdas)]
    for group, lr in zip(optimizer.param_groups, lrs):
        group["lr"] = lr
    scheduler._last_lr = lrs  # what get_last_lr() reports (the step lines' lr)


def build_optimizer(model: torch.nn.Module, cfg: TrainConfig):
    """AdamW over the model's parameter groups; for weights on CUDA torch's fused kernel (prebuilt in torch: one
    launch per step, nothing compiled at run time), on the CPU torch's default implementation."""
    fused = {"fused": True} if next(model.parameters()).device.type == "cuda" else {}
    opt = torch.optim.AdamW(param_groups(model, cfg.weight_decay), lr=cfg.lr, betas=(0.9, 0.999), **fused)
    return opt, warmup_schedule(opt, cfg)


def make_actor(model: torch.nn.Module, cfg: TrainConfig, temperature: float):
    actor = openrlhf_models().Actor(model, attn_implementation=cfg.attn_implementation)
    actor.packing_samples = False  # not set when Actor wraps a model object
    actor.temperature = temperature
    if cfg.gradient_checkpointing:
        actor.gradient_checkpointing_enable({"use_reentrant": False})
    return actor


def policy_loss(cfg: TrainConfig):
    """OpenRLHF's PolicyLoss: clip-higher, dual-clip, token-level mean; with train.rollout_correction its IS
    gate over π_old / π_behaviour (trainer/correction.py)."""
    return openrlhf_models().PolicyLoss(
        clip_eps_low=cfg.clip_eps_low,
        clip_eps_high=cfg.clip_eps_high,
        dual_clip=cfg.dual_clip,
        token_level_loss=cfg.loss_agg == "token_mean",
        policy_loss_type=cfg.policy_loss_type,
        **policy_loss_kwargs(cfg),
    )


def filtered_tokens(loss_fn, logp: torch.Tensor, m, is_filter_ratio: torch.Tensor) -> float:
    """How many of micro-batch m's trained tokens the correction masked or clipped, from PolicyLoss's own
    is_filter_ratio: at the token level that is already a share of the tokens; at the sequence level it is
    a share of the rows, so each row is asked alone (detached, no gradient) and counted by its tokens."""
    if loss_fn.is_correction_level == "token":
        return float(is_filter_ratio) * m.num_actions
    with torch.no_grad():
        total = 0.0
        for i in range(m.sequences.shape[0]):
            row = slice(i, i + 1)
            *_, flagged = loss_fn(
                logp[row].detach(),
                m.old_log_probs[row],
                m.advantages[row],
                action_mask=m.action_mask[row],
                rollout_log_probs=m.rollout_log_probs[row],
            )
            total += float(flagged) * float(m.action_mask[row].sum())
    return total


class GRPOUpdate:
    """The local strategy: every group of a mini-batch is trained in this process.

    A distributed strategy overrides the hooks below (`prepare`, `my_groups`, `reduce`, `backward`, `step`);
    the loss, its token-mean over the whole mini-batch and the metrics stay the same.
    """

    world_size = 1
    # (micro-batches done, micro-batches in the mini-batch), after each backward: the stage's progress
    on_micro_batch: Callable[[int, int], None] | None = None

    def __init__(
        self, model: torch.nn.Module, cfg: TrainConfig, temperature: float = 1.0, device: torch.device | None = None
    ) -> None:
        """`device`: where the model is and every micro-batch is made (None: where the model's weights are)."""
        self.cfg = cfg
        self.device = device if device is not None else next(model.parameters()).device
        self.loss_fn = policy_loss(cfg)
        self.seq_mean = cfg.loss_agg == "seq_mean"
        self.correction = correction_of(cfg)
        self.dpo_pairs: dict[str, list[CallPair]] = {}
        self.global_step = 0
        self.prepare(model, make_actor(model, cfg, temperature))

    # -- strategy hooks -------------------------------------------------------------------------
    def prepare(self, model: torch.nn.Module, actor) -> None:
        """The model, actor, optimizer and schedule this strategy trains."""
        self.model, self.actor = model, actor
        self.optimizer, self.scheduler = build_optimizer(model, self.cfg)
        self.configured = hyperparameters(self.optimizer)

    def autocast(self):
        """The forward's precision: train.param_dtype=bf16 on this strategy is torch.autocast to bfloat16 over
        float32 weights (their gradients and AdamW's moments stay float32); fp32 computes as it is."""
        if self.cfg.param_dtype != "bf16":
            return contextlib.nullcontext()
        return torch.autocast(device_type=self.device.type, dtype=torch.bfloat16)

    def my_groups(self, groups: list[list[PurifiedTrajectory]]) -> list[list[PurifiedTrajectory]]:
        return groups

    def reduce(self, values: list[float]) -> list[float]:
        """Sum per-rank values over the ranks."""
        return values

    def reduce_metrics(self, sums: dict[str, float]) -> dict[str, float]:
        """This rank's sums of every summed StepMetrics field, by name, added up over the ranks in one reduce."""
        if sums.keys() != set(SUMMED_METRICS):  # a sum left out of the reduce would be this rank's alone
            raise ValueError(f"the summed metrics are {SUMMED_METRICS}, not {tuple(sums)}")
        return dict(zip(SUMMED_METRICS, self.reduce([sums[name] for name in SUMMED_METRICS])))

    def most(self, n: int) -> int:
        """The largest n over the ranks: how many forwards every rank makes (ZeRO-3 gathers weights in each)."""
        return n

    def zero_grad(self) -> None:
        self.optimizer.zero_grad(set_to_none=True)

    def backward(self, loss: torch.Tensor, last: bool) -> None:
        loss.backward()

    def step(self) -> float:
        """Clip, step optimizer and schedule; returns the pre-clip gradient norm."""
        grad_norm = float(torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.cfg.grad_clip))
        if not math.isfinite(grad_norm):
            raise DivergedError(f"gradient norm is {grad_norm} at optimizer step {self.global_step}")
        self.optimizer.step()
        self.scheduler.step()
        return grad_norm

    def state_dict(self) -> dict:
        return {
            "optimizer": self.optimizer.state_dict(),
            "scheduler": self.scheduler.state_dict(),
            "global_step": self.global_step,
        }

    def load_state_dict(self, state: dict) -> None:
        self.optimizer.load_state_dict(state["optimizer"])
        load_schedule_state(self.scheduler, state["scheduler"], state["global_step"])
        keep_configured(self.optimizer, self.scheduler, self.configured)
        self.global_step = state["global_step"]

    def set_dpo_pairs(self, pairs: list[CallPair]) -> None:
        """The tool-call pairs of train.use_dpo_on_tool_calls, trained with their prompt group's mini-batch."""
        self.dpo_pairs = {}
        for p in pairs:
            self.dpo_pairs.setdefault(p.prompt_id, []).append(p)

    def dpo_batches(
        self, groups: list[list[PurifiedTrajectory]], pad_id: int, spare: MicroBatch
    ) -> tuple[list, torch.Tensor, DPOWeights]:
        """The micro-batches of these groups' pairs (trainer/dpo.py), each row's side-loss weight (−c for a
        chosen call, +c' for a rejected one, by the row's index 2·pair + side), and the weights' summary: one
        forward without gradient scores every pair's calls with the current policy. Padded with `spare`
        emptied to as many micro-batches as the rank with the most has."""
        pairs = [p for g in groups for p in self.dpo_pairs.get(g[0].prompt_id, [])]
        micros = micro_batches([pair_rows(pairs)], self.cfg.micro_batch_tokens, pad_id, self.device) if pairs else []
        micros += [emptied(spare)] * (self.most(len(micros)) - len(micros))
        sums, counts = torch.zeros(2 * len(pairs), device=self.device), torch.zeros(2 * len(pairs), device=self.device)
        with torch.no_grad():
            for m in micros:
                with self.autocast():
                    logp, _ = action_log_probs(self.actor, m.sequences, m.action_mask, m.attention_mask)
                if m.rows:
                    at = _pair_index(m.rows, self.device)
                    sums[at], counts[at] = logp.sum(-1), m.action_mask.sum(-1)
        counts = counts.clamp(min=1)
        w = dpo_weights(
            sums[0::2] / counts[0::2],
            sums[1::2] / counts[1::2],
            counts[0::2],
            counts[1::2],
            self.cfg.dpo_beta,
            self.cfg.dpo_max_adjustment_ratio,
        )
        return micros, torch.stack([-w.chosen, w.rejected], 1).reshape(-1), w

    def minibatch(self, groups: list[list[PurifiedTrajectory]], pad_id: int) -> StepMetrics:
        t0 = time.perf_counter()
        self.model.train()
        mine = self.my_groups(groups)
        micros = micro_batches(trained_rows(mine), self.cfg.micro_batch_tokens, pad_id, self.device)
        # every rank makes as many forwards as the one with the most micro-batches (an emptied one adds 0)
        micros += [emptied(micros[-1])] * (self.most(len(micros)) - len(micros))
        # the loss is a token mean over the whole mini-batch, whichever rank holds which groups
        # (train.loss_agg=seq_mean: a mean over the mini-batch's trained rows, whichever rank holds them)
        tokens, rows = (
            int(v)
            for v in self.reduce(
                [
                    float(sum(m.num_actions for m in micros)),
                    float(sum(int((m.action_mask.sum(-1) > 0).sum()) for m in micros)),
                ]
            )
        )
        self.zero_grad()
        dpo_micros, dpo_coef, dpo = (
            self.dpo_batches(mine, pad_id, micros[-1]) if self.cfg.use_dpo_on_tool_calls else ([], None, None)
        )
        backwards = len(micros) + len(dpo_micros)
        sums = dict.fromkeys(SUMMED_METRICS, 0.0)  # this rank's share of each, reduced by name below
        for i, m in enumerate(micros):
            # Actor.forward's log-probs without its full-vocabulary logits (trainer/chunked_actor.py)
            with self.autocast():
                logp, entropy = action_log_probs(
                    self.actor, m.sequences, m.action_mask, m.attention_mask, return_entropy=self.cfg.log_entropy
                )
            if self.correction is not None and m.rollout_log_probs is None:
                raise UpdateError(
                    f"train.rollout_correction={self.cfg.rollout_correction} needs the rows' "
                    f"behaviour_logprobs, which rows {m.rows[:3]} do not have (purified schema "
                    f"version 1); re-purify the iteration with this cleaner"
                )
            # PolicyLoss reads rollout_log_probs only when its correction is on
            loss, clip_ratio, ppo_kl, vllm_kl, is_filter = self.loss_fn(
                logp,
                m.old_log_probs,
                m.advantages,
                action_mask=m.action_mask,
                rollout_log_probs=m.rollout_log_probs,
                batch_num_tokens=max(1, tokens),
                global_batch_size=max(1, rows) if self.seq_mean else None,
                dp_size=self.world_size,
            )
            if self.correction is not None and m.num_actions:  # an emptied micro-batch's ratios are 0/0
                sums["correction_filtered"] += filtered_tokens(self.loss_fn, logp, m, is_filter)
                sums["behaviour_kl"] += float(vllm_kl) * m.num_actions
            if not torch.isfinite(loss):
                raise DivergedError(
                    f"policy loss is {loss.item()} at optimizer step {self.global_step} (rows {m.rows[:3]}...)"
                )
            self.backward(loss, last=i == backwards - 1)
            self._micro_batch_done(i + 1, backwards)
            if not m.num_actions:
                continue  # emptied (a rank with fewer micro-batches): it adds 0, and its means are 0/0
            share = m.num_actions / max(1, tokens)
            sums["loss"] += loss.item() / self.world_size  # undo dp_size: the sum over ranks is the mini-batch loss
            sums["clip_ratio"] += clip_ratio.item() * share
            sums["approx_kl"] += ppo_kl.item() * share
            if self.cfg.log_entropy:
                sums["entropy"] += float((entropy.detach() * m.action_mask).sum() / max(1, m.num_actions)) * share
        for i, m in enumerate(dpo_micros, start=len(micros)):  # the side loss, normalised like the policy loss
            with self.autocast():
                logp, _ = action_log_probs(self.actor, m.sequences, m.action_mask, m.attention_mask)
            # an emptied micro-batch adds 0
            weight = (
                dpo_coef[_pair_index(m.rows, self.device)] if m.rows else torch.zeros(logp.shape[0], device=self.device)
            )
            side = (weight * logp.sum(-1)).sum() / max(1, tokens) * self.world_size
            self.backward(side, last=i == backwards - 1)
            self._micro_batch_done(i + 1, backwards)
        if dpo:  # means over this rank's pairs, as sums: the ranks' totals are then divided by all their pairs
            n_pairs = len(dpo_coef) // 2
            sums["dpo_loss"] = dpo.loss * n_pairs
            sums["dpo_pairs"] = float(n_pairs)
            sums["dpo_capped"] = dpo.capped * n_pairs
        sums = self.reduce_metrics(sums)
        lr = self.scheduler.get_last_lr()[0]
        grad_norm = self.step()
        self.global_step += 1
        self.model.eval()
        corrected, dpo_on = self.correction is not None, self.cfg.use_dpo_on_tool_calls
        return StepMetrics(
            step=self.global_step,
            loss=sums["loss"],
            clip_ratio=sums["clip_ratio"],
            approx_kl=sums["approx_kl"],
            grad_norm=grad_norm,
            entropy=sums["entropy"] if self.cfg.log_entropy else None,
            tokens=tokens,
            lr=lr,
            seconds=time.perf_counter() - t0,
            correction_filtered=sums["correction_filtered"] / max(1, tokens) if corrected else None,
            behaviour_kl=sums["behaviour_kl"] / max(1, tokens) if corrected else None,
            dpo_loss=sums["dpo_loss"] / max(1, sums["dpo_pairs"]) if dpo_on else None,
            dpo_pairs=int(sums["dpo_pairs"]) if dpo_on else None,
            dpo_capped=sums["dpo_capped"] / max(1, sums["dpo_pairs"]) if dpo_on else None,
        )

    def _micro_batch_done(self, done: int, total: int) -> None:
        if self.on_micro_batch is not None:
            self.on_micro_batch(done, total)

    def run(
        self,
        rows: list[PurifiedTrajectory],
        pad_id: int,
        progress: UpdateProgress,
        after_minibatch: Callable[[UpdateProgress], None] | None = None,
        stop_after: int | None = None,
    ) -> UpdateProgress:
        torch.manual_seed(self.cfg.seed)
        schedule = [mb for _ in range(self.cfg.epochs) for mb in mini_batches(rows, self.cfg.mini_batches)]
        done = progress.minibatches_done  # before an interruption
        for k, groups in enumerate(schedule[done:stop_after], start=done):
            progress.metrics.append(self.minibatch(groups, pad_id))
            progress.minibatches_done = k + 1
            if after_minibatch:
                after_minibatch(progress)
        return progress


def emptied(m: MicroBatch) -> MicroBatch:
    """m with nothing to train (no action token, no row): a forward and backward that add 0, so that every
    rank makes the same number of them (trainer/deepspeed_update.py)."""
    zero = torch.zeros_like(m.action_mask)
    return MicroBatch(
        sequences=m.sequences,
        attention_mask=m.attention_mask,
        action_mask=zero,
        old_log_probs=zero,
        advantages=zero,
        rows=[],
        rollout_log_probs=None if m.rollout_log_probs is None else zero,
    )


def _pair_index(keys: list[str], device: torch.device) -> torch.Tensor:
    """Row index 2·pair + side of trainer.dpo.pair_rows' keys `i/chosen`, `i/rejected`."""
    return torch.tensor([2 * int(k.split("/")[0]) + (k.endswith("/rejected")) for k in keys], device=device)


def total_minibatches(rows: list[PurifiedTrajectory], cfg: TrainConfig) -> int:
    return cfg.epochs * len(mini_batches(rows, cfg.mini_batches))
