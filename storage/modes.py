"""The purification modes' vocabulary: the names partitions and rows are written by, on the floor every reader
stands on (storage/ names partitions and builds the catalog's SQL with it; pipeline.modes re-exports it with
what a mode does to a sequence, docs/saar.md §modes)."""

from __future__ import annotations

from typing import Literal, get_args

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
# Modes whose threshold is an importance-ratio τ: partitions tau=…, rows with τ in `is_threshold`
IS_MODES: tuple[Mode, ...] = ("saar_is",)
# Modes that splice, so γ and the similarity measure decide what they hold and name their partitions
SPLICING_MODES: tuple[Mode, ...] = ("saar", "saar_correct")


def sql_list(modes: tuple[str, ...]) -> str:
    """Modes as an SQL list for `IN`, e.g. ('saar', 'saar_correct') (a Python 1-tuple's repr is not SQL)."""
    return "(" + ", ".join(f"'{m}'" for m in modes) + ")"
