"""The update's throughput fix (issue 29, trainer benchmark): rows are packed into micro-batches by length,
not by group, and lm_head runs only at action positions, chunked only where the vocabulary needs it. The
packing is optimal for its cost and keeps every row once; the log-probs and gradients are Actor.forward's;
at Qwen3's 151,936 ids no lm_head call holds more than 512 positions' logits."""

from __future__ import annotations

import dataclasses
import itertools
import random

import pytest
import torch
from transformers import AutoModelForCausalLM, Qwen3ForCausalLM

from flows.init_policy import InitPolicyConfig, qwen3_config
from pipeline.config import DEFAULT_POLICY, TrainConfig
from trainer import batches
from trainer.batches import TrainingRow, micro_batches, pack_rows
from trainer.chunked_actor import LOGIT_BUDGET, action_log_probs, positions_per_call
from trainer.grpo import GRPOUpdate


def row(key: str, group: str, length: int, rng: random.Random) -> TrainingRow:
    prompt = [rng.randrange(5, 900) for _ in range(6)]
    resp = [rng.randrange(5, 900) for _ in range(length - 6)]
    return TrainingRow(key, group, 0, prompt, resp, [1] * len(resp), [-1.0] * len(resp), 0.5)


def test_rows_are_packed_by_length_across_groups():
    """The trainer benchmark's shape: groups of four ~100-token rows, two groups holding one long row each.
    Packed as groups, the long rows' group-mates were padded to 650 and 428 tokens."""
    rng = random.Random(0)
    groups = [[row(f"g{g}/{i}", f"g{g}", rng.randint(80, 120), rng) for i in range(4)] for g in range(14)]
    groups[3][1] = row("g3/long", "g3", 650, rng)
    groups[9][2] = row("g9/long", "g9", 428, rng)
    micros = micro_batches(groups, 8192, pad_id=0)
    keys = [k for m in micros for k in m.rows]
    assert sorted(keys) == sorted(r.raw_key for g in groups for r in g)  # every row exactly once
    real = sum(len(r.prompt_ids) + len(r.response_ids) for g in groups for r in g)
    padded = sum(m.sequences.numel() for m in micros)
    assert padded < 1.1 * real  # as groups: 650×4 + 428×4 + … ≈ 1.6× real
    for m in micros:
        assert m.sequences.numel() <= 8192 or m.sequences.shape[0] == 1
        if m.sequences.shape[1] >= 428:
            assert m.sequences.shape[0] == 1  # a long row does not pad short ones to its width


def test_pack_rows_finds_the_cheapest_cut():
    rng = random.Random(1)
    for trial in range(20):
        rows = [row(f"r{i}", "g", rng.choice([20, 30, 45, 60, 200, 700]), rng) for i in range(7)]
        budget = rng.choice([150, 400, 1000])
        lengths = sorted(len(r.prompt_ids) + len(r.response_ids) for r in rows)

        def cost(runs):
            return sum(len(x) * x[-1] * (1 + x[-1] / batches.ATTENTION_WIDTH) + batches.MICRO_BATCH_COST for x in runs)

        best = min(cost(runs) for runs in _cuts(lengths) if all(len(x) == 1 or len(x) * x[-1] <= budget for x in runs))
        got = [[len(r.prompt_ids) + len(r.response_ids) for r in run] for run in pack_rows(rows, budget)]
        assert [n for run in got for n in run] == lengths
        assert cost(got) == pytest.approx(best), trial


def _cuts(xs):
    for bits in itertools.product([0, 1], repeat=len(xs) - 1):
        runs, cur = [], [xs[0]]
        for x, cut in zip(xs[1:], bits):
            if cut:
                runs.append(cur)
                cur = []
            cur.append(x)
        yield runs + [cur]


class _Counting(torch.nn.Module):
    """lm_head wrapped to record how many positions each call computes logits for (forward and recompute)."""

    def __init__(self, head: torch.nn.Linear) -> None:
        super().__init__()
        self.head, self.calls = head, []
        self.weight = head.weight

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        self.calls.append(h.reshape(-1, h.shape[-1]).shape[0])
        return self.head(h)


def _batch(g: torch.Generator, rows: int, width: int, vocab: int, pad_from: int):
    seq = torch.randint(3, vocab, (rows, width), generator=g)
    att = torch.ones_like(seq)
    att[-1, pad_from:] = 0  # right padding, as collate() writes it
    act = (torch.rand((rows, width - 1), generator=g) < 0.7).float() * att[:, 1:]
    return seq, att, act


def test_lm_head_runs_only_at_action_positions_in_one_call_at_a_small_vocabulary():
    m1 = AutoModelForCausalLM.from_pretrained(DEFAULT_POLICY, dtype=torch.float32, attn_implementation="eager")
    m2 = AutoModelForCausalLM.from_pretrained(DEFAULT_POLICY, dtype=torch.float32, attn_implementation="eager")
    a1, a2 = GRPOUpdate(m1, TrainConfig()).actor, GRPOUpdate(m2, TrainConfig()).actor
    seq, att, act = _batch(torch.Generator().manual_seed(0), 4, 90, 1000, 60)
    head = _Counting(m2.lm_head)
    m2.lm_head = head
    want = a1(seq, act, attention_mask=att)
    got, _ = action_log_probs(a2, seq, act, att)
    assert torch.allclose(got, want, atol=1e-5)
    got.sum().backward()
    want.sum().backward()
    assert head.calls == [int(act.sum())]  # one call, at the action positions only, nothing recomputed
    for (name, p1), (_, p2) in zip(m1.named_parameters(), m2.named_parameters()):
        assert torch.allclose(p1.grad, p2.grad, atol=1e-5), name


