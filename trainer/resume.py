"""The one resume format of an interrupted update, whatever the strategy: a folder
`<checkpoint>.partial/` holding `progress.json` (the inputs' key, mini-batches done, their metrics,
and the tag of the state saved after the last of them) and that state under `<tag>/` (the local
strategy's `state.pt`; DeepSpeed's ZeRO partitions, one per rank). A partial update of other inputs
or settings (another key) is ignored: the update starts over."""

from __future__ import annotations

import json
import shutil
from dataclasses import asdict
from pathlib import Path

import torch

from storage.shards import atomic_write_json
from trainer.grpo import GRPOUpdate, StepMetrics, UpdateProgress
from trainer.torch_files import save_torch

PROGRESS = "progress.json"
LOCAL_STATE = "state.pt"


def partial_dir(target: Path) -> Path:
    return target.with_name(target.name + ".partial")


def tag_of(progress: UpdateProgress) -> str:
    return f"mb{progress.minibatches_done:04d}"


def write_progress(folder: Path, key: str, progress: UpdateProgress) -> None:
    """Name the state just saved under tag_of(progress) as the one to resume from; drop older states."""
    tag = tag_of(progress)
    atomic_write_json(
        folder / PROGRESS,
        {
            "key": key,
            "tag": tag,
            "minibatches_done": progress.minibatches_done,
            "metrics": [asdict(m) for m in progress.metrics],
        },
    )
    for old in folder.glob("mb*"):
        if old.name != tag:
            shutil.rmtree(old, ignore_errors=True)


def read_progress(folder: Path, key: str) -> tuple[str, UpdateProgress] | None:
    """(tag, progress) of a partial update of the same inputs and settings, else None."""
    meta = folder / PROGRESS
    if not meta.is_file():
        return None
    p = json.loads(meta.read_text())
    if p.get("key") != key:
        return None
    return p["tag"], UpdateProgress(p["minibatches_done"], [StepMetrics(**m) for m in p["metrics"]])


def save_local(folder: Path, model: torch.nn.Module, update: GRPOUpdate, progress: UpdateProgress, key: str) -> None:
    """The local strategy after a mini-batch: weights and optimizer/schedule state, then progress.json."""
    state = folder / tag_of(progress) / LOCAL_STATE
    state.parent.mkdir(parents=True, exist_ok=True)
    tmp = state.with_name(state.name + ".tmp")
    try:  # a full disk is an OSError (ENOSPC) naming the file, not torch's opaque RuntimeError
        save_torch({"model": model.state_dict(), "update": update.state_dict()}, tmp)
        tmp.replace(state)
    except BaseException:
        shutil.rmtree(state.parent, ignore_errors=True)  # never leave a half-written state behind
        if not any(folder.iterdir()):
            folder.rmdir()
        raise
    # once progress.json is renamed in, it names this state, which must stay (a Ctrl-C just past that rename deleted
    # it, and no rerun could resume); before the rename the previous state is named, and this one goes
    try:
        write_progress(folder, key, progress)
    except BaseException:
        named = read_progress(folder, key)
        if named is None or named[0] != tag_of(progress):
            shutil.rmtree(state.parent, ignore_errors=True)
        raise


def load_local(folder: Path, model: torch.nn.Module, update: GRPOUpdate, key: str) -> UpdateProgress | None:
    found = read_progress(folder, key)
    if found is None:
        return None
    tag, progress = found
    # loaded onto the weights' device by the model and the optimizer
    state = torch.load(folder / tag / LOCAL_STATE, weights_only=False, map_location="cpu")
    model.load_state_dict(state["model"])
    update.load_state_dict(state["update"])
    return progress
