"""The GRPO warmup schedule is transformers' constant-with-warmup schedule and gives every optimizer
step exactly the LR of the documented rule, lr * min(1, (s + 1) / warmup_steps) for step s (0-based),
under the local strategy, across a save/load (resume) and from a state saved by the earlier
hand-written LambdaLR (whose counter was the number of steps done)."""

from __future__ import annotations

import pytest
import torch

from pipeline.config import TrainConfig
from trainer.grpo import GRPOUpdate, load_schedule_state, warmup_schedule

CONFIGS = [(0, 1e-4), (1, 1e-4), (2, 1e-4), (3, 3e-4), (5, 2e-6), (20, 2e-6), (7, 1e-3)]


def rule(step: int, lr: float, warmup: int) -> float:
    """The documented rule, written out here: linear warmup that reaches lr at step warmup-1."""
    if warmup <= 1:
        return lr
    return lr * min(1.0, (step + 1) / warmup)


def _optimizer(lr: float) -> torch.optim.Optimizer:
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(3, 3)), torch.nn.Parameter(torch.randn(3))]
    return torch.optim.AdamW(
        [{"params": params[:1], "weight_decay": 0.01}, {"params": params[1:], "weight_decay": 0.0}], lr=lr
    )


def _lrs(optimizer, scheduler, steps: int) -> list[list[float]]:
    out = []
    for _ in range(steps):
        out.append([g["lr"] for g in optimizer.param_groups])  # what optimizer.step() uses
        optimizer.step()
        scheduler.step()
    return out


@pytest.mark.parametrize("warmup,lr", CONFIGS)
def test_every_step_runs_at_the_documented_lr(warmup, lr):
    opt = _optimizer(lr)
    sched = warmup_schedule(opt, TrainConfig(lr=lr, warmup_steps=warmup))
    assert type(sched).__module__ == "torch.optim.lr_scheduler"  # a LambdaLR built by transformers
    got = _lrs(opt, sched, warmup + 6)
    want = [[rule(s, lr, warmup)] * 2 for s in range(warmup + 6)]
    assert got == want  # exact, not approximate
    if warmup >= 2:
        assert got[0][0] == lr * (1 / warmup) > 0 and got[warmup - 1][0] == lr  # never a step at lr 0


@pytest.mark.parametrize("warmup,lr", [(5, 2e-6), (3, 3e-4), (0, 1e-4)])
def test_resume_mid_warmup_continues_the_same_sequence(warmup, lr):
    cfg = TrainConfig(lr=lr, warmup_steps=warmup)
    straight_opt = _optimizer(lr)
    straight = _lrs(straight_opt, warmup_schedule(straight_opt, cfg), 10)
    for k in (1, 2, 4):
        opt = _optimizer(lr)
        sched = warmup_schedule(opt, cfg)
        first = _lrs(opt, sched, k)
        saved = {"optimizer": opt.state_dict(), "scheduler": sched.state_dict()}
        opt2 = _optimizer(lr)
        sched2 = warmup_schedule(opt2, cfg)
        opt2.load_state_dict(saved["optimizer"])
        load_schedule_state(sched2, saved["scheduler"], global_step=k)
        assert first + _lrs(opt2, sched2, 10 - k) == straight


def test_a_state_saved_by_the_old_hand_written_schedule_resumes_exactly():
    """trainer_state.pt files written before this schedule hold a LambdaLR whose last_epoch was the number
    of steps done; loading one must continue with the LR the old code would have used."""
    lr, warmup = 3e-4, 5
    cfg = TrainConfig(lr=lr, warmup_steps=warmup)
    for k in (1, 3, 7):
        old_opt = _optimizer(lr)
        old = torch.optim.lr_scheduler.LambdaLR(old_opt, lambda s: min(1.0, (s + 1) / warmup))
        _lrs(old_opt, old, k)
        assert old.state_dict()["last_epoch"] == k
        opt = _optimizer(lr)
        sched = warmup_schedule(opt, cfg)
        opt.load_state_dict(old_opt.state_dict())
        load_schedule_state(sched, old.state_dict(), global_step=k)
        assert _lrs(opt, sched, 6) == [[rule(s, lr, warmup)] * 2 for s in range(k, k + 6)]


