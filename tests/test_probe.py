"""The gradient probe (experiments/probe.py, issue 46 item 4) on real components: partitions of a raw shard lived
through the real agent loop, tokenizer and sandbox (tests/scripted_group.py), purified by the project's code and
checked against it; the readout against a direct forward of the committed tiny policy; one seed end to end."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from experiments import probe
from pipeline.chat import IM_END, load_chat, parse_tool_call, render_tool_call
from pipeline.config import DEFAULT_POLICY, WorldConfig, load_config
from pipeline.kinds import failed_call
from pipeline.modes import live_measure
from pipeline.policy_model import load_causal_lm
from purifier.saar import purify
from storage.layout import RunLayout
from storage.schemas import RAW
from storage.shards import read_shard
from tests.scripted_group import NAMES, SCRIPTS, build_group, write_group

# A second prompt whose samples all end correct (two copies of the recovered-and-correct row): advantage 0 in its
# group, so its failed calls are dropped by the *_all partitions only.
TIED = ("recovered_correct", "malformed_recovered")


@pytest.fixture(scope="module")
def store(chat, sandbox, tmp_path_factory):
    root = tmp_path_factory.mktemp("probe-store")
    group = build_group(chat, sandbox)
    tied = [dataclasses.replace(group[NAMES.index(n)], prompt_id="p2", sample_idx=k) for k, n in enumerate(TIED)]
    write_group(root, group + tied)
    cfg = load_config(
        None,
        [f"storage.root={root}", f"rollout.samples_per_prompt={len(NAMES)}", "train.mini_batches=1", "train.epochs=1"],
    )
    cfg.train.device = "cpu"
    return cfg, group, tied


@pytest.fixture(scope="module")
def built(store, chat):
    cfg, _, _ = store
    raw = read_shard(RunLayout(cfg.storage.root, "s").raw_dir(0), RAW)
    return raw, probe.build_partitions(cfg, raw, chat.decode)


def test_partitions_keep_drop_by_advantage_sign(store, built, chat):
    cfg, group, tied = store
    raw, b = built
    assert b.dead == []
    rows = {name: {r["raw_key"]: r for r in t.to_pylist()} for name, t in b.tables.items()}
    assert all(len(r) == len(NAMES) + len(TIED) for r in rows.values())
    measure = live_measure(cfg.rollout.saar)
    for t in group + tied:
        # the sign is the row's reward against its group's mean (here: correct or not; the tied group has 0)
        mean = sum(x.reward for x in (tied if t.prompt_id == "p2" else group)) / len(
            tied if t.prompt_id == "p2" else group
        )
        sign = "neg" if t.reward < mean else "pos" if t.reward > mean else "zero"
        assert probe.sign_of(b.advantage[t.key]) == sign, t.key
        failed = any(failed_call(a) for p in t.positions for a in p.attempts)
        assert failed == (SCRIPTS[NAMES[t.sample_idx] if t.prompt_id == "p1" else TIED[t.sample_idx]][4] != "clean")
        raw_ids = purify(t, 0.5, "raw", chat.decode, measure).response_ids
        saar_ids = purify(t, 0.5, "saar", chat.decode, measure).response_ids
        assert rows["raw"][t.key]["response_ids"] == raw_ids
        assert rows["splice_all"][t.key]["response_ids"] == saar_ids
        for name in probe.PARTITIONS:
            row = rows[name][t.key]
            if not failed:  # rows without a failed call: the same in every partition
                assert row["response_ids"] == raw_ids and row["loss_mask"] == rows["raw"][t.key]["loss_mask"]
        # splice_neg splices exactly the rows under a negative advantage; the failed calls under A > 0 stay
        want_neg = saar_ids if failed and sign == "neg" else raw_ids
        want_pos = saar_ids if failed and sign == "pos" else raw_ids
        assert rows["splice_neg"][t.key]["response_ids"] == want_neg, t.key
        assert rows["splice_pos"][t.key]["response_ids"] == want_pos, t.key
        # masking keeps the sequence and trains none of a failed call's turn
        for name, masks in (("mask_all", failed), ("mask_neg", failed and sign == "neg")):
            row = rows[name][t.key]
            assert row["response_ids"] == raw_ids
            spans = probe.raw_turn_spans(t)
            for _, a, s, e in spans:
                trained = row["loss_mask"][s:e]
                assert trained == ([0] * (e - s) if masks and failed_call(a) else rows["raw"][t.key]["loss_mask"][s:e])
    assert b.failed_rows["neg"] > 0 and b.failed_rows["pos"] > 0 and b.failed_rows["zero"] == len(TIED)
    c = b.counts
    assert c["raw"]["failed_call_tokens_neg"] > 0 and c["raw"]["failed_call_tokens_pos"] > 0
    assert c["splice_neg"]["failed_call_tokens_pos"] == c["raw"]["failed_call_tokens_pos"]
    assert c["mask_neg"]["failed_call_tokens_neg"] == 0 == c["mask_pos"]["failed_call_tokens_pos"]


def test_the_checks_hold_and_can_fail(store, built, chat):
    cfg, _, _ = store
    raw, b = built
    checks = probe.check_partitions(cfg, raw, b, chat.decode)
    assert checks["mask_rows_checked_against_mask_failed"] >= 2  # recovered_correct and its tied copy at least
    swapped = dataclasses.replace(b, tables={**b.tables, "splice_neg": b.tables["splice_pos"]})
    with pytest.raises(AssertionError, match="splice_neg"):
        probe.check_partitions(cfg, raw, swapped, chat.decode)
    unmasked = dataclasses.replace(b, tables={**b.tables, "mask_all": b.tables["raw"]})
    with pytest.raises(AssertionError, match="mask"):
        probe.check_partitions(cfg, raw, unmasked, chat.decode)


def test_readout_is_the_log_odds_a_forward_gives(chat):
    model = load_causal_lm(DEFAULT_POLICY, attn_implementation="eager").eval()
    reasoning = "I will compute 17 + 25 with Python."
    good = chat.encode(f"{reasoning}\n{render_tool_call('print(17 + 25)')}{IM_END}")
    bad = chat.encode(f"{reasoning}\n{render_tool_call('prnt(17 + 25)')}{IM_END}")
    cs = chat.call_start(good)
    assert cs > 0 and good[:cs] == bad[:cs]
    context = chat.prompt_ids("What is 17 + 25?") + good[:cs]
    item = probe.BankItem("What is 17 + 25?", "misspelled_print", context, good[cs:], bad[cs:])

    def direct(call: list[int]) -> float:
        seq = torch.tensor([context + call])
        with torch.no_grad():
            logp = torch.log_softmax(model(input_ids=seq).logits[0].float(), -1)
        return sum(float(logp[len(context) - 1 + k, tok]) for k, tok in enumerate(call))

    (got,) = probe.log_odds(model, [item])
    assert got == pytest.approx(direct(bad[cs:]) - direct(good[cs:]), abs=1e-4)
    assert abs(got) > 1e-3  # the two calls are told apart at all


def test_bank_items_are_the_world_first_calls_with_real_bugs(chat, sandbox):
    world = WorldConfig()
    items = probe.build_bank(chat, world, 3)
    assert len(items) == 3 * 4 and {i.bug for i in items} == {
        "misspelled_print",
        "missing_paren",
        "undefined_name",
        "made_up_method",
    }
    for it in items:
        text = chat.decode(it.context)
        prompt = chat.decode(chat.prompt_ids(it.task))
        assert text.startswith(prompt) and text.endswith("\n") and "<tool_call>" not in text[len(prompt) :]
        right, wrong = (parse_tool_call(chat.decode(c)) for c in (it.correct, it.bugged))
        assert chat.decode(it.correct) == render_tool_call(right.code) + IM_END
        assert sandbox.run(right.code).status == "success", right.code
        assert sandbox.run(wrong.code).status == "failure", (it.bug, wrong.code)
    with pytest.raises(SystemExit, match="held-out tasks"):
        probe.build_bank(chat, world, world.eval_size + 1)


def test_one_seed_end_to_end(store):
    cfg, _, _ = store
    chat = load_chat(DEFAULT_POLICY)
    bank = probe.build_bank(chat, cfg.world, 2)
    r = probe.probe_seed(cfg, "s", bank)
    parts = r["partitions"]
    assert list(parts) == list(probe.PARTITIONS)
    assert all(
        math.isfinite(p["delta"]) and p["optimizer_steps"] == 1 for p in parts.values()
    )  # 1 epoch × 1 mini-batch
    assert parts["raw"]["max_weight_gap_to_run_checkpoint_1"] is None  # this store has no run checkpoint
    # a partition that trains other tokens moves the policy otherwise
    assert parts["mask_neg"]["delta"] != parts["raw"]["delta"]
    assert parts["splice_neg"]["trained_tokens"] < parts["raw"]["trained_tokens"]
    assert r["before"]["mean"] == pytest.approx(
        probe.readout(load_causal_lm(DEFAULT_POLICY, "sdpa").eval(), bank, 1.0)["mean"]
    )


def test_verdicts_read_the_paired_contrasts():
    seeds = {}
    for s in range(5):
        noise = 0.001 * ((s * 7) % 5 - 2)
        base = -0.10 + 0.01 * s
        d = {name: base for name in probe.PARTITIONS}
        d["splice_neg"] = base + 0.05 + noise  # predicted + and found +
        d["splice_pos"] = base + 0.05 - noise  # predicted −, found +
        d["mask_neg"] = base + noise  # nothing to see
        seeds[s] = {"partitions": {k: {"delta": v} for k, v in d.items()}}
    out = {(c["arm"], c["baseline"]): c for c in probe.analyse(seeds)["contrasts"]}
    assert out[("splice_neg", "raw")]["verdict"] == "confirmed"
    assert out[("splice_pos", "raw")]["verdict"] == "refuted"
    assert out[("mask_neg", "raw")]["verdict"] == "left open"
    assert out[("mask_pos", "raw")]["identical_seeds"] == [0, 1, 2, 3, 4]
    assert out[("mask_pos", "raw")]["verdict"] == "not estimable"
