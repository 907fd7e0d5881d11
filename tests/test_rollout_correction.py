"""Train-time rollout correction (issue 29 §3): verl's presets on OpenRLHF's own PolicyLoss gate, with the
purified rows' behaviour log-probs as its rollout log-probs. What OpenRLHF masks or clips is read back from
the real loss's gradients on crafted batches; off, the update is bit-identical to the call of before; bad
input is one clear error. Real tiny policy, real OpenRLHF PolicyLoss."""

from __future__ import annotations

import dataclasses
import math
import random
import typing

import pytest
import torch
from transformers import AutoModelForCausalLM

from pipeline.config import DEFAULT_POLICY, ConfigError, TrainConfig, load_config
from storage.layout import RunLayout
from storage.schemas import PURIFIED_V1
from storage.shards import write_shard
from trainer.batches import TrainingRow, collate, micro_batches, mini_batches
from trainer.chunked_actor import action_log_probs
from trainer.correction import PRESETS
from trainer.grpo import GRPOUpdate, UpdateError, policy_loss
from trainer.inputs import load_rows
from trainer.openrlhf_compat import openrlhf_models
from trainer.stage import run_update_stage

from tests.test_trainer import noisy_sequences


def model():
    return AutoModelForCausalLM.from_pretrained(DEFAULT_POLICY, dtype=torch.float32, attn_implementation="eager")


def rows_with_behaviour(m, n=6, seed=0, shift=None) -> list[TrainingRow]:
    """Rows whose old log-probs are the model's own plus noise and whose behaviour log-probs are old − log ρ:
    ρ = π_old / π_behaviour drawn from shift(rng) (default: a spread over every preset's bounds)."""
    rng = random.Random(seed)
    shift = shift or (lambda r: math.log(r.choice([0.2, 0.45, 0.8, 1.0, 1.3, 1.9, 2.2, 4.0, 6.0])))
    rows = []
    for i, prompt, resp, mask, old in noisy_sequences(m, n, rng):
        behaviour = [o - shift(rng) if bit else 0.0 for o, bit in zip(old, mask)]
        rows.append(
            TrainingRow(
                f"r/0/p{i // 3}/{i % 3}",
                f"p{i // 3}",
                i % 3,
                prompt,
                resp,
                mask,
                old,
                rng.choice([-1.5, -0.5, 0.7, 1.2]),
                behaviour,
            )
        )
    return rows


def test_presets_are_the_config_names_and_map_onto_policy_loss_as_documented():
    assert set(PRESETS) == set(typing.get_args(TrainConfig.model_fields["rollout_correction"].annotation))
    want = {  # preset: (is_correction_level, is_correction_mode, is_correction_gating, is_correction_threshold)
        "off": ("off", "mask", "ratio", (0.5, 5.0)),  # PolicyLoss's own defaults: nothing passed
        "token_tis": ("token", "clip", "ratio", [0.0, 2.0]),
        "token_mis": ("token", "mask", "ratio", [0.5, 5.0]),
        "seq_mis": ("seq", "mask", "ratio", [0.5, 2.0]),
        "geo_rs": ("seq", "mask", "ratio", [0.999, 1.001]),
    }
    for name, (level, mode, gating, bounds) in want.items():
        loss = policy_loss(TrainConfig(rollout_correction=name))
        assert isinstance(loss, openrlhf_models().PolicyLoss)
        got = (
            loss.is_correction_level,
            loss.is_correction_mode,
            loss.is_correction_gating,
            loss.is_correction_threshold,
        )
        assert got == (level, mode, gating, bounds), name
    custom = policy_loss(TrainConfig(rollout_correction="token_mis", rollout_correction_bounds=(0.25, 3.0)))
    assert custom.is_correction_threshold == [0.25, 3.0] and custom.is_correction_mode == "mask"


