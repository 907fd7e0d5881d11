"""The GRPO update on OpenRLHF: loss/gradients against a hand-written reference, learning direction,
exact resume, and refusals; real tiny policy, real purified shards."""

from __future__ import annotations

import dataclasses
import math
import random
import shutil
import json
import os
import sys

import pytest

from storage.errors import CleanerError
import torch
from transformers import AutoModelForCausalLM

from pipeline.config import DEFAULT_POLICY, TrainConfig
from pipeline.trajectory import PurifiedTrajectory, purified_from_row
from storage.layout import RunLayout
from storage.schemas import METRICS, PURIFIED
from storage.shards import read_shard
from trainer import openrlhf_compat
from trainer.batches import TRAINING_COLUMNS, collate, micro_batches, mini_batches, training_rows
from trainer.grpo import GRPOUpdate, UpdateError
from trainer.inputs import check_compatible
from trainer.stage import run_update_stage
from storage.checkpoints import DONE_MARKER


def model():
    return AutoModelForCausalLM.from_pretrained(DEFAULT_POLICY, dtype=torch.float32, attn_implementation="eager")


def rows_of(cfg) -> list[PurifiedTrajectory]:
    d = RunLayout(cfg.storage.root, "w").purified_dir(0, "saar", 0.5)
    return [purified_from_row(r) for r in read_shard(d, PURIFIED).to_pylist()]


def noisy_sequences(m, n: int, rng: random.Random):
    """(i, prompt, response, loss mask, old log-probs) of n random rows whose old log-probs are the model's own
    plus noise, so ratios spread over both clip edges; the caller may draw more from rng between rows."""
    for i in range(n):
        prompt = [rng.randrange(5, 500) for _ in range(rng.randint(4, 8))]
        resp = [rng.randrange(5, 500) for _ in range(rng.randint(5, 12))]
        mask = [int(rng.random() < 0.8) for _ in resp]
        with torch.no_grad():
            logp = torch.log_softmax(m(torch.tensor([prompt + resp])).logits[0], -1)
        yield (
            i,
            prompt,
            resp,
            mask,
            [logp[len(prompt) + k - 1, t].item() + rng.uniform(-0.6, 0.6) for k, t in enumerate(resp)],
        )


def synthetic_rows(m, n=6, seed=0) -> list[PurifiedTrajectory]:
    """Rows whose old log-probs are the model's own plus noise, so ratios spread over both clip edges."""
    rng = random.Random(seed)
    rows = []
    for i, prompt, resp, mask, old in noisy_sequences(m, n, rng):
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
                [1] * len(resp),
                1.0,
                rng.choice([-1.5, -0.5, 0.7, 1.2]),
                [],
                -1,
                0,
                True,
            )
        )
    return rows


def reference_loss(m, rows, cfg: TrainConfig) -> torch.Tensor:
    """GRPO/DAPO token-mean loss with clip-higher and dual-clip, written independently of OpenRLHF."""
    total, count = 0.0, 0
    for r in rows:
        seq = torch.tensor([r.prompt_ids + r.response_ids])
        logp = torch.log_softmax(m(seq).logits[0].float(), -1)
        p = len(r.prompt_ids)
        for k, tok in enumerate(r.response_ids):
            if not r.loss_mask[k]:
                continue
            ratio = torch.exp(logp[p + k - 1, tok] - r.old_logprobs[k])
            a = r.advantage
            s1, s2 = ratio * a, torch.clamp(ratio, 1 - cfg.clip_eps_low, 1 + cfg.clip_eps_high) * a
            obj = torch.minimum(s1, s2)
            if a < 0:
                obj = torch.maximum(obj, torch.tensor(cfg.dual_clip * a))
            total = total - obj
            count += 1
    return total / count


def test_loss_and_gradients_match_a_hand_written_grpo_loss():
    cfg = TrainConfig(micro_batch_tokens=40, mini_batches=1, lr=1e-3)
    m1, m2 = model(), model()
    rows = synthetic_rows(m1)
    upd = GRPOUpdate(m1, cfg)
    (groups,) = mini_batches(rows, 1)
    micros = micro_batches(groups, cfg.micro_batch_tokens, 0)
    assert len(micros) > 1  # accumulation over several micro-batches is part of what is checked
    tokens = sum(mb.num_actions for mb in micros)
    m1.zero_grad()
    got = 0.0
    for mb in micros:
        logp = upd.actor(mb.sequences, mb.action_mask, attention_mask=mb.attention_mask)
        loss, *_ = upd.loss_fn(
            logp, mb.old_log_probs, mb.advantages, action_mask=mb.action_mask, batch_num_tokens=tokens
        )
        loss.backward()
        got += loss.item()
    want = reference_loss(m2, rows, cfg)
    want.backward()
    assert got == pytest.approx(want.item(), abs=1e-6)
    for (name, a), (_, b) in zip(m1.named_parameters(), m2.named_parameters()):
        assert torch.allclose(a.grad, b.grad, atol=1e-6), name