def test_grpo_update_state_round_trip_keeps_the_schedule():
    """GRPOUpdate.state_dict/load_state_dict (what trainer_state.pt and the partial file hold)."""
    lr, warmup = 1e-3, 4
    cfg = TrainConfig(lr=lr, warmup_steps=warmup)
    model = torch.nn.Sequential(torch.nn.Linear(3, 3), torch.nn.LayerNorm(3))
    a = GRPOUpdate.__new__(GRPOUpdate)  # the optimizer/schedule half of the update, without an Actor
    a.cfg, a.model, a.global_step = cfg, model, 0
    a.prepare(model, actor=None)  # the optimizer and schedule the local strategy builds
    seen = []
    for _ in range(2):
        seen.append(a.scheduler.get_last_lr()[0])
        model(torch.ones(1, 3)).sum().backward()
        a.step()
        a.global_step += 1
    b = GRPOUpdate.__new__(GRPOUpdate)
    b.cfg, b.model, b.global_step = cfg, model, 0
    b.prepare(model, actor=None)
    b.load_state_dict(a.state_dict())
    for _ in range(4):
        seen.append(b.scheduler.get_last_lr()[0])
        model(torch.ones(1, 3)).sum().backward()
        b.step()
        b.global_step += 1
    assert seen == [rule(s, lr, warmup) for s in range(6)]


@pytest.mark.parametrize("warmup", [0, 4])
def test_the_configured_lr_and_weight_decay_apply_after_a_saved_state_is_loaded(warmup):
    """The next iteration's update loads the previous one's state (AdamW moments, the schedule's step); its own
    train.lr and weight_decay apply from there. Before, load_state_dict restored the saved ones: an update run with
    train.lr=1e-1 wrote the same checkpoint, byte for byte, as one with train.lr=1e-7."""
    from transformers import AutoModelForCausalLM

    from pipeline.config import DEFAULT_POLICY

    def update(cfg: TrainConfig) -> GRPOUpdate:
        return GRPOUpdate(
            AutoModelForCausalLM.from_pretrained(DEFAULT_POLICY, dtype=torch.float32, attn_implementation="eager"), cfg
        )

    first = update(TrainConfig(lr=1e-4, warmup_steps=warmup, weight_decay=0.01))
    for _ in range(2):  # two optimizer steps (no gradient: the state still counts them)
        first.optimizer.step()
        first.scheduler.step()
        first.global_step += 1
    saved = first.state_dict()
    same = update(TrainConfig(lr=1e-4, warmup_steps=warmup, weight_decay=0.01))
    same.load_state_dict(saved)
    assert [g["lr"] for g in same.optimizer.param_groups] == [g["lr"] for g in first.optimizer.param_groups]
    assert same.scheduler.get_last_lr() == first.scheduler.get_last_lr()
    changed = update(TrainConfig(lr=3e-2, warmup_steps=warmup, weight_decay=0.2))
    changed.load_state_dict(saved)
    want = rule(2, 3e-2, warmup)
    assert [g["lr"] for g in changed.optimizer.param_groups] == [want] * len(changed.optimizer.param_groups)
    assert changed.scheduler.get_last_lr() == [want] * len(changed.optimizer.param_groups)
    assert sorted({g["weight_decay"] for g in changed.optimizer.param_groups}) == [0.0, 0.2]
    assert changed.optimizer.state_dict()["state"].keys() == saved["optimizer"]["state"].keys()  # moments kept
    changed.optimizer.step()
    changed.scheduler.step()
    assert changed.scheduler.get_last_lr()[0] == rule(3, 3e-2, warmup)
