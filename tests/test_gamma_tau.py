"""γ and τ apart: SAAR's similarity threshold γ and Plan B's importance-ratio threshold τ each have their own name in
the config (train.gamma, train.tau), in purify() (gamma, tau), and in a purified row (`gamma`, `is_threshold`);
a purified shard written when `gamma` also held τ reads as the current version, in Python and in the catalog."""

from __future__ import annotations

import json

import pyarrow as pa
import pytest

from pipeline.config import ConfigError, TrainConfig, hashed_train_settings, load_config, train_settings, upgrade_frozen
from pipeline.modes import Variant
from pipeline.trajectory import purified_to_row, trajectory_to_row
from pipeline.variants import trained_variant
from purifier.saar import purify
from purifier.unspliced import purified_table, unspliced_mask
from storage.catalog import Catalog
from storage.layout import RunLayout
from storage.schemas import PURIFIED, PURIFIED_V2, RAW, schema_id, upgrade
from storage.shards import read_shard, write_shard
from tests.synthetic import synthetic_trajectories

TAU = 0.3


def decode(ids: list[int]) -> str:
    return " ".join(map(str, ids))


def as_sampled(context: list[int], turn: list[int]) -> list[float]:
    """A scorer whose every retry has importance ratio 1 (≥ τ = 0.3: each replaces its failed turn)."""
    return [-1.0] * len(turn)


# ---- config ---------------------------------------------------------------------------------------------------


def test_train_gamma_for_an_importance_ratio_mode_is_one_line_naming_train_tau():
    with pytest.raises(ConfigError) as e:
        load_config(None, ["train.mode=saar_is", "train.gamma=0.3"])
    message = str(e.value)
    assert "\n" not in message and "command line" in message and "train.tau=0.3" in message
    with pytest.raises(ConfigError, match="train.tau: the importance-ratio threshold τ must be a finite number > 0"):
        load_config(None, ["train.mode=saar_is", "train.tau=0"])


def test_train_tau_names_the_trained_importance_ratio_partition():
    cfg = load_config(None, ["train.mode=saar_is", "train.tau=0.3"])
    assert trained_variant(cfg) == Variant.of("saar_is", 0.3)
    assert trained_variant(cfg).partition == "mode=saar_is/tau=0.30"
    # γ given beside τ: valid, and not what names the partition
    both = load_config(None, ["train.mode=saar_is", "train.tau=0.3", "train.gamma=0.7"])
    assert trained_variant(both) == trained_variant(cfg)
    # τ beside a splicing mode changes nothing
    assert trained_variant(load_config(None, ["train.tau=0.9"])) == Variant.of("saar", 0.5)
    assert load_config("configs/demo.yaml", ["train.mode=saar_is", "train.tau=0.5"]).train.tau == 0.5


def test_checkpoint_records_keep_their_hash():
    """A checkpoint records train_settings, and a rerun with other settings is refused: the records written while
    train.gamma held an importance-ratio run's τ (the hashes below) stay valid, and τ is no setting of the other
    modes' updates."""
    assert train_settings(TrainConfig()) == train_settings(TrainConfig(tau=0.9)) == "a9525b51a28d9df6"
    assert train_settings(TrainConfig(mode="saar_correct", gamma=0.3)) == "1c9f7f570381c84c"
    plan_b = TrainConfig(mode="saar_is", tau=TAU)
    assert train_settings(plan_b) == train_settings(TrainConfig(mode="saar_is", tau=TAU, gamma=0.9))
    assert train_settings(plan_b) == "374c90bf88912a98"
    assert "tau" not in hashed_train_settings(plan_b)
    assert train_settings(TrainConfig(mode="saar_is", tau=0.5)) != train_settings(plan_b)


