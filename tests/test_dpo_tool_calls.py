"""Negative-sample DPO on tool calls (issue 29 §5, trainer/dpo.py): pairs come from the raw shard, the side
loss's value and gradient equal a hand computation on the real tiny policy, and off (the default) changes
nothing."""

from __future__ import annotations

import dataclasses
import math
import random

import pytest
import torch
from transformers import AutoModelForCausalLM

from pipeline.config import DEFAULT_POLICY, TrainConfig
from pipeline.kinds import failed_call
from pipeline.trajectory import attempt_from_row, fingerprint
from storage.layout import RunLayout
from storage.schemas import METRICS, RAW
from storage.shards import read_shard
from trainer.batches import TrainingRow, mini_batches
from trainer.dpo import CallPair, read_pairs
from trainer.grpo import GRPOUpdate
from trainer.stage import run_update_stage


def model():
    return AutoModelForCausalLM.from_pretrained(DEFAULT_POLICY, dtype=torch.float32, attn_implementation="eager")


def test_pairs_are_failed_calls_and_their_working_retry_in_the_first_attempts_context(world_rollout):
    raw_dir = RunLayout(world_rollout.storage.root, "w").raw_dir(0)
    pairs, skipped = read_pairs(raw_dir)
    rows = {f"w/0/{r['prompt_id']}/{r['sample_idx']}": r for r in read_shard(raw_dir, RAW).to_pylist()}
    expected = 0
    for r in rows.values():
        for p in r["positions"]:
            attempts = [attempt_from_row(a) for a in p["attempts"]]
            works = [i for i, a in enumerate(attempts) if i and a.result is not None and a.result.status == "success"]
            if works:
                expected += sum(failed_call(a) and a.call_start >= 0 for a in attempts[: works[-1]])
    assert len(pairs) == expected > 0 and skipped == 0
    for pair in pairs:
        r = rows[pair.raw_key]
        p = next(p for p in r["positions"] if p["position_idx"] == pair.position_idx)
        first = attempt_from_row(p["attempts"][0])
        assert pair.context == (r["prompt_ids"] + r["lived_ids"])[: first.context_len]
        assert fingerprint(pair.context) == first.context_fingerprint
        by_turn = {tuple(a["turn_ids"]): attempt_from_row(a) for a in p["attempts"]}
        chosen, rejected = by_turn[tuple(pair.chosen)], by_turn[tuple(pair.rejected)]
        assert chosen.result.status == "success" and failed_call(rejected)
        assert (pair.chosen_call, pair.rejected_call) == (chosen.call_start, rejected.call_start)


def synthetic(seed=0, n_groups=2, pairs_per_group=2):
    """Groups of rows trained with advantage 0 (no policy-loss gradient) and tool-call pairs on their prompts."""
    rng = random.Random(seed)
    rows, pairs = [], []
    for g in range(n_groups):
        prompt = [rng.randrange(5, 900) for _ in range(6)]
        for i in range(3):
            resp = [rng.randrange(5, 900) for _ in range(rng.randint(6, 12))]
            rows.append(
                TrainingRow(f"r/0/p{g}/{i}", f"p{g}", i, prompt, resp, [1] * len(resp), [-2.0] * len(resp), 0.0)
            )
        for k in range(pairs_per_group):
            context = prompt + [rng.randrange(5, 900) for _ in range(rng.randint(3, 9))]
            chosen = [rng.randrange(5, 900) for _ in range(rng.randint(5, 11))]
            rejected = [rng.randrange(5, 900) for _ in range(rng.randint(5, 11))]
            pairs.append(
                CallPair(f"p{g}", f"r/0/p{g}/0", k, context, chosen, rng.randint(1, 4), rejected, rng.randint(1, 4))
            )
    return rows, pairs


def call_logp(m, context, turn, start) -> torch.Tensor:
    """log π of turn[start:] after context + turn[:start], from one full-vocabulary forward."""
    ids = torch.tensor([context + turn])
    logp = torch.log_softmax(m(ids).logits[0].float(), -1)
    return torch.stack([logp[len(context) + k - 1, turn[k]] for k in range(start, len(turn))])