def test_batches_follow_openrlhf_shift():
    rows = synthetic_rows(model(), n=2)
    mb = collate(rows, pad_id=0)
    r = rows[0]
    p = len(r.prompt_ids)
    assert mb.action_mask.shape[1] == mb.sequences.shape[1] - 1
    for k, bit in enumerate(r.loss_mask):
        assert mb.action_mask[0, p - 1 + k] == bit and mb.sequences[0, p + k] == r.response_ids[k]


def test_one_update_moves_log_probs_the_way_advantages_say(purified_run):
    rows = [r for r in rows_of(purified_run) if r.advantage != 0]
    m = model()
    mb = collate(rows, 0)

    def means():
        with torch.no_grad():
            logp = torch.log_softmax(m(mb.sequences, attention_mask=mb.attention_mask).logits[:, :-1].float(), -1)
            tok = logp.gather(-1, mb.sequences[:, 1:, None])[..., 0]
        pos, neg = (mb.advantages > 0) & (mb.action_mask > 0), (mb.advantages < 0) & (mb.action_mask > 0)
        return tok[pos].mean().item(), tok[neg].mean().item()

    before = means()
    upd = GRPOUpdate(m, TrainConfig(lr=2e-4, warmup_steps=0, mini_batches=1))
    from trainer.grpo import UpdateProgress

    upd.run(rows, 0, UpdateProgress())
    after = means()
    assert after[0] > before[0] and after[1] < before[1]


def _update_cfg(cfg, root):
    c = cfg.model_copy(deep=True)
    c.storage.root = root
    c.train.mini_batches, c.train.lr = 3, 1e-4
    return c


def test_resume_after_a_minibatch_gives_identical_weights(purified_run, tmp_path):
    straight, resumed = tmp_path / "a", tmp_path / "b"
    for root in (straight, resumed):
        shutil.copytree(purified_run.storage.root / "runs", root / "runs")
    a = run_update_stage(_update_cfg(purified_run, straight), "w", 0, log=lambda *_: None)
    partial = run_update_stage(_update_cfg(purified_run, resumed), "w", 0, stop_after=1, log=lambda *_: None)
    assert partial.name.endswith(".partial") and (partial / "progress.json").is_file()
    assert not (RunLayout(resumed, "w").checkpoint_dir(1) / DONE_MARKER).exists()
    b = run_update_stage(_update_cfg(purified_run, resumed), "w", 0, log=lambda *_: None)
    # the LR of every step, interrupted mid-warmup or not: lr * min(1, (s + 1) / warmup_steps)
    c = _update_cfg(purified_run, resumed)
    assert c.train.warmup_steps == 2 and c.train.epochs * c.train.mini_batches == 3
    want = [c.train.lr * min(1.0, (s + 1) / 2) for s in range(3)]
    for root in (straight, resumed):
        rows = read_shard(RunLayout(root, "w").metrics_dir(0, "update"), METRICS).to_pylist()
        assert [r["value"] for r in sorted(rows, key=lambda r: r["step"]) if r["name"] == "lr"] == want
    wa = AutoModelForCausalLM.from_pretrained(a).state_dict()
    wb = AutoModelForCausalLM.from_pretrained(b).state_dict()
    assert all(torch.equal(wa[k], wb[k]) for k in wa)
    assert not partial.exists()
    assert not all(torch.equal(wa[k], model().state_dict()[k]) for k in wa)  # it did train


def test_existing_checkpoint_is_never_overwritten(purified_run, tmp_path):
    shutil.copytree(purified_run.storage.root / "runs", tmp_path / "runs")
    cfg = _update_cfg(purified_run, tmp_path)
    target = run_update_stage(cfg, "w", 0, log=lambda *_: None)
    before = (target / "model.safetensors").read_bytes()
    umask = os.umask(0)
    os.umask(umask)  # the weights are readable as the umask says (safetensors wrote them 0600)
    assert (target / "model.safetensors").stat().st_mode & 0o777 == 0o666 & ~umask
    assert run_update_stage(cfg, "w", 0, log=lambda *_: None) == target  # the same settings: kept
    cfg.train.lr = 1e-2  # other settings: refused (it is not what they would have trained), never overwritten
    with pytest.raises(CleanerError, match="committed by an update with other train settings"):
        run_update_stage(cfg, "w", 0, log=lambda *_: None)
    assert (target / "model.safetensors").read_bytes() == before


def _purified_with(cfg, root, rows, extra):
    from storage.shards import write_shard
    import pyarrow as pa
    from pipeline.trajectory import purified_to_row

    shutil.copytree(
        cfg.storage.root / "runs" / "w" / "iteration=0000" / "raw", root / "runs" / "w" / "iteration=0000" / "raw"
    )
    table = pa.Table.from_pylist([purified_to_row(r) for r in rows], schema=PURIFIED)
    write_shard(RunLayout(root, "w").purified_dir(0, "saar", 0.5), table, PURIFIED, "t", extra=extra)
    c = cfg.model_copy(deep=True)
    c.storage.root = root
    return c


