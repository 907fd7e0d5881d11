"""Checks that a policy checkpoint's weight files are whole before anything loads them.

A truncated or overwritten `*.safetensors` file otherwise fails deep inside transformers (or, worse,
loads with garbage); here it is one line naming the file. The safetensors layout is an 8-byte
little-endian header length, a JSON header whose `data_offsets` cover the data, then the data: the
file must be exactly as long as the header says.
"""

from __future__ import annotations

import hashlib
import json
import os
import struct
from pathlib import Path

from storage.errors import CheckpointError
from storage.identity import StageIdentity, check_committed
from storage.layout import RunLayout, missing_run

DONE_MARKER = "_CHECKPOINT.json"  # written last into a checkpoint folder: the checkpoint is whole


def check_safetensors(path: Path) -> None:
    size = path.stat().st_size
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise CheckpointError(
                f"{path}: truncated safetensors file ({size} bytes); restore or re-copy the checkpoint"
            )
        (n,) = struct.unpack("<Q", head)
        if n > size - 8:
            raise CheckpointError(
                f"{path}: truncated or corrupt safetensors file (header of {n} bytes in a "
                f"{size}-byte file); restore or re-copy the checkpoint"
            )
        try:
            header = json.loads(f.read(n))
            end = max((int(t["data_offsets"][1]) for k, t in header.items() if k != "__metadata__"), default=0)
        except (ValueError, KeyError, TypeError, IndexError):
            raise CheckpointError(f"{path}: corrupt safetensors header; restore or re-copy the checkpoint") from None
    if 8 + n + end != size:
        what = "truncated" if 8 + n + end > size else "corrupt (trailing bytes)"
        raise CheckpointError(
            f"{path}: {what} safetensors file ({size} bytes, its header says {8 + n + end}); "
            "restore or re-copy the checkpoint"
        )


def files_as_umask_says(folder: Path) -> None:
    """Weight files with the mode the umask gives (safetensors writes them 0600 through a temporary file: a
    checkpoint served or read by another user, e.g. an inference server's, could not be opened)."""
    umask = os.umask(0)
    os.umask(umask)
    for path in Path(folder).glob("*.safetensors"):
        os.chmod(path, 0o666 & ~umask)


def check_checkpoint(checkpoint: Path) -> list[Path]:
    """The checkpoint folder exists and every weight file in it is whole; returns those files, sorted."""
    checkpoint = Path(checkpoint)
    if not checkpoint.is_dir():
        raise CheckpointError(f"checkpoint {checkpoint} does not exist")
    weights = sorted(checkpoint.glob("*.safetensors"))
    if not weights:
        raise CheckpointError(f"no *.safetensors weights in checkpoint {checkpoint}")
    for w in weights:
        check_safetensors(w)
    return weights


def policy_version(checkpoint: Path) -> str:
    """Content identity of a checkpoint: its weights' hash (names alone can be reused)."""
    h = hashlib.blake2b(digest_size=8)
    # exists, and every weight file is whole: one line, not a loader traceback
    for w in check_checkpoint(checkpoint):
        with open(w, "rb") as f:
            for chunk in iter(lambda: f.read(1 << 20), b""):
                h.update(chunk)
    return h.hexdigest()


def newest_checkpoint(layout: RunLayout) -> int:
    """The number of the run's newest committed checkpoint (0: none yet): checkpoint N is the policy after N
    iterations of training."""
    found = [
        int(d.name.split("=", 1)[1])
        for d in layout.checkpoint_dir(0).parent.glob("iteration=*")
        if d.name.split("=", 1)[1].isdigit() and (d / DONE_MARKER).is_file()
    ]
    return max(found, default=0)


def checkpoint_for(root: Path, run_id: str, iteration: int, initial_policy: Path) -> Path:
    """The policy that rollout of `iteration` samples from: the run's committed checkpoint, or the
    initial policy for iteration 0."""
    ckpt = RunLayout(root, run_id).checkpoint_dir(iteration)
    if (ckpt / DONE_MARKER).is_file():
        return ckpt
    if iteration == 0:
        return Path(initial_policy)
    missing = missing_run(root, run_id)  # a mistyped run or root: not an update to run first
    if missing:
        raise CheckpointError(missing)
    raise CheckpointError(
        f"{ckpt}: no checkpoint for iteration {iteration} (run the update of iteration {iteration - 1})"
    )


def committed_update(target: Path, identity: StageIdentity | str) -> bool:
    """Whether checkpoint `target` is committed by an update of this identity (its train settings: trainer/stage.py
    `update_identity`); one committed by an update with other settings is refused (storage.identity.check_committed):
    checkpoints are never overwritten, and keeping it would say a rerun trained what it did not. A checkpoint that
    records no settings (an earlier cleaner's) is kept."""
    marker = Path(target) / DONE_MARKER
    if not marker.is_file():
        return False
    try:
        recorded = json.loads(marker.read_text()).get("train_settings")
    except (OSError, ValueError, AttributeError):
        raise CheckpointError(
            f"{marker}: unreadable; restore it (the checkpoint beside it is otherwise whole)"
        ) from None
    check_committed(
        target,
        recorded,
        identity if isinstance(identity, StageIdentity) else StageIdentity(identity),
        made_with="by an update with other train settings",
        error=CheckpointError,
        remedy="checkpoints are never overwritten: use a new flow.run_id, or remove this checkpoint and "
        "every later one to train them again",
    )
    return True
