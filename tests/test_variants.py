"""One plan of purified partitions at the edge: the flow, `cleaner purify`, `cleaner replay` and a direct call of the
purify stage all get theirs from pipeline.variants.plan_variants."""

from __future__ import annotations

from pipeline.config import load_config
from pipeline.modes import Variant
from pipeline.variants import describe, implied_modes, plan_variants, trained_variant
from purifier.stage import run_purify_stage


def _cfg(*overrides: str):
    return load_config(None, ["purify.modes=[saar,raw]", "purify.gammas=[0.5]", *overrides])


def test_nothing_asked_is_the_flows_plan_with_the_trained_partition():
    cfg = _cfg("train.mode=saar_correct", "train.gamma=0.3")
    assert plan_variants(cfg) == [Variant.of("saar", 0.5), Variant.of("raw"), Variant.of("saar_correct", 0.3)]
    assert trained_variant(cfg) == Variant.of("saar_correct", 0.3)
    # the trained γ is the trained mode's, not every splicing mode's
    assert Variant.of("saar", 0.3) not in plan_variants(cfg)


def test_asked_values_with_the_configs_for_the_rest():
    cfg = _cfg()
    assert plan_variants(cfg, gammas=[0.3]) == [Variant.of("saar", 0.3), Variant.of("raw")]
    assert plan_variants(cfg, taus=[0.7]) == [Variant.of("saar_is", 0.7)]
    assert plan_variants(cfg, ["raw"]) == [Variant.of("raw")]
    # replay's own defaults: saar at flow.replay_gammas
    assert plan_variants(cfg, default_modes=["saar"], default_gammas=[0.3, 0.7]) == [
        Variant.of("saar", 0.3),
        Variant.of("saar", 0.7),
    ]
    assert implied_modes(["saar"], [0.3], [0.7]) == ["saar", "saar_is"]
    assert (
        describe(plan_variants(cfg, ["saar", "raw", "saar_is"], [0.3, 0.5], [0.5]))
        == "saar γ 0.3 0.5, raw, saar_is τ 0.5"
    )


def test_a_direct_stage_call_purifies_what_the_flow_would(world_copy):
    """A direct caller of the stage gets the flow's partitions for the same config, train.mode's among them."""
    cfg = world_copy.model_copy(deep=True)
    cfg.purify.modes, cfg.purify.gammas = ["raw"], [0.5]
    cfg.train.mode, cfg.train.gamma = "saar_correct", 0.5
    results = run_purify_stage(cfg, "w", 0)
    assert [r.variant for r in results] == plan_variants(cfg) == [Variant.of("raw"), Variant.of("saar_correct", 0.5)]
