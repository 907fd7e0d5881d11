"""Verification paid once: which parts of a shard were fully checked, recorded beside the shard.

Checking a part means reading all its bytes (crc32 against the manifest) and its Parquet footer (schema
version, columns, rows): linear in everything ever committed, and without a record every new process would pay
it again. A part that passed is recorded in `_VERIFIED.json` in its shard's folder with the file's identity —
size, mtime and ctime in nanoseconds, inode and device, as taken before its bytes were read (a change during
or after the read then no longer matches) — and the manifest's crc32. A later reader (another process too)
that finds the same identity and crc32 trusts the part without reading it. Any write to the file changes its
ctime (which no unprivileged process can set back) and a copy or move to another folder changes its inode, so
a changed, replaced or relocated part is checked in full again.

The record only ever saves work: it is written atomically with a digest of its own content; a record that
is missing, unreadable, of another version or whose digest does not match is ignored (the parts are checked
in full and the record rewritten), so a corrupt record can never make a corrupt part pass. A root that cannot
be written (read-only) just keeps checking in full. Readers that feed training (purification, the update)
check every byte they read whatever the record says (storage.shards.read_shard, iter_part_batches).
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any

RECORD = "_VERIFIED.json"
VERSION = 1
_CACHE: dict[str, tuple[tuple[int, int, int], dict[str, dict[str, Any]]]] = {}  # record path -> (its stat, parts)


IDENTITY = ("size", "mtime_ns", "ctime_ns", "ino", "dev")


def identity(path: Path) -> dict[str, int]:
    return dict(zip(IDENTITY, identity_values(path)))


def identity_values(path: str | Path) -> list[int]:
    """identity(path)'s values, in IDENTITY's order (what the scan index compares: storage/shard_index.py)."""
    st = os.stat(path)
    return [st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino, st.st_dev]


def _digest(parts: dict[str, dict[str, Any]]) -> str:
    return hashlib.blake2b(json.dumps(parts, sort_keys=True).encode(), digest_size=16).hexdigest()


def load(directory: Path) -> dict[str, dict[str, Any]]:
    """The record's parts ({} when it is missing or cannot be trusted)."""
    path = Path(directory) / RECORD
    try:
        st = os.stat(path)
    except OSError:
        return {}
    key = (st.st_size, st.st_mtime_ns, st.st_ino)
    cached = _CACHE.get(str(path))
    if cached is not None and cached[0] == key:
        return cached[1]
    try:
        data = json.loads(path.read_bytes())
        parts = data["parts"]
        ok = data.get("version") == VERSION and isinstance(parts, dict) and data.get("digest") == _digest(parts)
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        ok, parts = False, {}
    parts = parts if ok else {}
    _CACHE[str(path)] = (key, parts)
    return parts


def is_verified(directory: Path, name: str, size: int, crc32: str) -> bool:
    """True when part `name` (of the manifest's size and crc32) was checked in full and has not changed since."""
    entry = load(directory).get(name)
    if not entry or entry.get("crc32") != crc32 or entry.get("size") != size:
        return False
    try:
        now = identity(Path(directory) / name)
    except OSError:
        return False
    return all(entry.get(k) == v for k, v in now.items())


def remember(directory: Path, parts: list[tuple[str, str, dict[str, int]]]) -> None:
    """Record (name, crc32, identity) parts as checked in full. The identity is the one the file had when its
    checked bytes were read (taken before reading them, identity()), never a stat taken after: a change that
    lands between the read and the record then leaves the record naming the file as it was, which no longer
    matches, instead of vouching for bytes nobody checked. Best effort: a root that cannot be written, or a
    concurrent writer winning the rename, only means more checking later."""
    directory = Path(directory)
    current = dict(load(directory))
    for name, crc32, ident in parts:
        current[name] = {**ident, "crc32": crc32}
    data = json.dumps({"version": VERSION, "parts": current, "digest": _digest(current)}, sort_keys=True).encode()
    tmp = directory / f".{RECORD}.tmp-{os.getpid()}"
    try:
        tmp.write_bytes(data)
        os.replace(tmp, directory / RECORD)
    except OSError:
        tmp.unlink(missing_ok=True)