@pytest.mark.parametrize("beta,cap", [(2.0, 10.0), (15.0, 0.1), (2.0, 1e-4)])
def test_side_loss_value_and_gradient_equal_a_hand_computation(beta, cap):
    rows, pairs = synthetic()
    cfg = TrainConfig(
        use_dpo_on_tool_calls=True, dpo_beta=beta, dpo_max_adjustment_ratio=cap, mini_batches=1, micro_batch_tokens=48
    )  # several micro-batches: pairs split across them
    m1, m2 = model(), model()
    upd = GRPOUpdate(m1, cfg)
    upd.set_dpo_pairs(pairs)
    upd.step = lambda: 0.0  # keep the gradients; no optimizer step
    metrics = upd.minibatch(mini_batches(rows, 1)[0], pad_id=0)

    tokens = sum(sum(r.loss_mask) for r in rows)  # N: the policy loss's normaliser
    losses, surrogate, capped = [], 0.0, 0
    for p in pairs:
        w, lo = call_logp(m2, p.context, p.chosen, p.chosen_call), call_logp(m2, p.context, p.rejected, p.rejected_call)
        delta = (w.mean() - lo.mean()).item()
        losses.append(-math.log(1 / (1 + math.exp(-beta * delta))))
        g = beta / (1 + math.exp(beta * delta))  # β·σ(−β·Δ)
        c_w, c_l = min(g / len(w), cap), min(g / len(lo), cap)
        capped += g / len(w) > cap
        surrogate = surrogate + (-c_w * w.sum() + c_l * lo.sum()) / tokens
    surrogate.backward()
    assert metrics.dpo_pairs == len(pairs)
    assert metrics.dpo_loss == pytest.approx(sum(losses) / len(losses), abs=1e-5)
    assert metrics.dpo_capped == pytest.approx(capped / len(pairs))
    if cap == 1e-4:
        assert metrics.dpo_capped == 1.0  # every weight at the cap
    for (name, a), (_, b) in zip(m1.named_parameters(), m2.named_parameters()):
        assert torch.allclose(a.grad, b.grad, atol=1e-6, rtol=1e-4), name


def test_off_by_default_changes_nothing():
    rows, pairs = synthetic(seed=1)
    rows = [dataclasses.replace(r, advantage=(-1.0) ** i) for i, r in enumerate(rows)]  # a policy-loss gradient
    assert TrainConfig().use_dpo_on_tool_calls is False

    def grads(with_pairs: bool):
        m = model()
        upd = GRPOUpdate(m, TrainConfig(mini_batches=1, micro_batch_tokens=48))
        if with_pairs:
            upd.set_dpo_pairs(pairs)
        upd.step = lambda: 0.0
        metrics = upd.minibatch(mini_batches(rows, 1)[0], pad_id=0)
        return metrics, [p.grad.clone() for p in m.parameters()]

    (m_a, a), (m_b, b) = grads(False), grads(True)
    assert m_a.loss == m_b.loss and all(torch.equal(x, y) for x, y in zip(a, b))
    assert m_b.dpo_loss is None and m_b.dpo_pairs is None


def test_update_stage_trains_with_the_side_loss_and_logs_it(purified_run, tmp_path):
    import shutil

    cfg = purified_run.model_copy(deep=True)
    shutil.copytree(purified_run.storage.root / "runs", tmp_path / "runs")
    cfg.storage.root = tmp_path
    cfg.train.use_dpo_on_tool_calls, cfg.train.mini_batches = True, 1
    lines = []
    target = run_update_stage(cfg, "w", 0, log=lines.append)
    assert (target / "model.safetensors").is_file()
    assert any("DPO on tool calls" in line and "pairs" in line for line in lines)
    metrics = read_shard(RunLayout(tmp_path, "w").metrics_dir(0, "update"), METRICS).to_pylist()
    by_name = {m["name"]: m["value"] for m in metrics}
    assert by_name["dpo_pairs"] > 0 and math.isfinite(by_name["dpo_loss"]) and 0 <= by_name["dpo_capped"] <= 1
    assert "correction_filtered" not in by_name  # an option's metrics only when it is on
    # `cleaner report` and the flow's table show them (and leave out the options that were off)
    from flows.report import iteration_table, write_report

    (row,) = iteration_table(tmp_path, "w")
    steps = [m for m in metrics if m["name"] == "dpo_pairs"]
    assert row["dpo_pairs"] == sum(m["value"] for m in steps) and math.isfinite(row["dpo_loss"])
    assert "correction_filtered" not in row and "behaviour_kl" not in row
    page = write_report(tmp_path, "w")
    html = page.read_text()
    assert (page.parent / "update_options.png").is_file() and "dpo_<wbr>loss" in html and "correction_<wbr>" not in html
