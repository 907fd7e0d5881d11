"""Dr. GRPO (Liu et al. 2025, "Understanding R1-Zero-like training"; `purify.advantage=dr_grpo`, as
OpenRLHF's `dr_grpo` estimator): (1) the advantage is r − mean of the prompt group, with no division
by the group's std; (2) the loss sums token terms over the whole mini-batch and divides by one number
for all of them, so a token's weight does not depend on the length of its own sequence (GRPO's
per-sequence 1/|o_i| is gone). Both checked against hand computations on a tiny batch with the real
tiny policy and the real update (trainer/grpo.py)."""

from __future__ import annotations

import random

import pytest
import torch
from transformers import AutoModelForCausalLM

from pipeline.config import DEFAULT_POLICY, TrainConfig
from pipeline.trajectory import PurifiedTrajectory
from purifier.advantages import group_advantages, group_plan
from trainer.batches import mini_batches
from trainer.grpo import GRPOUpdate


def test_advantages_are_reward_minus_group_mean_without_std():
    assert group_advantages([1.0, -1.0, -1.0], "dr_grpo") == pytest.approx([4 / 3, -2 / 3, -2 / 3], abs=1e-15)
    # the spread of the rewards is kept, not normalised away (group_norm makes both ±1)
    assert group_advantages([2.0, 0.0], "dr_grpo") == [1.0, -1.0]
    assert group_advantages([20.0, 0.0], "dr_grpo") == [10.0, -10.0]
    assert group_advantages([20.0, 0.0], "group_norm") == pytest.approx([1.0, -1.0], abs=1e-6)
    # through the purifier's group plan (sample order, positions of the input kept)
    assert group_plan([(2, 0.5), (0, -1.0), (1, 1.0)], "dr_grpo", False) == [
        (1, -1.0 - 1 / 6),
        (2, 1.0 - 1 / 6),
        (0, 0.5 - 1 / 6),
    ]


def _model():
    return AutoModelForCausalLM.from_pretrained(DEFAULT_POLICY, dtype=torch.float32, attn_implementation="eager")


