"""The purification modes of issue 19 §2 — saar_correct, mask_failed, roc — replayed from stored raw shards
through the real Beam stage: what each row trains on, the advantages, RoC's selection, partition names and
config hashes (existing partitions must stay valid)."""

from __future__ import annotations

import collections
import copy

import pyarrow as pa
import pytest

from flows.cli import build_parser
from pipeline.config import ConfigError, load_config
from pipeline.kinds import failed_call, trajectory_kind
from pipeline.modes import MODES, Variant, partition_measure, partition_threshold
from pipeline.similarity import REFERENCE_MEASURE, Measure
from pipeline.trajectory import purified_from_row, purified_to_row, trajectory_from_row
from purifier.advantages import group_advantages
from purifier.batch import with_advantages
from purifier.roc import ROC_PENALTY, roc_penalties, roc_plan, roc_seed
from purifier.saar import purify
from purifier.stage import purify_identity, run_purify_stage
from pipeline.variants import plan_variants
from purifier.unspliced import purified_table, unspliced_mask
from storage.catalog import Catalog
from storage.layout import RunLayout
from storage.schemas import PURIFIED, RAW
from storage.shards import ShardError, read_shard
from tests.scripted_group import NAMES, build_group, write_group
from tests.flow_helpers import rollout_copy

GAMMA = 0.5
NEW = ["saar_correct", "mask_failed", "roc"]


def _raw_table(cfg, run_id: str) -> pa.Table:
    return read_shard(RunLayout(cfg.storage.root, run_id).raw_dir(0), RAW)


def _rows(cfg, run_id: str, mode: str) -> dict:
    d = RunLayout(cfg.storage.root, run_id).purified_dir(0, mode, partition_threshold(mode, GAMMA))
    return {r["raw_key"]: purified_from_row(r) for r in read_shard(d, PURIFIED).to_pylist()}


@pytest.fixture(scope="module")
def real(world_rollout, tmp_path_factory):
    cfg = rollout_copy(world_rollout, tmp_path_factory, "modes-real")
    run_purify_stage(cfg, "w", 0, plan_variants(cfg, list(MODES), [GAMMA]))
    return cfg


@pytest.fixture(scope="module")
def scripted(chat, sandbox, tmp_path_factory):
    root = tmp_path_factory.mktemp("modes-scripted")
    write_group(root, build_group(chat, sandbox))
    cfg = load_config(None, [f"storage.root={root}", f"rollout.samples_per_prompt={len(NAMES)}"])
    run_purify_stage(cfg, "s", 0, plan_variants(cfg, ["raw", "roc"], [GAMMA]))
    return cfg


# ---- names, hashes, config -------------------------------------------------------------------------


def test_gamma_and_measure_name_the_splicing_modes_only(real):
    assert [partition_threshold(m, GAMMA) for m in NEW] == [GAMMA, 0.0, 0.0]
    assert [partition_measure(m, REFERENCE_MEASURE) for m in NEW] == ["difflib-segment", "", ""]
    other = real.model_copy(deep=True)
    other.rollout.saar.similarity = "difflib"
    run_purify_stage(other, "w", 0, plan_variants(other, ["saar_correct", "roc"], [GAMMA]))
    it = RunLayout(real.storage.root, "w").iteration_dir(0) / "purified"
    assert sorted(p.name for p in (it / "mode=saar_correct").iterdir()) == ["gamma=0.50", "gamma=0.50-difflib-segment"]
    assert sorted(p.name for p in (it / "mode=roc").iterdir()) == ["gamma=0.00"]
    with Catalog(real.storage.root) as cat:
        measures = cat.query(
            "SELECT DISTINCT mode, measure FROM purified WHERE mode IN ('saar_correct', 'roc') ORDER BY ALL"
        ).to_pylist()
    assert [(m["mode"], m["measure"]) for m in measures] == [
        ("roc", None),
        ("saar_correct", "difflib-segment"),
        ("saar_correct", "rapidfuzz-segment"),
    ]


