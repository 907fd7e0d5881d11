"""A writer's private staging folder beside what it commits: its files live there until the commit reads them, and
the folder goes when the writer is done, however it ends.

A writer that dies by SIGKILL runs no `finally`, so the next one entering the same staging root removes what dead
writers left. A live writer holds an exclusive flock on its `NAME.lock` for as long as it lives, and the kernel drops
that lock when the process dies, however it dies: a folder whose lock can be taken is stale.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import shutil
import uuid
from pathlib import Path
from typing import Iterator


def _remove_if_empty(folder: Path) -> None:
    with contextlib.suppress(OSError):  # not empty (another writer is staging) or already gone
        folder.rmdir()


def clean_stale(root: Path, prefix: str, remove_root: bool = True) -> None:
    """Remove the folders (and locks) under `root` named `PREFIX-…` that writers no longer running left; then `root`
    itself when it is empty and `remove_root` (a staging root of cleaner's own, not a folder of the user's)."""
    if not root.is_dir():
        return
    # by name, not by glob: a prefix may hold glob characters ('[', '*') when it comes from a user's folder name
    for entry in sorted(e for e in root.iterdir() if e.name.startswith(f"{prefix}-")):
        name = entry.name.removesuffix(".lock")
        lock = root / f"{name}.lock"
        try:
            fd = os.open(lock, os.O_RDWR | os.O_CREAT, 0o644)
        except FileNotFoundError:
            continue  # removed meanwhile by another writer
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)  # alive: not ours to touch
            continue
        try:
            shutil.rmtree(root / name, ignore_errors=True)
            lock.unlink(missing_ok=True)
        finally:
            os.close(fd)
    if remove_root:
        _remove_if_empty(root)


@contextlib.contextmanager
def locked(path: Path) -> Iterator[None]:
    """An exclusive flock on `path` (created) while the block runs, the file removed after: what tells
    `clean_stale` that the folder beside it, `path` without `.lock`, is in use."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    fcntl.flock(fd, fcntl.LOCK_EX)
    try:
        yield
    finally:
        path.unlink(missing_ok=True)
        os.close(fd)


@contextlib.contextmanager
def staging_area(root: Path, prefix: str) -> Iterator[Path]:
    """A fresh folder `PREFIX-ID` under `root`, locked while the block runs and removed when it ends (with `root`
    when nothing else is staged there); entering first removes what dead writers left under `root`."""
    clean_stale(root, prefix)
    name = f"{prefix}-{uuid.uuid4().hex[:8]}"
    root.mkdir(parents=True, exist_ok=True)
    folder = root / name
    try:
        with locked(root / f"{name}.lock"):
            try:
                folder.mkdir()  # before the writer starts: an unfinished one leaves a trace
                yield folder
            finally:
                shutil.rmtree(folder, ignore_errors=True)
    finally:
        _remove_if_empty(root)
