"""Purification modes and how a (mode, γ, measure) names its partition: one owner for the facts the
purifier writes by and the trainer reads by (docs/saar.md §modes)."""
from __future__ import annotations

from typing import Literal, Protocol, get_args

from pipeline.similarity import DEFAULT_MEASURE, Measure


class MeasureSettings(Protocol):
    """What of rollout.saar (pipeline.config.SaarConfig, which imports this module) names a measure."""

    similarity: str
    similarity_on: str

# One line per mode (docs/saar.md, "Purification modes", says more):
#   saar          the SAAR splice at γ on every trajectory (CLEANER)
#   raw           every attempt and error kept: no purification
#   void_turn     raw, with the whole loss zeroed when a turn has neither a complete call nor an answer (SimpleTIR)
#   saar_correct  SAAR at γ on trajectories whose reward is positive; every other trajectory exactly raw
#   mask_failed   raw, with the failed-call turns of recovered-and-correct trajectories masked instead of removed
#   roc           raw, each prompt group down-sampled GRPO-RoC style to purify.roc_group_size before advantages
#   saar_is       Open-CLEANER's Plan B: a retry replaces the failed turn when its importance ratio is ≥ τ, else
#                 the failed turn, its error and the retry all stay (purifier/saar.py)
Mode = Literal["saar", "raw", "void_turn", "saar_correct", "mask_failed", "roc", "saar_is"]
MODES: tuple[Mode, ...] = get_args(Mode)
# one purified partition of an iteration: (mode, threshold), the threshold being γ for the modes that
# splice by similarity, τ for the modes that decide by importance ratio, 0 for the others
Variant = tuple[Mode, float]
# Modes whose threshold is an importance-ratio τ (partition tau=…; storage/layout.py keeps a copy, tested equal)
IS_MODES: tuple[Mode, ...] = ("saar_is",)
# Modes that splice, so γ and the similarity measure decide what they hold and name their partitions
# (storage/catalog.py keeps a copy of this list for its SQL; a test holds them equal).
SPLICING_MODES: tuple[Mode, ...] = ("saar", "saar_correct")


def partition_gamma(mode: str, gamma: float) -> float:
    """A variant's threshold, the `gamma` of its rows: γ for the splicing modes, τ for the importance-ratio
    modes (partition tau=…); the others live under gamma=0.00 whatever was asked."""
    return float(gamma) if mode in SPLICING_MODES or mode in IS_MODES else 0.0


def partition_measure(mode: str, measure: Measure) -> str:
    """The measure's part of a partition name: '' for the default measure and for modes without
    splices (their partitions stay where they always were), else e.g. 'difflib-segment'."""
    return measure.key if mode in SPLICING_MODES and measure != DEFAULT_MEASURE else ""


def live_measure(saar: MeasureSettings) -> Measure:
    """The measure the live loop decided with (and purification at γ_live must use to relive it)."""
    return Measure(saar.similarity, saar.similarity_on)


def purify_measure(saar: MeasureSettings, similarity: str | None, similarity_on: str | None) -> Measure:
    """purify.similarity / purify.similarity_on, each defaulting to the run's live measure."""
    return Measure(similarity or saar.similarity, similarity_on or saar.similarity_on)