def test_qwen3_vocabulary_keeps_each_lm_head_call_within_the_logit_budget():
    torch.manual_seed(0)
    model = Qwen3ForCausalLM(qwen3_config(InitPolicyConfig(steps=0))).float()
    vocab = model.config.vocab_size
    assert vocab == 151_936 and positions_per_call(vocab) == 512 == LOGIT_BUDGET // vocab
    actor = GRPOUpdate(model, TrainConfig()).actor
    seq, att, act = _batch(torch.Generator().manual_seed(1), 3, 600, vocab, 400)
    head = _Counting(model.lm_head)
    model.lm_head = head
    got, _ = action_log_probs(actor, seq, act, att)
    n = int(act.sum())
    assert n > 2 * 512 and head.calls == [512, 512, n - 1024]  # forward: action positions only, 512 at a time
    got.sum().backward()
    assert max(head.calls) <= 512 and sum(head.calls) == 2 * n  # backward recomputes one chunk at a time


def test_emptied_micro_batches_add_nothing():
    """A rank with fewer micro-batches than another makes emptied ones, so every rank forwards as often (ZeRO-3
    gathers weights in each forward): gradients and metrics are those without them."""
    rng = random.Random(2)
    rows = [row(f"g{i // 3}/{i % 3}", f"g{i // 3}", rng.randint(20, 60), rng) for i in range(9)]
    rows = [
        TrainingRow(
            r.raw_key,
            r.prompt_id,
            r.sample_idx,
            r.prompt_ids,
            r.response_ids,
            r.loss_mask,
            [-3.0 + 0.1 * (k % 7) for k in range(len(r.response_ids))],
            (-1.0) ** i,
            [-3.1] * len(r.response_ids),
        )
        for i, r in enumerate(rows)
    ]
    groups = [rows[i : i + 3] for i in range(0, 9, 3)]

    def run(extra: int, **cfg):
        m = AutoModelForCausalLM.from_pretrained(DEFAULT_POLICY, dtype=torch.float32, attn_implementation="eager")
        upd = GRPOUpdate(m, TrainConfig(mini_batches=1, micro_batch_tokens=120, **cfg))
        upd.most = lambda n: n + extra
        upd.step = lambda: 0.0
        metrics = upd.minibatch(groups, pad_id=0)
        return metrics, [p.grad.clone() for p in m.parameters()]

    for cfg in ({}, {"rollout_correction": "seq_mis"}):
        (a, ga), (b, gb) = run(0, **cfg), run(2, **cfg)
        assert all(torch.equal(x, y) for x, y in zip(ga, gb))
        assert (a.loss, a.clip_ratio, a.approx_kl, a.tokens, a.correction_filtered) == (
            b.loss,
            b.clip_ratio,
            b.approx_kl,
            b.tokens,
            b.correction_filtered,
        )


def test_rows_that_train_no_token_are_not_forwarded():
    """A prompt too long to roll out leaves a row of its prompt alone (no response, nothing trained): the update
    forwarded it whole, a 35,021-token prompt for minutes. Rows that train no token are left out of the
    micro-batches; gradients and metrics are those without them (the loss is a token mean)."""
    rng = random.Random(3)
    rows = [row(f"g{i // 3}/{i % 3}", f"g{i // 3}", rng.randint(20, 60), rng) for i in range(6)]
    rows = [
        dataclasses.replace(r, old_logprobs=[-3.0] * len(r.response_ids), advantage=(-1.0) ** i)
        for i, r in enumerate(rows)
    ]
    too_long = TrainingRow("g0/huge", "g0", 3, [rng.randrange(5, 900) for _ in range(3000)], [], [], [], 0.0)
    with_it = [[*rows[:3], too_long], rows[3:]]
    widths: list[int] = []

    def run(groups):
        m = AutoModelForCausalLM.from_pretrained(DEFAULT_POLICY, dtype=torch.float32, attn_implementation="eager")
        upd = GRPOUpdate(m, TrainConfig(mini_batches=1, micro_batch_tokens=4096))
        upd.step = lambda: 0.0
        widths.clear()
        real = batches.collate

        def spy(rs, *a, **k):
            widths.append(max(len(r.prompt_ids) + len(r.response_ids) for r in rs))
            return real(rs, *a, **k)

        batches.collate = spy
        try:
            metrics = upd.minibatch(groups, pad_id=0)
        finally:
            batches.collate = real
        return metrics, [p.grad.clone() for p in m.parameters()], list(widths)

    (a, ga, wa), (b, gb, wb) = run(with_it), run([rows[:3], rows[3:]])
    assert max(wa) < 3000 and wa == wb  # the prompt-only row is never forwarded
    assert all(torch.equal(x, y) for x, y in zip(ga, gb)) and (a.loss, a.tokens) == (b.loss, b.tokens)
