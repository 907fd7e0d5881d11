"""The plan of purified partitions, made once at the edge: the training flow, `cleaner purify`, `cleaner replay` and
a direct call of the purify stage all ask `plan_variants`, and below it a `Variant` travels whole (docs/saar.md
§modes)."""

from __future__ import annotations

from pipeline.config import CleanerConfig
from pipeline.modes import IS_MODES, SPLICING_MODES, Variant, live_measure


def trained_variant(cfg: CleanerConfig) -> Variant:
    """The partition the update trains on: train.mode at its threshold (train.tau for the importance-ratio modes,
    train.gamma for the others), under the live measure."""
    threshold = cfg.train.tau if cfg.train.mode in IS_MODES else cfg.train.gamma
    return Variant.of(cfg.train.mode, threshold, live_measure(cfg.rollout.saar))


def implied_modes(default: list[str], gammas: list[float] | None, taus: list[float] | None) -> list[str]:
    """The modes of a request that gives γ and/or τ but no mode: τ alone asks for saar_is; γ (or neither) the default
    modes, with saar_is beside them when τ is given too."""
    return list(dict.fromkeys([*(default if gammas or not taus else []), *(["saar_is"] if taus else [])]))


def variants_of(modes: list[str], gammas: list[float], taus: list[float], cfg: CleanerConfig) -> list[Variant]:
    """Each γ for the splicing modes, each τ for the importance-ratio modes, one partition for the others, the
    splicing modes under the live measure; in the order asked, without repeats."""
    measure = live_measure(cfg.rollout.saar)  # a replay under another measure overrides rollout.saar
    return list(dict.fromkeys(Variant.of(m, v, measure) for m in modes for v in (taus if m in IS_MODES else gammas)))


def plan_variants(
    cfg: CleanerConfig,
    modes: list[str] | None = None,
    gammas: list[float] | None = None,
    taus: list[float] | None = None,
    *,
    default_modes: list[str] | None = None,
    default_gammas: list[float] | None = None,
) -> list[Variant]:
    """The partitions to purify. Nothing asked: the flow's, purify.modes at purify.gammas / purify.is_thresholds and
    the partition the update trains on. Something asked (a mode, a γ, a τ, or a command's own defaults, as replay's
    saar at flow.replay_gammas): that, with the config's values for what is not asked."""
    if not (modes or gammas or taus or default_modes or default_gammas):
        return list(
            dict.fromkeys(
                [*variants_of(cfg.purify.modes, cfg.purify.gammas, cfg.purify.is_thresholds, cfg), trained_variant(cfg)]
            )
        )
    return variants_of(
        modes or implied_modes(default_modes or cfg.purify.modes, gammas, taus),
        gammas or default_gammas or cfg.purify.gammas,
        taus or cfg.purify.is_thresholds,
        cfg,
    )


def describe(variants: list[Variant]) -> str:
    """What is planned, as the stages log it: γ for the splicing modes, τ for the importance-ratio modes, nothing for
    the others (e.g. 'saar γ 0.3 0.5, raw, saar_is τ 0.5')."""
    by_mode: dict[str, list[float]] = {}
    for v in variants:
        by_mode.setdefault(v.mode, []).append(v.threshold)
    return ", ".join(
        m
        + (
            f" {'τ' if m in IS_MODES else 'γ'} " + " ".join(f"{t:g}" for t in ts)
            if m in IS_MODES or m in SPLICING_MODES
            else ""
        )
        for m, ts in by_mode.items()
    )