def test_a_run_frozen_with_its_tau_in_train_gamma_reads_with_train_tau():
    frozen = {"train": {"mode": "saar_is", "gamma": TAU, "lr": 1e-4}, "purify": {"modes": ["saar_is"]}}
    up = upgrade_frozen(frozen)
    assert up["train"] == {"mode": "saar_is", "gamma": 0.5, "tau": TAU, "lr": 1e-4} and up["purify"] == frozen["purify"]
    assert frozen["train"]["gamma"] == TAU  # the record read is not changed
    now = {"train": {"mode": "saar_is", "gamma": 0.5, "tau": 0.7}}
    assert upgrade_frozen(now) == now and upgrade_frozen(up) == up
    assert upgrade_frozen({"train": {"mode": "saar", "gamma": TAU}}) == {"train": {"mode": "saar", "gamma": TAU}}
    cfg = load_config(None, [f"train.{k}={json.dumps(v)}" for k, v in up["train"].items()])
    assert trained_variant(cfg) == Variant.of("saar_is", TAU)


# ---- rows -----------------------------------------------------------------------------------------------------


def test_a_purified_row_says_which_threshold_it_carries():
    raws = synthetic_trajectories(8, seed=5, run_id="r")
    for t in raws:
        spliced = purify(t, 0.5, "saar", decode)
        plan_b = purify(t, 0.0, "saar_is", decode, score=as_sampled, tau=TAU)
        assert (spliced.gamma, spliced.is_threshold) == (0.5, None)
        assert (plan_b.gamma, plan_b.is_threshold) == (0.0, TAU)
        assert (purify(t, 0.5, "raw", decode).gamma, purify(t, 0.5, "raw", decode).is_threshold) == (0.0, None)
    with pytest.raises(ValueError, match="tau="):  # the τ of saar_is is never taken from γ
        purify(raws[0], TAU, "saar_is", decode, score=as_sampled)
    table = pa.Table.from_pylist([trajectory_to_row(t) for t in raws], schema=RAW)
    unspliced = table.filter(pa.array(unspliced_mask(table)))
    assert unspliced.num_rows
    fast = purified_table(unspliced, "saar_is", TAU)
    assert set(fast["gamma"].to_pylist()) == {0.0} and set(fast["is_threshold"].to_pylist()) == {TAU}
    fast = purified_table(unspliced, "saar", 0.5)
    assert set(fast["gamma"].to_pylist()) == {0.5} and set(fast["is_threshold"].to_pylist()) == {None}


# ---- a shard written by version 2 ------------------------------------------------------------------------------


def _purified(raws, variant: Variant) -> pa.Table:
    rows = [
        purified_to_row(purify(t, variant.gamma, variant.mode, decode, score=as_sampled, tau=variant.tau)) for t in raws
    ]
    return pa.Table.from_pylist(rows, schema=PURIFIED)


def _as_v2(table: pa.Table) -> pa.Table:
    """Rows as purified version 2 wrote them: an importance-ratio row's τ in `gamma` too."""
    rows = table.to_pylist()
    for r in rows:
        if r["is_threshold"] is not None:
            r["gamma"] = r["is_threshold"]
    return pa.Table.from_pylist(rows, schema=PURIFIED_V2)


@pytest.fixture
def old_store(tmp_path):
    """A run whose iteration 0 was purified by version 2 (saar at γ 0.5, saar_is at τ 0.3 and 0.7) and iteration 1
    by this one: the same raw rows, so both read alike."""
    layout = RunLayout(tmp_path, "old")
    variants = [Variant.of("saar", 0.5), Variant.of("saar_is", TAU), Variant.of("saar_is", 0.7), Variant.of("raw")]
    for iteration in (0, 1):
        raws = synthetic_trajectories(8, seed=5, run_id="old", iteration=iteration)
        write_shard(
            layout.raw_dir(iteration),
            pa.Table.from_pylist([trajectory_to_row(t) for t in raws], schema=RAW),
            RAW,
            config_hash="raw",
        )
        for v in variants:
            table = _purified(raws, v)
            where = layout.purified_dir(iteration, v.mode, v.threshold)
            if iteration == 0:
                write_shard(where, _as_v2(table), PURIFIED_V2, config_hash="v2")
            else:
                write_shard(where, table, PURIFIED, config_hash="v3")
    return layout