def test_every_variant_hashes_one_record_and_a_mode_setting_only_its_mode():
    """Golden values of the one record (issue 28): a new purify setting must not invalidate committed partitions
    (settings left out of the hash: replay and mode settings), and a mode's own setting only that mode's."""
    cfg = load_config(None, [])
    assert purify_identity(cfg, Variant.of("saar", 0.5), "rawhash").value == "c50811d5d948a6cc"
    assert purify_identity(cfg, Variant.of("raw", 0.0), "rawhash").value == "dcc16b6b0b382d87"
    assert purify_identity(cfg, Variant.of("void_turn", 0.0), "rawhash").value == "d3af88001cb421bb"
    assert purify_identity(cfg, Variant.of("saar", 0.5, Measure("difflib")), "rawhash").value == "f837ded6173116ea"
    two, three = (load_config(None, [f"purify.roc_group_size={k}"]) for k in (2, 3))
    assert (
        purify_identity(two, Variant.of("saar", 0.5), "h").value
        == purify_identity(three, Variant.of("saar", 0.5), "h").value
    )
    assert (
        purify_identity(two, Variant.of("roc", 0.0), "h").value
        != purify_identity(three, Variant.of("roc", 0.0), "h").value
    )
    assert (
        purify_identity(cfg, Variant.of("roc", 0.0), "h").value
        == purify_identity(two, Variant.of("roc", 0.0), "h").value
    )  # default: 4 // 2


def test_one_measure_setting_the_old_purify_keys_say_where_they_went():
    for key in ("similarity=difflib", "similarity_on=code"):
        with pytest.raises(
            ConfigError,
            match=rf"config key 'purify\.{key.split('=')[0]}' merged into "
            rf"rollout\.saar\.{key.split('=')[0]} ",
        ):
            load_config(None, [f"purify.{key}"])


def test_a_partition_committed_with_another_hash_is_refused_in_one_line_that_says_how_to_repurify(world_copy):
    """A partition an earlier cleaner committed (its hash left out the default measure) is never overwritten."""
    import json

    cfg = world_copy
    cfg.purify.modes, cfg.purify.gammas = ["raw"], [0.5]
    run_purify_stage(cfg, "w", 0)
    out = RunLayout(cfg.storage.root, "w").purified_dir(0, "raw", 0.0)
    manifest = json.loads((out / "_MANIFEST.json").read_text())
    manifest["config_hash"] = "fef87f5b0d2a6b5c"  # as committed before the one record
    (out / "_MANIFEST.json").write_text(json.dumps(manifest))
    with pytest.raises(ShardError) as e:
        run_purify_stage(cfg, "w", 0)
    message = str(e.value)
    assert "\n" not in message and "config hash fef87f5b0d2a6b5c" in message
    assert f"remove {out} and" in message and "cleaner purify --run w --iteration 0" in message


def test_roc_group_size_is_validated_and_the_modes_are_choices():
    with pytest.raises(
        ConfigError, match=r"purify.roc_group_size \(5\) must be at most rollout.samples_per_prompt \(4\)"
    ):
        load_config(None, ["purify.roc_group_size=5"])
    with pytest.raises(ConfigError, match="purify.roc_group_size: Input should be greater than or equal to 1"):
        load_config(None, ["purify.roc_group_size=0"])
    assert load_config(None, ["train.mode=roc", "purify.modes=[saar_correct,mask_failed,roc]"]).train.mode == "roc"
    args = build_parser().parse_args(["replay", "--mode", *NEW])
    assert args.mode == NEW
    with pytest.raises(SystemExit):
        build_parser().parse_args(["replay", "--mode", "saar_wrong"])


# ---- advantages and what each row trains on --------------------------------------------------------


def test_every_mode_but_roc_trains_each_row_with_the_raw_partitions_advantage(real):
    """Purification changes no reward, and advantages depend on rewards only: before or after, same numbers."""
    raw = _rows(real, "w", "raw")
    assert len(raw) == 64 and len({r.advantage for r in raw.values()}) > 1
    for mode in set(MODES) - {"roc", "raw"}:
        rows = _rows(real, "w", mode)
        assert rows.keys() == raw.keys(), mode
        assert all(rows[k].advantage == raw[k].advantage and rows[k].reward == raw[k].reward for k in raw), mode


