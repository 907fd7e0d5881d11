"""The similarity that decides shallow vs deep (docs/saar.md), computed and compared exactly.

Both measures are 2·M / T over the two strings (T = total length): M is the longest common
subsequence for `rapidfuzz` (Indel: (T − distance) / T, = fuzz.ratio/100) and the sum of difflib's
greedy matching blocks for `difflib` (exactly `SequenceMatcher(None, a, b).ratio()`, default
autojunk: the reference implementation's measure). The decision `similarity ≥ γ` is taken on the
integers 2·M and T against γ as the decimal it was written as, so a pair whose ratio is exactly γ
is shallow (a float ratio is one ulp off for γ = 0.1, 0.2, 0.45, …).

The target is what is compared: `segment` = the whole call segment (marker, JSON wrapper, closing
tag; the reference), `code` = only the code arguments of the two calls, falling back to the segment
when either call does not parse.
"""

from __future__ import annotations

import difflib
from dataclasses import dataclass
from fractions import Fraction
from functools import lru_cache
from typing import Literal

from rapidfuzz.distance import Indel

SimilarityName = Literal["rapidfuzz", "difflib"]
SimilarityTarget = Literal["segment", "code"]


@lru_cache(maxsize=256)
def exact_gamma(gamma: float) -> Fraction:
    """γ as the decimal it was written as: 0.45 → 9/20 (not the binary float nearest to it)."""
    return Fraction(repr(float(gamma)))


@dataclass(frozen=True)
class Ratio:
    """2·M / T as integers."""

    same: int  # 2 · matched characters
    total: int  # len(a) + len(b)

    @property
    def value(self) -> float:
        return self.same / self.total if self.total else 1.0

    def at_least(self, gamma: float) -> bool:
        g = exact_gamma(gamma)
        if self.total == 0:
            return g <= 1
        return self.same * g.denominator >= g.numerator * self.total


def rapidfuzz_ratio(a: str, b: str) -> Ratio:
    total = len(a) + len(b)
    return Ratio(total - Indel.distance(a, b), total)


def difflib_ratio(a: str, b: str) -> Ratio:
    matched = sum(block.size for block in difflib.SequenceMatcher(None, a, b).get_matching_blocks())
    return Ratio(2 * matched, len(a) + len(b))


_RATIOS = {"rapidfuzz": rapidfuzz_ratio, "difflib": difflib_ratio}


@dataclass(frozen=True)
class Measure:
    similarity: SimilarityName = "rapidfuzz"
    on: SimilarityTarget = "segment"

    def __post_init__(self) -> None:
        if self.similarity not in _RATIOS:
            raise ValueError(f"unknown similarity {self.similarity!r}; expected one of {sorted(_RATIOS)}")
        if self.on not in ("segment", "code"):
            raise ValueError(f"unknown similarity target {self.on!r}; expected 'segment' or 'code'")

    @property
    def key(self) -> str:
        """The measure's name in partition paths and reports, e.g. 'difflib-segment'."""
        return f"{self.similarity}-{self.on}"

    def ratio(self, failed_segment: str, retry_segment: str) -> Ratio:
        a, b = failed_segment, retry_segment
        if self.on == "code":
            a, b = _code_or(a), _code_or(b)
            if a is None or b is None:
                a, b = failed_segment, retry_segment
        return _RATIOS[self.similarity](a, b)

    def __call__(self, a: str, b: str) -> float:
        return self.ratio(a, b).value


def _code_or(segment: str) -> str | None:
    from pipeline.chat import parse_tool_call  # chat imports nothing from here; avoids a cycle at import time

    parsed = parse_tool_call(segment)
    return parsed.code if parsed.status == "ok" else None


DEFAULT_MEASURE = Measure()  # rapidfuzz on the whole segment: see docs/saar.md for why
REFERENCE_MEASURE = Measure("difflib", "segment")  # the reference implementation, exactly
