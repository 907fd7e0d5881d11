"""One writer per shard or checkpoint: an exclusive flock on a lock file beside what it writes, held while it writes.

Two commands writing the same shard at once (two `cleaner train` of one run, a rollout started twice) each removed
the other's files as leftovers of a crashed attempt, and both committed: a manifest could list a part the other
writer had deleted. The kernel drops a flock when its process dies, however it dies, so a lock is never stale; the
file holds the writer's pid for the message another writer gets.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import time
import weakref
from pathlib import Path
from typing import Callable, Iterator

from storage.errors import CleanerError


class Busy(CleanerError, RuntimeError):
    """Another live process is writing this; one line naming it and its pid."""

    exit_code = 1


class WriterLock:
    """Held from `acquire` until `release`. The lock file is removed on release; a writer that opened it before the
    removal finds it no longer at its path once it holds the lock, and opens the new one (no two holders)."""

    def __init__(self, path: Path, what: str) -> None:
        self.path, self.what = Path(path), what
        self._fd: int | None = None

    @classmethod
    def beside(cls, path: Path, what: str) -> "WriterLock":
        """The lock of what is written at `path` (a stage's shard folder, a checkpoint): `.NAME.lock` beside it."""
        path = Path(path)
        return cls(path.with_name(f".{path.name}.lock"), what)

    def acquire(self) -> "WriterLock":
        while True:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                holder = os.pread(fd, 32, 0).decode(errors="replace").strip() or "?"
                os.close(fd)
                who = "this process, by a writer never ended" if holder == str(os.getpid()) else "another process"
                raise Busy(
                    f"{self.what}: being written by {who} (pid {holder}) right now; let it finish, then "
                    "run this again (what it commits is kept when it was made with the same settings)"
                ) from None
            try:
                same = os.fstat(fd).st_ino == os.stat(self.path).st_ino
            except FileNotFoundError:
                same = False
            if same:
                with contextlib.suppress(OSError):  # the pid is for another writer's message (a full disk: none)
                    os.ftruncate(fd, 0)
                    os.pwrite(fd, str(os.getpid()).encode(), 0)
                self._fd = fd
                # a holder dropped without release (a writer neither committed nor aborted) frees it when collected
                self._closer = weakref.finalize(self, os.close, fd)
                return self
            os.close(fd)  # released and removed between our open and our lock: try the file now there

    def release(self) -> None:
        if self._fd is None:
            return
        with contextlib.suppress(OSError):
            self.path.unlink()
        self._closer()  # closes the fd, once
        self._fd = None

    @property
    def held(self) -> bool:
        return self._fd is not None

    def __enter__(self) -> "WriterLock":
        # the folder it lives in, made for it when missing, goes with it when nothing else was put there
        self._made = [p for p in (self.path.parent, *self.path.parent.parents) if not p.exists()]
        self.path.parent.mkdir(parents=True, exist_ok=True)
        try:
            return self.acquire()
        except BaseException:
            self._remove_made()
            raise

    def __exit__(self, *exc: object) -> None:
        self.release()
        self._remove_made()

    def _remove_made(self) -> None:
        for folder in self._made:  # innermost first
            try:
                folder.rmdir()
            except OSError:
                break


@contextlib.contextmanager
def turn(path: Path, *, waiting: Callable[[], None] | None = None, at_most_s: float | None = None) -> Iterator[bool]:
    """Commands that must not overlap take turns: an exclusive flock on `path` (created, never removed, so every
    taker locks the same file; opened read-only, which flock needs no more than) while the block runs. `waiting` is
    called once when another holds the turn. Yields False when it goes on without its turn: no lock file to open (a
    read-only folder), or `at_most_s` spent waiting (a holder stopped or hung)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CREAT, 0o644)
    except OSError:
        yield False
        return
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            held = True
        except BlockingIOError:
            if waiting is not None:
                waiting()
            held = _wait_for(fd, at_most_s)
        yield held
    finally:
        os.close(fd)


def _wait_for(fd: int, at_most_s: float | None) -> bool:
    if at_most_s is None:
        fcntl.flock(fd, fcntl.LOCK_EX)
        return True
    deadline = time.monotonic() + at_most_s
    while time.monotonic() < deadline:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return True
        except BlockingIOError:
            time.sleep(0.05)
    return False