def test_saar_correct_is_saar_on_correct_rows_and_exactly_raw_on_the_others(real):
    saar, raw, ours = (_rows(real, "w", m) for m in ("saar", "raw", "saar_correct"))
    spliced_correct = spliced_wrong = 0
    for k, row in ours.items():
        same = saar[k] if row.reward > 0 else raw[k]
        assert (row.response_ids, row.loss_mask, row.splices, row.recompute_from) == (
            same.response_ids,
            same.loss_mask,
            same.splices,
            same.recompute_from,
        ), k
        assert row.old_logprobs == pytest.approx(same.old_logprobs, abs=1e-5)
        spliced_correct += bool(saar[k].splices) and row.reward > 0
        spliced_wrong += bool(saar[k].splices) and row.reward <= 0
    assert spliced_correct and spliced_wrong  # both rules were exercised


def _tag_failed_turns(t, tag: int = 1 << 24):
    t = copy.deepcopy(t)
    for p in t.positions:
        for a in p.attempts:
            if failed_call(a):
                a.turn_ids = [i + tag for i in a.turn_ids]
    return t


def test_mask_failed_masks_the_failed_turns_of_recovered_correct_rows_only(real, chat):
    raws = {t.key: t for t in (trajectory_from_row(r) for r in _raw_table(real, "w").to_pylist())}
    raw, ours = _rows(real, "w", "raw"), _rows(real, "w", "mask_failed")
    decode = lambda ids: chat.decode([i % (1 << 24) for i in ids])  # noqa: E731
    masked_rows = 0
    for k, row in ours.items():
        assert row.response_ids == raw[k].response_ids
        tagged = purify(_tag_failed_turns(raws[k]), GAMMA, "mask_failed", decode)
        failed_turn = [tok >= 1 << 24 for tok in tagged.response_ids]
        assert tagged.loss_mask == row.loss_mask
        if raws[k].reward > 0 and trajectory_kind(raws[k]) == "recovered":
            masked_rows += 1
            assert any(failed_turn) and not any(m for m, f in zip(row.loss_mask, failed_turn) if f)
            assert [m for m, f in zip(row.loss_mask, failed_turn) if not f] == [
                m for m, f in zip(raw[k].loss_mask, failed_turn) if not f
            ]
        else:
            assert row.loss_mask == raw[k].loss_mask
    assert masked_rows >= 1


@pytest.mark.parametrize("mode", NEW)
def test_rows_with_nothing_to_splice_equal_purify_on_the_columnar_path(real, chat, mode):
    raw = _raw_table(real, "w")
    mask = unspliced_mask(raw)
    fast = purified_table(raw.filter(pa.array(mask)), mode, GAMMA).to_pylist()
    slow = [
        purified_to_row(purify(trajectory_from_row(r), GAMMA, mode, chat.decode))
        for r, m in zip(raw.to_pylist(), mask)
        if m
    ]
    assert 0 < len(fast) == len(slow)
    nan_free = lambda r: {k: v for k, v in r.items() if k != "advantage"}  # noqa: E731 - nan before the group stage
    assert [nan_free(r) for r in fast] == [nan_free(r) for r in slow]


# ---- RoC ---------------------------------------------------------------------------------------------


def test_roc_plan_keeps_cleanest_positives_and_samples_negatives_uniformly():
    samples = list(range(8))
    rewards = [1, -1, 1, -1, 1, -1, -1, -1]
    penalties = [0.9, 0.0, 0.1, 0.0, 0.5, 0.0, 0.0, 0.0]
    kept = roc_plan(samples, rewards, penalties, 4, seed=7)
    assert kept == sorted(kept) and len(kept) == 4
    assert [i for i in kept if rewards[i] > 0] == [2, 4]  # 3 of 8 positive → round(1.5) = 2, lowest penalties
    assert kept == roc_plan(samples, rewards, penalties, 4, seed=7)  # deterministic
    picks = collections.Counter(
        i for s in range(3000) for i in roc_plan(samples, rewards, penalties, 4, s) if rewards[i] <= 0
    )
    assert set(picks) == {1, 3, 5, 6, 7} and all(abs(c / 6000 - 0.2) < 0.03 for c in picks.values())  # uniform
    assert roc_plan(samples[:3], rewards[:3], penalties[:3], 4, 0) == [0, 1, 2]  # small group kept whole
    mostly_right = [1] * 7 + [-1]  # 7 of 8 positive → round(3.5) = 4, but a kept group never loses its negatives
    assert [mostly_right[i] for i in roc_plan(samples, mostly_right, [0.0] * 8, 4, 0)].count(-1) == 1
    assert roc_plan(samples, [1] * 8, penalties, 2, 0) == [1, 3]  # all positive: the lowest penalties, ties by sample
    assert roc_seed(3, "p") == roc_seed(3, "p") != roc_seed(4, "p")