def _coefficients(cfg: TrainConfig, rows: list[TrainingRow]) -> tuple[torch.Tensor, torch.Tensor, object]:
    """Per action token, the weight PolicyLoss puts on its PPO term, read from the gradient: with log-probs
    equal to the old ones the PPO ratio is 1, inside both clip edges, so ∂loss/∂logp_t = −A_t·coef_t/N."""
    mb = collate(rows, pad_id=0)
    logp = mb.old_log_probs.clone().requires_grad_(True)
    tokens = mb.num_actions
    loss_fn = policy_loss(cfg)
    loss, *_ = loss_fn(
        logp,
        mb.old_log_probs,
        mb.advantages,
        action_mask=mb.action_mask,
        rollout_log_probs=mb.rollout_log_probs,
        batch_num_tokens=tokens,
    )
    loss.backward()
    act = mb.action_mask > 0
    coef = -logp.grad[act] * tokens / mb.advantages[act]
    ratio = (mb.old_log_probs - mb.rollout_log_probs).exp()[act]  # π_old / π_behaviour per action token
    return coef, ratio, mb


@pytest.mark.parametrize(
    "preset,bounds", [("token_tis", None), ("token_mis", None), ("token_tis", (0.5, 1.5)), ("token_mis", (0.9, 1.2))]
)
def test_token_gates_mask_or_clip_exactly_the_tokens_outside_the_bounds(preset, bounds):
    cfg = TrainConfig(rollout_correction=preset, rollout_correction_bounds=bounds)
    lo, hi = bounds or {"token_tis": (0.0, 2.0), "token_mis": (0.5, 5.0)}[preset]
    coef, ratio, _ = _coefficients(cfg, rows_with_behaviour(model(), n=9))
    outside = (ratio < lo) | (ratio > hi)
    assert 0 < int(outside.sum()) < ratio.numel()  # the crafted ratios fall on both sides of the bounds
    if preset == "token_tis":  # truncated IS: every token kept, its weight clamped into [lo, hi]
        assert torch.allclose(coef, ratio.clamp(lo, hi), atol=1e-5)
        assert torch.equal(torch.isclose(coef, ratio, atol=1e-5), ~outside)  # exactly the outside ones were clipped
    else:  # masked IS: outside tokens dropped, the others weighted by their own ratio
        assert torch.equal(coef == 0, outside)
        assert torch.allclose(coef[~outside], ratio[~outside], atol=1e-5)


@pytest.mark.parametrize("preset,bounds", [("seq_mis", (0.5, 2.0)), ("geo_rs", (0.999, 1.001))])
def test_sequence_gates_drop_exactly_the_rows_whose_geometric_mean_ratio_is_outside(preset, bounds):
    # one geometric-mean ratio per row, some inside the band and some outside: per-token ratios spread around it
    means = [0.3, 0.7, 1.0, 1.0005, 1.5, 2.5] if preset == "seq_mis" else [0.99, 0.9995, 1.0, 1.0008, 1.002, 1.5]
    m = model()
    rows = []
    for i, g in enumerate(means):
        rng = random.Random(i)
        row = rows_with_behaviour(m, n=1, seed=i, shift=lambda r: 0.0)[0]
        trained = [k for k, bit in enumerate(row.loss_mask) if bit]
        noise = [rng.uniform(-0.3, 0.3) for _ in trained]
        noise = [x - sum(noise) / len(noise) + math.log(g) for x in noise]  # mean log ρ = log g exactly
        behaviour = list(row.behaviour_logprobs)
        for k, x in zip(trained, noise):
            behaviour[k] = row.old_logprobs[k] - x
        rows.append(
            TrainingRow(
                f"r/0/p0/{i}",
                "p0",
                i,
                row.prompt_ids,
                row.response_ids,
                row.loss_mask,
                row.old_logprobs,
                row.advantage,
                behaviour,
            )
        )
    coef, ratio, mb = _coefficients(TrainConfig(rollout_correction=preset), rows)
    per_row = mb.action_mask.sum(-1).long().tolist()
    start = 0
    for g, n in zip(means, per_row):
        c, r = coef[start : start + n], ratio[start : start + n]
        if bounds[0] <= g <= bounds[1]:
            assert torch.allclose(c, r, atol=1e-5), g  # kept: each token weighted by its own ratio
        else:
            assert torch.equal(c, torch.zeros_like(c)), g  # the whole row dropped
        start += n


