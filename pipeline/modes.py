"""Purification modes and how a (mode, γ, measure) names its partition: one owner for the facts the
purifier writes by and the trainer reads by (docs/saar.md §modes)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, Protocol, get_args

from pipeline.similarity import DEFAULT_MEASURE, Measure
from storage.layout import threshold_partition


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
    """The measure of rollout.saar: the one the live loop decides with and purification splices with (one setting;
    a replay under another one overrides rollout.saar.similarity(_on), its partitions named by `partition_measure`)."""
    return Measure(saar.similarity, saar.similarity_on)


@dataclass(frozen=True)
class Variant:
    """One purified partition of an iteration, the same object from the config (purifier.stage.wanted_variants)
    through Beam (PurifyJob.variants, the staged files) to disk (`partition`). Build it with `Variant.of`, which
    normalises what does not name a partition: the others' threshold is 0, and only splicing modes keep a measure."""

    mode: Mode
    threshold: float = 0.0  # γ for the splicing modes, τ for the importance-ratio modes, 0 for the others
    measure: Measure = DEFAULT_MEASURE  # decides shallow vs deep (splicing modes only)

    @classmethod
    def of(cls, mode: Mode, threshold: float = 0.0, measure: Measure = DEFAULT_MEASURE) -> Variant:
        return cls(mode, partition_gamma(mode, threshold), measure if mode in SPLICING_MODES else DEFAULT_MEASURE)

    @property
    def measure_key(self) -> str:
        """The measure's part of the partition name: '' for the default (partitions stay where they always were)."""
        return partition_measure(self.mode, self.measure)

    @property
    def partition(self) -> str:
        """Its path under an iteration's purified/ and dead_letter/, e.g. mode=saar/gamma=0.50-difflib-segment."""
        return f"mode={self.mode}/{threshold_partition(self.mode, self.threshold, self.measure_key)}"

    def __str__(self) -> str:
        return self.partition
