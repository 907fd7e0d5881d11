"""Train-time rollout correction: verl's presets mapped onto OpenRLHF's own PolicyLoss gate.

A purified row trains some tokens in another context than they were sampled in (a spliced retry, a turn
a replay moved). Its `old_logprobs` are recomputed in the purified context (π_old), its
`behaviour_logprobs` are what each token was sampled with (π_behaviour). OpenRLHF 0.11's PolicyLoss takes
the latter as `rollout_log_probs` and gates the importance ratio π_old / π_behaviour
(`is_correction_level`, `is_correction_mode`, `is_correction_gating`, `is_correction_threshold`); nothing
here recomputes what it does.

Each preset: its OpenRLHF PolicyLoss(level, mode, gating, threshold) → what each trained token gets; verl's name.

- `off`: level `off` (no correction argument to the constructor) → PPO loss as is; `disabled`.
- `token_tis`: `token`, `clip`, `ratio`, (0.0, 2.0) → loss × min(ρ_t, 2) (truncated IS; the lower bound 0
  never binds); `decoupled_token_is(threshold=2.0)`.
- `token_mis`: `token`, `mask`, `ratio`, (0.5, 5.0) → ρ_t ∉ [0.5, 5]: dropped; else loss × ρ_t (IcePop);
  `decoupled_token_icepop(5.0, 0.5)`.
- `seq_mis`: `seq`, `mask`, `ratio`, (0.5, 2.0) → the row's geometric-mean ratio exp(mean_t log ρ_t) ∉ [0.5, 2]:
  row dropped; else loss × ρ_t; the sequence MIS band `0.5_2.0` of `decoupled_seq_is_rs`.
- `geo_rs`: `seq`, `mask`, `ratio`, (0.999, 1.001) → the same gate at ±0.1%; `decoupled_geo_rs("0.999_1.001")`.

ρ_t = π_old(t) / π_behaviour(t). Where OpenRLHF differs from verl, cleaner follows OpenRLHF and says so:
its sequence gate reads the per-token geometric mean (verl's `seq_mean_k1`, "geometric"), not the product
over the row that verl's sequence MIS (`seq_sum_k1`) bounds, so `seq_mis` at [0.5, 2] is looser than verl's
on long rows (a 27-token splice whose log-ratios sum to −2.1 has product 0.12 but geometric mean 0.93);
and survivors of a mask keep their per-token ratio as weight (verl's sequence IS weights by the truncated
product). `train.rollout_correction_bounds` replaces a preset's [lower, upper].
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from pipeline.config import TrainConfig


@dataclass(frozen=True)
class Correction:
    level: str  # OpenRLHF is_correction_level: token | seq
    mode: str  # is_correction_mode: clip | mask
    gating: str  # is_correction_gating: ratio
    bounds: tuple[float, float]  # is_correction_threshold: [lower, upper] on the gated ratio
    verl: str  # the verl preset it stands for


PRESETS: dict[str, Correction | None] = {
    "off": None,
    "token_tis": Correction("token", "clip", "ratio", (0.0, 2.0), "decoupled_token_is(threshold=2.0)"),
    "token_mis": Correction(
        "token", "mask", "ratio", (0.5, 5.0), "decoupled_token_icepop(threshold=5.0, threshold_lower=0.5)"
    ),
    "seq_mis": Correction(
        "seq", "mask", "ratio", (0.5, 2.0), "decoupled_seq_is_rs(rs_threshold='0.5_2.0'), geometric mean"
    ),
    "geo_rs": Correction("seq", "mask", "ratio", (0.999, 1.001), "decoupled_geo_rs(rs_threshold='0.999_1.001')"),
}


def correction_of(cfg: TrainConfig) -> Correction | None:
    """The OpenRLHF gate train.rollout_correction asks for, with train.rollout_correction_bounds applied; None: off."""
    preset = PRESETS[cfg.rollout_correction]
    if preset is None or cfg.rollout_correction_bounds is None:
        return preset
    return replace(preset, bounds=tuple(cfg.rollout_correction_bounds))


def policy_loss_kwargs(cfg: TrainConfig) -> dict:
    """The PolicyLoss arguments of the correction: none at all when it is off, so the loss is OpenRLHF's default."""
    c = correction_of(cfg)
    if c is None:
        return {}
    return {
        "is_correction_level": c.level,
        "is_correction_mode": c.mode,
        "is_correction_gating": c.gating,
        "is_correction_threshold": list(c.bounds),
    }
