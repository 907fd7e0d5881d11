"""Checks that a policy checkpoint's weight files are whole before anything loads them.

A truncated or overwritten `*.safetensors` file otherwise fails deep inside transformers (or, worse,
loads with garbage); here it is one line naming the file. The safetensors layout is an 8-byte
little-endian header length, a JSON header whose `data_offsets` cover the data, then the data: the
file must be exactly as long as the header says.
"""
from __future__ import annotations

import json
import struct
from pathlib import Path

from pipeline.errors import CheckpointError


def check_safetensors(path: Path) -> None:
    path = Path(path)
    size = path.stat().st_size
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise CheckpointError(f"{path}: truncated safetensors file ({size} bytes); restore or re-copy the checkpoint")
        (n,) = struct.unpack("<Q", head)
        if n > size - 8:
            raise CheckpointError(f"{path}: truncated or corrupt safetensors file (header of {n} bytes in a "
                                  f"{size}-byte file); restore or re-copy the checkpoint")
        try:
            header = json.loads(f.read(n))
            end = max((int(t["data_offsets"][1]) for k, t in header.items() if k != "__metadata__"), default=0)
        except (ValueError, KeyError, TypeError, IndexError):
            raise CheckpointError(f"{path}: corrupt safetensors header; restore or re-copy the checkpoint") from None
    if 8 + n + end != size:
        what = "truncated" if 8 + n + end > size else "corrupt (trailing bytes)"
        raise CheckpointError(f"{path}: {what} safetensors file ({size} bytes, its header says {8 + n + end}); "
                              "restore or re-copy the checkpoint")


def check_checkpoint(checkpoint: Path) -> None:
    """The checkpoint folder exists and every weight file in it is whole."""
    checkpoint = Path(checkpoint)
    if not checkpoint.is_dir():
        raise CheckpointError(f"checkpoint {checkpoint} does not exist")
    weights = sorted(checkpoint.glob("*.safetensors"))
    if not weights:
        raise CheckpointError(f"no *.safetensors weights in checkpoint {checkpoint}")
    for w in weights:
        check_safetensors(w)
