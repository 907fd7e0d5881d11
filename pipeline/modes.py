"""Purification modes and how a (mode, threshold, measure) names its partition: one owner for the facts the
purifier writes by and the trainer reads by (docs/saar.md §modes). The vocabulary itself (Mode, MODES, IS_MODES,
SPLICING_MODES) lives in storage/modes.py, which storage's partition names and SQL read too."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from pipeline.similarity import DEFAULT_MEASURE, Measure
from storage.layout import threshold_partition
from storage.modes import IS_MODES, MODES, SPLICING_MODES, Mode

__all__ = [
    "IS_MODES",
    "MODES",
    "SPLICING_MODES",
    "Mode",
    "MeasureSettings",
    "Variant",
    "live_measure",
    "partition_measure",
    "partition_threshold",
]


class MeasureSettings(Protocol):
    """What of rollout.saar (pipeline.config.SaarConfig, which imports this module) names a measure."""

    similarity: str
    similarity_on: str


def partition_threshold(mode: str, threshold: float) -> float:
    """The threshold that names a mode's partition: γ for the splicing modes (gamma=…), τ for the importance-ratio
    modes (tau=…); the others live under gamma=0.00 whatever was asked."""
    return float(threshold) if mode in SPLICING_MODES or mode in IS_MODES else 0.0


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
    """One purified partition of an iteration, the same object from the config (pipeline.variants.plan_variants)
    through Beam (PurifyJob.variants, the staged files) to disk (`partition`). Build it with `Variant.of`, which
    normalises what does not name a partition: the others' threshold is 0, and only splicing modes keep a measure."""

    mode: Mode
    threshold: float = 0.0  # what names the partition: γ (splicing modes), τ (importance-ratio modes), else 0
    measure: Measure = DEFAULT_MEASURE  # decides shallow vs deep (splicing modes only)

    @classmethod
    def of(cls, mode: Mode, threshold: float = 0.0, measure: Measure = DEFAULT_MEASURE) -> Variant:
        return cls(mode, partition_threshold(mode, threshold), measure if mode in SPLICING_MODES else DEFAULT_MEASURE)

    @property
    def gamma(self) -> float:
        """SAAR's similarity threshold γ: a splicing mode's threshold, 0.0 for every other mode (its rows' `gamma`)."""
        return self.threshold if self.mode in SPLICING_MODES else 0.0

    @property
    def tau(self) -> float | None:
        """The importance-ratio threshold τ of an importance-ratio mode, None for every other mode (its rows'
        `is_threshold`)."""
        return self.threshold if self.mode in IS_MODES else None

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