def _rows(m) -> list[PurifiedTrajectory]:
    """Two prompt groups of three, responses of very different lengths, some tool (mask-0) tokens;
    old log-probs are the model's own, so every ratio is 1 (up to rounding) and nothing is clipped."""
    rng = random.Random(3)
    rewards = [1.0, -1.0, -1.0, 1.0, 1.0, -1.0]
    lengths = [3, 14, 6, 2, 11, 5]
    rows = []
    for i, (r, n) in enumerate(zip(rewards, lengths)):
        group = rewards[3 * (i // 3) : 3 * (i // 3) + 3]
        adv = group_advantages(group, "dr_grpo")[i % 3]
        prompt = [rng.randrange(5, 400) for _ in range(5)]
        resp = [rng.randrange(5, 400) for _ in range(n)]
        mask = [0 if 0 < k < n - 1 and rng.random() < 0.25 else 1 for k in range(n)]
        with torch.no_grad():
            logp = torch.log_softmax(m(torch.tensor([prompt + resp])).logits[0].float(), -1)
        old = [logp[len(prompt) + k - 1, t].item() for k, t in enumerate(resp)]
        rows.append(
            PurifiedTrajectory(
                "r",
                0,
                f"p{i // 3}",
                i % 3,
                "saar",
                0.5,
                f"k{i}",
                prompt,
                resp,
                mask,
                old,
                [1] * n,
                r,
                adv,
                [],
                -1,
                0,
                True,
            )
        )
    return rows


def _hand_loss(m, rows, per_sequence_mean: bool) -> torch.Tensor:
    """−Σ_i Σ_t A_i ratio_it / T (Dr. GRPO: T = all trained tokens of the mini-batch), or GRPO's
    −(1/G) Σ_i (1/|o_i|) Σ_t A_i ratio_it for contrast."""
    terms = []
    for r in rows:
        logp = torch.log_softmax(m(torch.tensor([r.prompt_ids + r.response_ids])).logits[0].float(), -1)
        p = len(r.prompt_ids)
        seq = [
            torch.exp(logp[p + k - 1, t] - r.old_logprobs[k]) * r.advantage
            for k, t in enumerate(r.response_ids)
            if r.loss_mask[k]
        ]
        terms.append(seq)
    if per_sequence_mean:
        return -sum(sum(s) / len(s) for s in terms) / len(terms)
    return -sum(sum(s) for s in terms) / sum(len(s) for s in terms)


def test_loss_is_a_token_sum_over_one_mini_batch_wide_constant():
    m_upd, m_ref, m_grpo = _model(), _model(), _model()
    rows = _rows(m_ref)
    cfg = TrainConfig(micro_batch_tokens=30, mini_batches=1, lr=1e-3)  # several micro-batches, accumulated
    upd = GRPOUpdate(m_upd, cfg)
    upd.step = lambda: 0.0  # keep the gradients of this mini-batch; no optimizer step
    (groups,) = mini_batches(rows, 1)
    metrics = upd.minibatch(groups, pad_id=0)
    tokens = sum(sum(r.loss_mask) for r in rows)
    assert metrics.tokens == tokens

    want = _hand_loss(m_ref, rows, per_sequence_mean=False)
    want.backward()
    # with every ratio 1 the loss is −Σ_i A_i·n_i / T: a long sequence counts by its tokens
    by_hand = -sum(r.advantage * sum(r.loss_mask) for r in rows) / tokens
    assert metrics.loss == pytest.approx(by_hand, abs=1e-6) and want.item() == pytest.approx(by_hand, abs=1e-6)
    for (name, a), (_, b) in zip(m_upd.named_parameters(), m_ref.named_parameters()):
        assert torch.allclose(a.grad, b.grad, rtol=1e-4, atol=1e-5), name  # SDPA vs eager attention rounding

    # and it is not GRPO's per-sequence mean, which would weigh the 2-token row's tokens 7× the 14-token row's
    grpo = _hand_loss(m_grpo, rows, per_sequence_mean=True)
    grpo.backward()
    gap = max((a.grad - b.grad).abs().max().item() for a, b in zip(m_upd.parameters(), m_grpo.parameters()))
    assert gap > 1e-3


def test_seq_mean_loss_is_grpo_s_per_sequence_mean_over_the_mini_batch():
    """train.loss_agg=seq_mean (the sequence-mean control of the normalisation): each row's mean over its trained
    tokens, then the mean over the mini-batch's rows, across micro-batches, by hand and through the real update."""
    m_upd, m_ref = _model(), _model()
    rows = _rows(m_ref)
    cfg = TrainConfig(micro_batch_tokens=30, mini_batches=1, lr=1e-3, loss_agg="seq_mean")
    upd = GRPOUpdate(m_upd, cfg)
    upd.step = lambda: 0.0
    (groups,) = mini_batches(rows, 1)
    metrics = upd.minibatch(groups, pad_id=0)
    want = _hand_loss(m_ref, rows, per_sequence_mean=True)
    want.backward()
    by_hand = -sum(r.advantage for r in rows) / len(rows)  # every ratio 1: each row counts once, whatever its length
    assert metrics.loss == pytest.approx(by_hand, abs=1e-6) and want.item() == pytest.approx(by_hand, abs=1e-6)
    for (name, a), (_, b) in zip(m_upd.named_parameters(), m_ref.named_parameters()):
        assert torch.allclose(a.grad, b.grad, rtol=1e-4, atol=1e-5), name


def test_seq_mean_is_refused_for_a_loss_that_is_per_sequence_already():
    with pytest.raises(ValueError, match="train.loss_agg=seq_mean applies to train.policy_loss_type=ppo"):
        TrainConfig(loss_agg="seq_mean", policy_loss_type="gspo")