def test_a_version_2_shard_reads_with_gamma_alone(old_store):
    layout = old_store
    for tau in (TAU, 0.7):
        old = read_shard(layout.purified_dir(0, "saar_is", tau), PURIFIED)
        new = read_shard(layout.purified_dir(1, "saar_is", tau), PURIFIED)
        assert schema_id(old.schema) == schema_id(PURIFIED) == "purified/3"
        assert set(old["gamma"].to_pylist()) == {0.0} and set(old["is_threshold"].to_pylist()) == {tau}
        same = ["iteration", "raw_key"]  # what differs between the iterations; repr: NaN advantages compare equal
        assert repr(old.drop_columns(same).to_pylist()) == repr(new.drop_columns(same).to_pylist())
        # a reader of some columns gets them as this version has them
        assert set(
            read_shard(layout.purified_dir(0, "saar_is", tau), PURIFIED, columns=["gamma"])["gamma"].to_pylist()
        ) == {0.0}
        assert read_shard(
            layout.purified_dir(0, "saar_is", tau), PURIFIED, columns=["is_threshold", "reward"]
        ).column_names == ["is_threshold", "reward"]
    spliced = read_shard(layout.purified_dir(0, "saar", 0.5), PURIFIED)
    assert set(spliced["gamma"].to_pylist()) == {0.5} and set(spliced["is_threshold"].to_pylist()) == {None}
    # one rule, however the rows come: upgrading v3 rows changes nothing
    new = read_shard(layout.purified_dir(1, "saar_is", TAU), PURIFIED)
    assert repr(upgrade(new, PURIFIED).to_pylist()) == repr(new.to_pylist())


def test_the_catalog_reads_a_version_2_shard_with_gamma_alone(old_store):
    with Catalog(old_store.root) as cat:
        assert not cat.problems
        rows = cat.query(
            "SELECT iteration, mode, gamma, is_threshold, count(*) AS n FROM purified GROUP BY ALL ORDER BY ALL"
        ).to_pylist()
        summary = cat.query(
            "SELECT iteration, mode, gamma, is_threshold, count(*) AS n FROM purified_summary GROUP BY ALL ORDER BY ALL"
        ).to_pylist()
        compare = cat.query(
            "SELECT iteration, mode, gamma, is_threshold, trajectories FROM purify_compare ORDER BY ALL"
        ).to_pylist()
        splices = cat.query(
            "SELECT iteration, is_threshold, count(*) AS n FROM splices WHERE mode = 'saar_is' "
            "GROUP BY ALL ORDER BY ALL"
        ).to_pylist()
        failed = cat.query(
            "SELECT iteration, mode, gamma, is_threshold, trained FROM failed_call_advantage ORDER BY ALL"
        ).to_pylist()
    want = [
        {"iteration": i, "mode": m, "gamma": g, "is_threshold": t, "n": 8}
        for i in (0, 1)
        for m, g, t in (("raw", 0.0, None), ("saar", 0.5, None), ("saar_is", 0.0, TAU), ("saar_is", 0.0, 0.7))
    ]
    assert rows == summary == want
    assert [{k: r[k] for k in ("iteration", "mode", "gamma", "is_threshold")} for r in compare] == [
        {k: r[k] for k in ("iteration", "mode", "gamma", "is_threshold")} for r in want
    ]
    assert [r["n"] for r in splices if r["iteration"] == 0] == [r["n"] for r in splices if r["iteration"] == 1]
    assert len(splices) == 4  # each τ its own partition
    assert [{k: v for k, v in r.items() if k != "iteration"} for r in failed if r["iteration"] == 0] == [
        {k: v for k, v in r.items() if k != "iteration"} for r in failed if r["iteration"] == 1
    ]
    assert len(failed) == 8
