"""Purification modes and how a (mode, γ, measure) names its partition: one owner for the facts the
purifier writes by and the trainer reads by (docs/saar.md §modes)."""
from __future__ import annotations

from typing import Literal, Protocol, get_args

from pipeline.similarity import DEFAULT_MEASURE, Measure


class MeasureSettings(Protocol):
    """What of rollout.saar (pipeline.config.SaarConfig, which imports this module) names a measure."""

    similarity: str
    similarity_on: str

# saar: the SAAR splice; raw: the lived sequence as is; void_turn: failed turns voided (masked).
Mode = Literal["saar", "raw", "void_turn"]
MODES: tuple[Mode, ...] = get_args(Mode)
Variant = tuple[Mode, float]  # one purified partition of an iteration: (mode, γ)


def partition_gamma(mode: str, gamma: float) -> float:
    """γ only matters for `saar`; the other modes live under gamma=0.00 whatever γ was asked."""
    return float(gamma) if mode == "saar" else 0.0


def partition_measure(mode: str, measure: Measure) -> str:
    """The measure's part of a partition name: '' for the default measure and for modes without
    splices (their partitions stay where they always were), else e.g. 'difflib-segment'."""
    return measure.key if mode == "saar" and measure != DEFAULT_MEASURE else ""


def live_measure(saar: MeasureSettings) -> Measure:
    """The measure the live loop decided with (and purification at γ_live must use to relive it)."""
    return Measure(saar.similarity, saar.similarity_on)


def purify_measure(saar: MeasureSettings, similarity: str | None, similarity_on: str | None) -> Measure:
    """purify.similarity / purify.similarity_on, each defaulting to the run's live measure."""
    return Measure(similarity or saar.similarity, similarity_on or saar.similarity_on)
