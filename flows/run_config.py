"""A run's config, frozen in run.json when the run starts; a rerun must agree with it."""
from __future__ import annotations

import json

from pipeline.config import PURIFY_REPLAY_SETTINGS, CleanerConfig
from storage.errors import CleanerError
from storage.layout import RunLayout
from storage.shards import atomic_write_json

# A run may be extended with more iterations or replayed under more γ; what it trains on may not change.
FROZEN_SECTIONS = ("world", "rollout", "purify", "train")


class RunConfigMismatch(CleanerError, ValueError):
    pass


def _frozen(data: dict) -> dict:
    out = {s: dict(data[s]) for s in FROZEN_SECTIONS}
    for key in PURIFY_REPLAY_SETTINGS:
        out["purify"].pop(key, None)
    out["rollout"].pop("threads", None)
    return out


def freeze_run_config(cfg: CleanerConfig, run_id: str) -> None:
    layout = RunLayout(cfg.storage.root, run_id)
    now = cfg.model_dump(mode="json")
    if layout.run_json.is_file():
        before = json.loads(layout.run_json.read_text())
        a, b = _frozen(before), _frozen(now)
        for sec in FROZEN_SECTIONS:  # settings added by a newer cleaner are not a change of the run
            b[sec] = {k: v for k, v in b[sec].items() if k in a[sec]}
        if a != b:
            diffs = [f"{s}.{k}: {a[s].get(k)!r} -> {b[s].get(k)!r}" for s in FROZEN_SECTIONS
                     for k in sorted(set(a[s]) | set(b[s])) if a[s].get(k) != b[s].get(k)]
            raise RunConfigMismatch(f"{layout.run_json}: run {run_id!r} was started with another config "
                                    f"({'; '.join(diffs[:5])}); use a new flow.run_id")
        return
    atomic_write_json(layout.run_json, now)