def test_update_logs_the_share_of_tokens_the_correction_masked_or_clipped():
    m = model()
    rows = rows_with_behaviour(m, n=9, seed=3)
    tokens = sum(sum(r.loss_mask) for r in rows)
    ratios = [
        math.exp(o - b) for r in rows for o, b, bit in zip(r.old_logprobs, r.behaviour_logprobs, r.loss_mask) if bit
    ]
    kl = sum(b - o for r in rows for o, b, bit in zip(r.old_logprobs, r.behaviour_logprobs, r.loss_mask) if bit)
    for preset, outside in [("token_tis", lambda x: x > 2.0), ("token_mis", lambda x: x < 0.5 or x > 5.0)]:
        upd = GRPOUpdate(model(), TrainConfig(rollout_correction=preset, mini_batches=1, micro_batch_tokens=60))
        metrics = upd.minibatch(mini_batches(rows, 1)[0], pad_id=0)
        assert metrics.correction_filtered == pytest.approx(sum(map(outside, ratios)) / tokens, abs=1e-6), preset
        assert metrics.behaviour_kl == pytest.approx(kl / tokens, abs=1e-5)
    # sequence level: a dropped row counts all of its tokens
    upd = GRPOUpdate(model(), TrainConfig(rollout_correction="seq_mis", mini_batches=1, micro_batch_tokens=60))
    metrics = upd.minibatch(mini_batches(rows, 1)[0], pad_id=0)
    dropped = 0
    for r in rows:
        logs = [o - b for o, b, bit in zip(r.old_logprobs, r.behaviour_logprobs, r.loss_mask) if bit]
        if logs and not 0.5 <= math.exp(sum(logs) / len(logs)) <= 2.0:
            dropped += len(logs)
    assert 0 < dropped < tokens
    assert metrics.correction_filtered == pytest.approx(dropped / tokens, abs=1e-6)
    off = GRPOUpdate(model(), TrainConfig(mini_batches=1)).minibatch(mini_batches(rows, 1)[0], pad_id=0)
    assert off.correction_filtered is None and off.behaviour_kl is None


def _grads(m):
    return [p.grad.clone() for p in m.parameters()]


def test_off_is_bit_identical_to_the_update_before_the_correction():
    """Default config: loss and gradients equal, bit for bit, those of the loss built and called as before
    the correction existed (PolicyLoss without any is_correction argument, no rollout log-probs), whether
    the rows carry behaviour log-probs or not; the same rows with a correction on give other gradients."""
    cfg = TrainConfig(micro_batch_tokens=60, mini_batches=1)
    rows = rows_with_behaviour(model(), n=9, seed=5)
    (groups,) = mini_batches(rows, 1)

    def update(config, data):
        m = model()
        upd = GRPOUpdate(m, config)
        upd.step = lambda: 0.0  # keep this mini-batch's gradients; no optimizer step
        metrics = upd.minibatch(data, pad_id=0)
        return metrics.loss, _grads(m)

    m = model()  # the call as it was: PolicyLoss(clip…, policy_loss_type) and loss_fn(logp, old, adv, mask, N, dp)
    before = openrlhf_models().PolicyLoss(
        clip_eps_low=cfg.clip_eps_low,
        clip_eps_high=cfg.clip_eps_high,
        dual_clip=cfg.dual_clip,
        token_level_loss=True,
        policy_loss_type=cfg.policy_loss_type,
    )
    actor = GRPOUpdate(m, cfg).actor
    micros = micro_batches(groups, cfg.micro_batch_tokens, 0)
    assert len(micros) > 1
    tokens = sum(x.num_actions for x in micros)
    m.train()
    want_loss = 0.0
    for x in micros:
        logp, _ = action_log_probs(actor, x.sequences, x.action_mask, x.attention_mask)
        loss, *_ = before(
            logp, x.old_log_probs, x.advantages, action_mask=x.action_mask, batch_num_tokens=tokens, dp_size=1
        )
        loss.backward()
        want_loss += loss.item()
    want = _grads(m)

    for data in (groups, [[dataclasses.replace(r, behaviour_logprobs=None) for r in g] for g in groups]):
        got_loss, got = update(cfg, data)
        assert got_loss == want_loss  # with and without behaviour log-probs
        assert all(torch.equal(a, b) for a, b in zip(got, want))
    on_loss, on = update(TrainConfig(micro_batch_tokens=60, mini_batches=1, rollout_correction="token_mis"), groups)
    assert on_loss != want_loss and not all(torch.equal(a, b) for a, b in zip(on, want))


