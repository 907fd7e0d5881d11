"""Trajectory kinds: what happened to a trajectory's tool calls, read from its attempt tree.

The kinds exist to measure the premise of purification (docs/saar.md): SAAR removes failed calls, so it
helps when the trajectories that contain a recovered failure mostly carry positive advantage (their
failed call would otherwise be reinforced) and hurts when they mostly carry negative advantage (the
failed call would otherwise be pushed down). The catalog's `raw_kinds` view classifies in SQL by the
same rule as `trajectory_kind` (tests/test_premise.py holds them equal row for row); `mask_failed`
purification uses this function.

- failed call: an attempt whose code ran and failed through the model's fault (result status
  `failure`, class `model`); infrastructure failures are never the model's.
- `infra`: some attempt hit an infrastructure failure (never purified; reported apart).
- `clean`: no failed call (every call ran, or no call at all). Says nothing about the answer.
- `recovered`: failed calls, and at every position with one the last attempt ran successfully.
- `not_recovered`: some position with a failed call ended without a working call (K retries
  exhausted, a retry without a call, SAAR off for that trajectory, or a limit hit first).

Precedence: infra, then not_recovered, then recovered, then clean.
"""

from __future__ import annotations

from typing import Literal

from pipeline.trajectory import Attempt, Trajectory

TrajectoryKind = Literal["clean", "recovered", "not_recovered", "infra"]


def failed_call(a: Attempt) -> bool:
    """The model's code ran and failed (an infrastructure failure is not the model's failed call)."""
    return a.result is not None and a.result.status == "failure" and a.result.error_class == "model"


def _ran(a: Attempt) -> bool:
    return a.result is not None and a.result.status == "success"


def trajectory_kind(t: Trajectory) -> TrajectoryKind:
    if any(a.result is not None and a.result.error_class == "infra" for p in t.positions for a in p.attempts):
        return "infra"
    failed = [p for p in t.positions if any(failed_call(a) for a in p.attempts)]
    if not failed:
        return "clean"
    return "recovered" if all(_ran(p.attempts[-1]) for p in failed) else "not_recovered"
