"""The project's error base class and the one-line wording of environment failures.

Every failure that is the input's or the environment's fault (not a bug in cleaner) is a
`CleanerError`: its message is one line that names the file, key or value at fault and how to fix it,
and the `cleaner` CLI prints exactly that line and exits non-zero. Anything else is a bug and keeps
its traceback. Callers check `isinstance(e, CleanerError)`, never class names.
"""

from __future__ import annotations

import errno
import os
from pathlib import Path


def first_line(e: BaseException) -> str:
    """An exception's message as one line (libraries' messages run over several): its first, or its type's name."""
    text = str(e).strip()
    return text.splitlines()[0] if text else type(e).__name__


class CleanerError(Exception):
    """A user-facing failure; `str(e)` is the whole message the CLI prints."""

    exit_code = 1


class WorkspaceError(CleanerError):
    """storage.root (or a path under it) cannot be used: missing, under a file, read-only, full."""


class DiskFull(WorkspaceError):
    """A write ran out of space; what the stage was writing has been removed."""


class RunIdError(CleanerError, ValueError):
    """A run id that is not a plain folder name."""


class CheckpointError(CleanerError):
    """A policy checkpoint that is missing, truncated or corrupt."""


class InspectError(CleanerError):
    """A catalog query that DuckDB refused (bad SQL, a locked or unreadable catalog file)."""


def describe_os_error(e: OSError, doing: str = "") -> str:
    """One line for an OSError: what was being done, the file, and the fix for the common causes."""
    where = f"{e.filename}: " if e.filename else ""
    what = f"{doing}: " if doing else ""
    reason = e.strerror or str(e)
    fix = {
        errno.ENOSPC: (
            "the disk is full; free space (or point storage.root elsewhere) and rerun — nothing was committed"
        ),
        errno.EDQUOT: "the disk quota is exhausted; free space and rerun — nothing was committed",
        errno.EROFS: "the file system is read-only; point storage.root at a writable folder",
        errno.EACCES: "permission denied; point storage.root at a folder you can write",
        errno.EPERM: "operation not permitted; point storage.root at a folder you can write",
        errno.ENOTDIR: "a part of this path is a file, not a folder; fix storage.root",
        errno.EEXIST: "a file is in the way of a folder; fix storage.root",
    }.get(e.errno or 0)
    return f"{what}{where}{reason}" + (f" ({fix})" if fix else "")


def os_error(e: OSError, doing: str = "") -> CleanerError:
    """The CleanerError for an OSError met while writing or reading the workspace."""
    cls = DiskFull if e.errno in (errno.ENOSPC, errno.EDQUOT) else WorkspaceError
    return cls(describe_os_error(e, doing))


def check_writable_root(root: Path, create: bool = True) -> None:
    """storage.root exists (created when `create`) and takes a write; one line naming it otherwise.

    Checked before anything long starts (a Prefect server whose database lives under the root, an
    hour of rollout), so a read-only or mistyped root fails at once instead of at the first commit.
    """
    root = Path(root)
    try:
        if create:
            root.mkdir(parents=True, exist_ok=True)
        elif not root.is_dir():
            raise WorkspaceError(f"storage.root {root} does not exist")
        probe = root / f".write-probe-{os.getpid()}"
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as e:
        raise os_error(e, f"storage.root {root} is not a writable folder") from None
