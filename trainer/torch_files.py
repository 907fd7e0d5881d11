"""torch.save whose write errors stay OSErrors: a full disk is one line naming the file, not torch's RuntimeError.

torch.save through a file object turns the object's OSError (ENOSPC) into `RuntimeError: [enforce fail at
inline_container.cc] unexpected pos …`; the writer below keeps the OSError it raised, and it is raised instead.
"""

from __future__ import annotations

import io
from pathlib import Path
from typing import Any

import torch


class _KeepsErrors(io.RawIOBase):
    def __init__(self, f: io.BufferedWriter) -> None:
        self.f, self.error = f, None

    def writable(self) -> bool:
        return True

    def write(self, b) -> int:
        try:
            return self.f.write(b)
        except OSError as e:
            self.error = e
            raise

    def flush(self) -> None:
        if not self.f.closed:  # also called when collected, after the file is closed
            self.f.flush()


def save_torch(obj: Any, path: Path) -> None:
    """`obj` to `path` by torch.save; an OSError of the write (a full disk) is raised as that OSError."""
    with open(path, "wb") as f:
        writer = _KeepsErrors(f)
        try:
            torch.save(obj, writer)
        except RuntimeError:
            if writer.error is not None:
                raise writer.error from None
            raise