def _penalty(t) -> float:
    attempts = [a for p in t.positions for a in p.attempts]
    ran = [a for a in attempts if a.result is not None and a.result.error_class != "infra"]
    turns = attempts + ([t.final_turn] if t.final_turn is not None else [])
    errors = sum(map(failed_call, ran)) / len(ran) if ran else 0.5
    return errors + sum(a.call_status in ("unclosed", "bad_json", "unknown_tool") for a in turns) / max(1, len(turns))


def test_roc_penalties_read_the_attempt_tree(real, scripted):
    by_hand = {
        "clean_correct": 0.0,
        "clean_wrong": 0.0,
        "recovered_correct": 0.5,
        "recovered_wrong": 0.5,
        "exhausted": 1.0,
        "gave_up": 1.0,
        "infra": 1.0,
        "gate_off": 1.0,
        "malformed_recovered": 0.5 + 1 / 3,
    }
    assert roc_penalties(_raw_table(scripted, "s")).tolist() == pytest.approx([by_hand[n] for n in NAMES])
    raw = _raw_table(real, "w")
    assert roc_penalties(raw.slice(5)).tolist() == pytest.approx(
        [_penalty(trajectory_from_row(r)) for r in raw.slice(5).to_pylist()]
    )


def test_roc_partition_keeps_the_planned_rows_with_advantages_of_the_kept_group(scripted):
    rows, raw = _rows(scripted, "s", "roc"), _rows(scripted, "s", "raw")
    by_sample = {r.sample_idx: r for r in rows.values()}
    assert len(rows) == len(NAMES) // 2 == 4  # default roc_group_size: half the samples per prompt
    # 4 of 9 positive → round(1.78) = 2 positives: the two with the lowest penalty (clean 0.0, recovered 0.5)
    assert sorted(i for i, r in by_sample.items() if r.reward > 0) == [
        NAMES.index("clean_correct"),
        NAMES.index("recovered_correct"),
    ]
    assert sum(r.reward <= 0 for r in rows.values()) == 2
    kept = sorted(by_sample)
    want = group_advantages([by_sample[i].reward for i in kept], "group_norm")
    assert [by_sample[i].advantage for i in kept] == pytest.approx(want)
    assert all(r.response_ids == raw[k].response_ids and r.loss_mask == raw[k].loss_mask for k, r in rows.items())


def test_roc_on_a_real_rollout_and_its_pure_core(real):
    rows = list(_rows(real, "w", "roc").values())
    groups = collections.defaultdict(list)
    for r in rows:
        groups[r.prompt_id].append(r)
    assert len(groups) == 16 and all(len(g) == 2 for g in groups.values())  # 4 samples → 2 kept
    for g in groups.values():
        assert [r.advantage for r in g] == pytest.approx(group_advantages([r.reward for r in g], "group_norm"))
    table = read_shard(RunLayout(real.storage.root, "w").purified_dir(0, "raw", 0.0), PURIFIED)
    with pytest.raises(ValueError, match=ROC_PENALTY):
        with_advantages(table, "group_norm", False, 2)
    raw = _raw_table(real, "w")
    penalty = dict(zip(zip(raw["prompt_id"].to_pylist(), raw["sample_idx"].to_pylist()), roc_penalties(raw)))
    kept = {(r.prompt_id, r.sample_idx) for r in rows}
    compared = 0
    for prompt, reward, sample in zip(
        raw["prompt_id"].to_pylist(), raw["reward"].to_pylist(), raw["sample_idx"].to_pylist()
    ):
        if reward > 0 and (prompt, sample) not in kept:  # a dropped positive: no kept positive is worse
            worse = [penalty[k] for k in kept if k[0] == prompt and groups_reward(rows, k) > 0]
            compared += bool(worse)
            assert all(w <= penalty[(prompt, sample)] for w in worse)
    assert compared > 0


def groups_reward(rows, key) -> float:
    return next(r.reward for r in rows if (r.prompt_id, r.sample_idx) == key)
