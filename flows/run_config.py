"""What the training flow keeps about a run besides its stages' shards: its id (from a template for a
schedule's firings), its config frozen in run.json when it starts (a rerun must agree with it), how many
iterations it has trained, and the DuckDB catalog republished after each commit."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Callable

from pipeline.config import (
    MOVED_TO_ENGINE_TUNING,
    PLACEMENT_SETTINGS,
    PURIFY_REPLAY_SETTINGS,
    SECTION_SETTINGS_IF_SET,
    CleanerConfig,
    upgrade_frozen,
)
from storage.errors import CleanerError
from storage.identity import file_digest, without_speed_only
from storage.checkpoints import check_checkpoint
from storage.layout import RunLayout
from storage.shards import atomic_write_json

# A run may be extended with more iterations or replayed under more γ; what it trains on may not change.
FROZEN_SECTIONS = ("world", "rollout", "purify", "train")
TASKS_FILE = "tasks.json"  # beside run.json: the content identity of rollout.tasks when it is a file


class RunConfigMismatch(CleanerError, ValueError):
    pass


def _frozen(data: dict) -> dict:
    data = upgrade_frozen(data)  # a run frozen with its τ in train.gamma
    out = {s: {k: v for k, v in data[s].items() if k not in PLACEMENT_SETTINGS} for s in FROZEN_SECTIONS}
    for key in PURIFY_REPLAY_SETTINGS:
        out["purify"].pop(key, None)
    rollout = out["rollout"]
    rollout.pop("loop", None)  # a setting nothing reads: every run rolls out on the asynchronous loop
    tuning = dict(rollout.get("engine_tuning") or {})
    # a run frozen before rollout.engine_tuning held them
    tuning.update({key: rollout.pop(key) for key in MOVED_TO_ENGINE_TUNING if key in rollout})
    rollout["engine_tuning"] = tuning
    return without_speed_only(out)  # a rerun may run at another speed


def preflight(cfg: CleanerConfig) -> None:
    """What a training flow would only find wrong after writing something (run.json, a rollout), each one line
    before: the task file and its size, flow.eval_every's settings, what the update needs of the machine, the purify
    runner.
    `cleaner train` runs it before Prefect is set up; the flow again, for a deployment's firings."""
    from purifier.stage import check_runner
    from rollout_gen.eval_stage import check_eval_settings
    from rollout_gen.stage import iteration_tasks
    from trainer.devices import check_device

    if cfg.rollout.tasks != "world":
        iteration_tasks(cfg, 0)
    check_eval_settings(cfg)
    check_device(cfg)
    check_runner(cfg)


def tasks_digest(cfg: CleanerConfig) -> str | None:
    """The content identity of rollout.tasks when it is a file (None for the world): a run trains on the tasks it
    started with, wherever the file is and whatever its name."""
    return None if cfg.rollout.tasks == "world" else file_digest(cfg.rollout.tasks)


def freeze_run_config(cfg: CleanerConfig, run_id: str) -> None:
    """A new run's config frozen in its run.json; a started run's checked against it (check_run_config)."""
    if check_run_config(cfg, run_id):
        return
    # a new run starts from rollout.policy: a missing or truncated one wrote run.json first, and then the corrected
    # rerun was refused as "started with another config"
    check_checkpoint(Path(cfg.rollout.policy))
    layout = RunLayout(cfg.storage.root, run_id)
    digest, recorded = tasks_digest(cfg), layout.run_dir / TASKS_FILE
    if digest:  # before run.json: a run.json without it is a run of the world, or of before the record
        atomic_write_json(recorded, {"path": str(Path(cfg.rollout.tasks).resolve()), "blake2b": digest})
    atomic_write_json(layout.run_json, cfg.model_dump(mode="json"))


def config_diffs(started: dict, now: dict) -> list[str]:
    """`section.key: A -> B` for each frozen setting that differs between a run's run.json and a config (dumped)."""
    a, b = _frozen(started), _frozen(now)
    for sec, defaults in SECTION_SETTINGS_IF_SET.items():  # a run frozen before them ran at their defaults
        a[sec] = {**defaults, **a[sec]}
    for sec in FROZEN_SECTIONS:  # other settings added by a newer cleaner are not a change of the run
        b[sec] = {k: v for k, v in b[sec].items() if k in a[sec]}
    return [
        f"{s}.{k}: {a[s].get(k)!r} -> {b[s].get(k)!r}"
        for s in FROZEN_SECTIONS
        for k in sorted(set(a[s]) | set(b[s]))
        if a[s].get(k) != b[s].get(k)
    ]


def check_run_config(cfg: CleanerConfig, run_id: str) -> bool:
    """Whether run `run_id` was started (its run.json exists) with these settings; another config is refused in
    one line naming the differences. `cleaner train` asks before its Prefect server starts (12 s in, before)."""
    layout = RunLayout(cfg.storage.root, run_id)
    now = cfg.model_dump(mode="json")
    digest, recorded = tasks_digest(cfg), layout.run_dir / TASKS_FILE
    if layout.run_json.is_file():
        before = json.loads(layout.run_json.read_text())
        started = json.loads(recorded.read_text()).get("blake2b") if recorded.is_file() else None
        if digest and started not in (None, digest):  # a run started before the record: not compared
            raise RunConfigMismatch(
                f"{cfg.rollout.tasks}: not the task file run {run_id!r} started with (its content "
                f"differs from what {recorded} records): a run trains on the tasks it started "
                "with; give that file, or use a new flow.run_id"
            )
        diffs = config_diffs(before, now)
        if diffs:
            raise RunConfigMismatch(
                f"{layout.run_json}: run {run_id!r} was started with another config "
                f"({'; '.join(diffs[:5])}); rerun with the run's settings, or use a new "
                "flow.run_id"
            )
        return True
    return False


def run_id_for(template: str, run_id: str, now: float | None = None) -> str:
    """A firing's run id from a template: {run_id} the configured one, {date} / {time} the firing's local
    date (YYYYMMDD) and time (HHMMSS); e.g. 'nightly-{date}'."""
    t = time.localtime(now)
    return template.format(run_id=run_id, date=time.strftime("%Y%m%d", t), time=time.strftime("%H%M%S", t))


def trained_iterations(cfg: CleanerConfig, run_id: str) -> int:
    """How many iterations of the run are done: its newest committed checkpoint's number (`cleaner gc` may have
    removed the ones before it)."""
    from storage.checkpoints import newest_checkpoint

    return newest_checkpoint(RunLayout(cfg.storage.root, run_id))


def publish_catalog(cfg: CleanerConfig, warn: Callable[[str], None]) -> None:
    """Republish <root>/catalog.duckdb after a stage committed: every committed shard is queryable at once
    (a failure is one warning, never the stage's: the next commit or `cleaner inspect` publishes again)."""
    from storage.catalog import publish_quietly

    publish_quietly(cfg.storage.root, cfg.storage.root / cfg.storage.catalog, warn)