@pytest.mark.parametrize(
    "override,needle",
    [
        ("train.rollout_correction=token_tiss", "'token_tiss'"),
        ("train.rollout_correction=tis", "'tis'"),
        ("train.rollout_correction_bounds=[3.0,2.0]", "[3.0, 2.0]"),
        ("train.rollout_correction_bounds=[.nan,2.0]", "nan"),
        ("train.rollout_correction_bounds=[-0.5,2.0]", "[-0.5, 2.0]"),
    ],
)
def test_bad_correction_config_is_one_line_naming_the_value(override, needle):
    with pytest.raises(ConfigError) as e:
        load_config(None, [override])
    msg = str(e.value)
    assert "\n" not in msg and needle in msg and "train.rollout_correction" in msg


def test_correction_with_gspo_is_refused():
    with pytest.raises(ConfigError, match="policy_loss_type=ppo"):
        load_config(None, ["train.rollout_correction=token_tis", "train.policy_loss_type=gspo"])


def test_rows_without_behaviour_log_probs_are_refused_when_corrected():
    rows = rows_with_behaviour(model(), n=3)
    v1 = [dataclasses.replace(r, behaviour_logprobs=None) for r in rows]
    upd = GRPOUpdate(model(), TrainConfig(rollout_correction="token_tis", mini_batches=1))
    with pytest.raises(UpdateError, match="behaviour_logprobs.*re-purify"):
        upd.minibatch(mini_batches(v1, 1)[0], pad_id=0)


def _v1_shard(cfg, root):
    """The run's purified rows written as a version-1 shard (no behaviour log-probs) under a copy of the run."""
    import shutil

    from storage.schemas import PURIFIED
    from storage.shards import read_shard

    src = RunLayout(cfg.storage.root, "w").purified_dir(0, "saar", 0.5)
    table = read_shard(src, PURIFIED)
    shutil.copytree(
        cfg.storage.root / "runs" / "w" / "iteration=0000" / "raw", root / "runs" / "w" / "iteration=0000" / "raw"
    )
    part = RunLayout(root, "w").purified_dir(0, "saar", 0.5)
    write_shard(part, table.select(PURIFIED_V1.names).cast(PURIFIED_V1), PURIFIED_V1, "v1")
    c = cfg.model_copy(deep=True)
    c.storage.root = root
    return c, part


def test_v1_shard_asked_for_correction_is_one_line_naming_the_file(purified_run, tmp_path):
    cfg, part = _v1_shard(purified_run, tmp_path)
    cfg.train.rollout_correction = "token_tis"
    with pytest.raises(UpdateError) as e:
        run_update_stage(cfg, "w", 0, log=lambda *_: None)
    msg = str(e.value)
    assert "\n" not in msg and str(part) in msg and "purified/1" in msg and "re-purify" in msg
    assert not RunLayout(tmp_path, "w").checkpoint_dir(1).exists()  # nothing written
    cfg.train.rollout_correction = "off"  # the same shard still trains without the correction
    _, _, rows = load_rows(cfg, "w", 0)
    assert rows and all(r.behaviour_logprobs is None for r in rows)


def test_v2_shard_rows_carry_behaviour_log_probs_into_the_batch(purified_run):
    _, _, rows = load_rows(purified_run, "w", 0)
    assert rows and all(len(r.behaviour_logprobs) == len(r.response_ids) for r in rows)
    mb = collate(rows[:6], pad_id=0)
    for i, r in enumerate(rows[:6]):
        p = len(r.prompt_ids)
        for k, bit in enumerate(r.loss_mask):
            want = r.behaviour_logprobs[k] if bit else 0.0
            assert mb.rollout_log_probs[i, p - 1 + k].item() == pytest.approx(want, abs=1e-7)
    # a real purified partition trains with a correction on, and logs the share it filtered
    cfg = purified_run.model_copy(deep=True)
    cfg.train.rollout_correction, cfg.train.mini_batches = "token_tis", 1
    upd = GRPOUpdate(model(), cfg.train)
    metrics = upd.minibatch(mini_batches(rows, 1)[0], pad_id=0)
    assert metrics.correction_filtered is not None and 0.0 <= metrics.correction_filtered <= 1.0
    assert math.isfinite(metrics.loss)