def test_empty_shard_is_a_clear_error(purified_run, tmp_path):
    cfg = _purified_with(purified_run, tmp_path, [], {})
    with pytest.raises(UpdateError, match="has no rows"):
        run_update_stage(cfg, "w", 0, log=lambda *_: None)
    assert not RunLayout(tmp_path, "w").checkpoint_dir(1).exists()


def test_all_groups_filtered_is_a_documented_skip(purified_run, tmp_path):
    cfg = _purified_with(purified_run, tmp_path, [], {"filtered_groups": 16})
    target = run_update_stage(cfg, "w", 0, log=lambda *_: None)
    assert (target / "model.safetensors").read_bytes() == (DEFAULT_POLICY / "model.safetensors").read_bytes()
    assert "all groups filtered" in (target / DONE_MARKER).read_text()


def test_nan_loss_fails_without_a_checkpoint(purified_run, tmp_path):
    rows = [dataclasses.replace(r, old_logprobs=[math.nan] * len(r.old_logprobs)) for r in rows_of(purified_run)]
    cfg = _purified_with(purified_run, tmp_path, rows, {})
    with pytest.raises(FloatingPointError, match="policy loss is nan"):
        run_update_stage(cfg, "w", 0, log=lambda *_: None)
    assert not (RunLayout(tmp_path, "w").checkpoint_dir(1) / DONE_MARKER).exists()


def test_mismatched_tokenizer_or_checkpoint(purified_run):
    rows = rows_of(purified_run)
    m = model()
    bad = [dataclasses.replace(rows[0], response_ids=rows[0].response_ids + [50_000])]
    with pytest.raises(UpdateError, match="outside the model's vocabulary"):
        check_compatible(DEFAULT_POLICY, m, bad, None)

    class Other:
        extra = {"policy_version": "0123456789abcdef"}

    with pytest.raises(UpdateError, match="not the policy that sampled"):
        check_compatible(DEFAULT_POLICY, m, rows, Other())


def test_flash_attn_shim_is_never_used_for_computation(purified_run):
    import importlib.util

    if importlib.util.find_spec("flash_attn_2_cuda") is not None and openrlhf_compat.SHIM is None:
        pytest.skip("the real flash_attn_2_cuda is installed: no shim")
    openrlhf_compat.openrlhf_models()
    assert sys.modules["flash_attn_2_cuda"] is openrlhf_compat.SHIM
    upd = GRPOUpdate(model(), TrainConfig(mini_batches=1))
    from trainer.grpo import UpdateProgress

    upd.run(rows_of(purified_run)[:8], 0, UpdateProgress())
    assert openrlhf_compat.SHIM.touched == []
    with pytest.raises(RuntimeError, match="not available on CPU"):
        openrlhf_compat.SHIM.fwd  # any kernel call would fail loudly, not silently compute


def test_training_rows_hold_what_the_purified_rows_hold(purified_run):
    """The update reads only TRAINING_COLUMNS, column-wise: the same values as the full domain rows, and
    the same micro-batch tensors."""
    d = RunLayout(purified_run.storage.root, "w").purified_dir(0, "saar", 0.5)
    full = [purified_from_row(r) for r in read_shard(d, PURIFIED).to_pylist()]
    lean = training_rows(read_shard(d, PURIFIED, columns=TRAINING_COLUMNS))
    assert len(lean) == len(full) > 0
    for a, b in zip(lean, full):
        assert all(getattr(a, c) == getattr(b, c) for c in TRAINING_COLUMNS)
    x, y = collate(lean[:5], 0), collate(full[:5], 0)
    for field in ("sequences", "attention_mask", "action_mask", "old_log_probs", "advantages"):
        assert torch.equal(getattr(x, field), getattr(y, field))
    assert x.rows == y.rows


def test_a_checkpoint_records_its_train_settings_and_earlier_ones_are_kept(tmp_path):
    """committed_update: a checkpoint of an earlier cleaner (no train_settings in its record) is kept as before;
    one recorded with other settings is refused; an unreadable record is named."""
    from storage.checkpoints import DONE_MARKER, committed_update

    assert committed_update(tmp_path / "none", "abc") is False
    marker = tmp_path / DONE_MARKER
    marker.write_text(json.dumps({"source": "policy"}))
    assert committed_update(tmp_path, "abc") is True
    marker.write_text(json.dumps({"train_settings": "abc"}))
    assert committed_update(tmp_path, "abc") is True
    with pytest.raises(
        CleanerError, match="other train settings or by an earlier cleaner \\(config hash abc, now xyz\\)"
    ):
        committed_update(tmp_path, "xyz")
    marker.write_text("{")
    with pytest.raises(CleanerError, match="_CHECKPOINT.json: unreadable"):
        committed_update(tmp_path, "abc")
