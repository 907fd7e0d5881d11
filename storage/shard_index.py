"""Which shards of a root are committed and valid, what the catalog's views may read, found without reading
thousands of manifests.

A shard is validated from its manifest (storage.shards.committed_manifest: committed, this schema, no part it
does not list) and each file the manifest lists is checked (check_part/check_summary: in full once, then by the
identity its verification record, storage/verified.py, holds). At 2,000 iterations that is 6,000 manifests and
as many records per process: seconds before a catalog can be built. So a scan keeps one index file under the
root, `_CATALOG_INDEX/index.json`, holding per validated shard folder what validation found (the files the views read,
the schema version) and the identities it held at: of the folder, of the manifest and of every file listed, kept
as one digest per shard (a 16-byte blake2b of them all: every process parses the index, and 30,000 identities of
five 19-digit numbers each made it 3.5 MB of JSON at 2,000 iterations instead of 2.2 MB). A
later process (any) trusts an entry while all those identities are unchanged, a few stats per shard and one
file read in all; otherwise it validates the shard from its manifest again. The identity is storage.verified's
(size, mtime, ctime, inode, device): a write to a file changes its ctime, which no unprivileged process can set
back; a replaced manifest or a copied store has new inodes; a file added to or removed from a folder (a part
the manifest does not list, a new shard folder) changes the folder's mtime, so the index also keeps each
folder's sub-folders by its identity, and finding the shards costs a stat per folder instead of a listing.
An iteration folder whose every folder is a shard or leads to one, and whose shards are all indexed, gets one
entry of its own: one digest of every identity below it (its folders', then each shard's folder, manifest and
files), so an unchanged iteration is its stats and one comparison; a change anywhere below it falls back to the
folder and shard entries (the folders' entries of such an iteration are not kept: listing its few folders again
is cheap). A folder without a manifest keeps its iteration out of this: the digest could not see a part
written into it later.

The index only ever saves work, like the verification records:
- the file identities it holds are taken from the verification record after the check, identities at which
  the files were verified, never a later stat;
- timestamps are kept at the clock's tick (a few ms; seconds on some filesystems), so a file changed within
  the tick it was checked in keeps its identity: identities younger than SETTLE_NS when the scan began are
  not indexed (the next scan validates such a shard from its manifest again, which reads no part in full);
- it is written atomically with a digest of its content; one that is missing, unreadable, of another version or
  whose digest does not match is ignored (every shard is validated from its manifest, the index rewritten);
- a shard that fails is never indexed, so every scan validates (and names) it again; `verify` checks every file
  in full whatever the index and the records say. A root that cannot be written works without an index.
"""

from __future__ import annotations

import fnmatch
import functools
import hashlib
import json
import os
import re
import struct
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import pyarrow as pa

from storage import packs, verified
from storage.schemas import DEAD_LETTER, METRICS, PURIFIED, RAW
from storage.shards import (
    MANIFEST,
    PART_GLOB,
    ShardError,
    check_part,
    check_summary,
    committed_manifest,
    summary_parts,
    text_parts,
)

INDEX = "index.json"  # in packs.FOLDER, beside the packs
VERSION = 3  # 3: one digest per iteration folder too (_Index.indexed_iteration)
ITERATIONS = "runs/*/iteration=*"
# Each view's shard folders below an iteration folder, one name (or glob pattern) per level
SOURCES: dict[str, tuple[tuple[str, ...], pa.Schema]] = {
    "raw_trajectories": (("raw",), RAW),
    "purified": (("purified", "mode=*", "*=*"), PURIFIED),
    "dead_letters": (("dead_letter", "mode=*", "*=*"), DEAD_LETTER),
    "metrics": (("metrics", "stage=*"), METRICS),
}
_VIEW_OF = {names[0]: view for view, (names, _) in SOURCES.items()}  # a shard's view by its first folder name
SETTLE_NS = 2_000_000_000  # covers a coarse clock tick (2 s on FAT-like filesystems) and then some
identity = verified.identity_values  # a file's identity as the index holds it
_SEP = os.sep

_LOADED: dict[str, tuple[list[int], dict[str, Any]]] = {}  # index path -> (its identity, its content); never mutated
# Shards validated from their manifests by this process (tests count them: a shard indexed by any process is not)
VALIDATED = 0


@dataclass(frozen=True)
class Problem:
    """A shard left out of the views: corrupt (committed but failing validation) or not committed."""

    path: Path
    message: str
    committed: bool

    def __str__(self) -> str:
        return self.message


@dataclass(frozen=True)
class ShardFiles:
    """A validated shard's files, as absolute path strings (what the views list; Path objects cost a tenth of
    a scan at 2,000 iterations)."""

    parts: list[str]
    version: str  # the schema version it was written with
    summaries: list[str] | None  # its row summaries (storage/summaries.py); None: committed without them
    texts: tuple[str, ...] = ()  # its decoded text (storage/texts.py); empty: committed without it


@dataclass(frozen=True)
class Scan:
    """The committed, validated shards of a root per view, and what was left out: what a catalog is built
    from. One scan can build several catalogs (`cleaner inspect` publishes the file and queries in memory)."""

    shards: dict[str, list[ShardFiles]]
    problems: list[Problem]
    # per packs.KINDS kind, the packs to read instead of the files they hold: (path, schema version, those files)
    packs: dict[str, list[tuple[str, str, set[str]]]] = field(default_factory=dict)

    def unpacked(self, kind: str, files: list[tuple[str, str]]) -> tuple[list[tuple[str, str]], list[tuple[str, str]]]:
        """Of `files` (path, schema version) of pack kind `kind` (storage/packs.py), those no pack holds; and the
        packs that hold the others."""
        held = set().union(*(h for _, _, h in self.packs.get(kind, ())))
        return [f for f in files if f[0] not in held], [(p, v) for p, v, _ in self.packs.get(kind, ())]

    def fingerprint(self) -> str:
        """Equal for two scans that would build the same views (storage.catalog.publish skips a rebuild on it)."""
        h = hashlib.blake2b(digest_size=16)
        for view, shards in sorted(self.shards.items()):
            h.update(f"\0view {view}\n".encode())
            for s in shards:
                h.update("\0".join([s.version, *s.parts, "|", *(s.summaries or ["-"]), "|", *s.texts, "\n"]).encode())
        h.update(json.dumps([[str(p.path), p.message, p.committed] for p in self.problems]).encode())
        for kind, ps in sorted(self.packs.items()):  # a pack's name is its content's: the files it holds follow
            h.update(json.dumps([kind, [[path, version] for path, version, _ in ps]]).encode())
        return h.hexdigest()


class _Index:
    """The index as loaded (`old`, trusted only through identities that still hold) and as this scan finds the
    root (`new`): "shards" maps a shard folder (relative to the root) to its entry, "folders" a folder to its
    identity and sub-folder names, "packs" the packs in use (storage/packs.py)."""

    def __init__(self, root: Path) -> None:
        self.root, self.base, self.path = root, str(root) + _SEP, root / packs.FOLDER / INDEX
        self.old: dict[str, dict[str, Any]] = {"shards": {}, "folders": {}, "iterations": {}, "packs": {}}
        self.new: dict[str, dict[str, Any]] = {"shards": {}, "folders": {}, "iterations": {}, "packs": {}}
        self.settled = time.time_ns() - SETTLE_NS  # identities younger than this are not recorded
        self.listed: dict[str, list[str]] = {}  # this scan's sub-folder names per folder
        self.folder_ids: dict[str, tuple[bytes, bool]] = {}  # per folder listed: its packed identity, settled?
        try:
            ident = identity(str(self.path))
            cached = _LOADED.get(str(self.path))
            if cached is not None and cached[0] == ident:  # a flow publishing after each commit: parsed once
                self.old = cached[1]
                return
            header, _, body = self.path.read_bytes().partition(b"\n")
            head = json.loads(header)
            if head.get("version") == VERSION and head.get("digest") == _digest(body):
                loaded = json.loads(body)
                if all(isinstance(loaded.get(k), dict) for k in self.old):
                    self.old = loaded
                    _LOADED[str(self.path)] = (ident, loaded)
        except (OSError, ValueError, AttributeError):
            pass  # missing or untrustworthy: everything is validated from its manifest

    def settled_ids(self, *identities: list[int]) -> bool:
        return all(i[1] < self.settled and i[2] < self.settled for i in identities)

    def subfolders(self, folder: str) -> list[str]:
        """The names of `folder`'s visible sub-folders: as indexed while its identity is unchanged, else listed."""
        key = folder[len(self.base) :]
        known = self.listed.get(key)
        if known is not None:
            return known
        try:
            ident = identity(folder)
        except OSError:
            return []
        old, names, ident_digest = self.old["folders"].get(key), None, _ids_digest([ident])
        if type(old) is list and len(old) == 2 and old[0] == ident_digest and type(old[1]) is list:
            names = old[1] if all(type(n) is str for n in old[1]) else None
        if names is None:
            try:
                with os.scandir(folder) as entries:
                    names = sorted(e.name for e in entries if e.name[0] != "." and e.is_dir())
            except OSError:
                return []
        self.listed[key] = names
        settled = ident[1] < self.settled and ident[2] < self.settled
        self.folder_ids[key] = (_IDENTITY.pack(*ident), settled)
        if key and settled:  # never the root's: every save
            self.new["folders"][key] = [ident_digest, names]  # (and publish) changes it
        elif key in self.old["folders"]:  # kept, though it will not match again: no rewrite for a new shard
            self.new["folders"][key] = self.old["folders"][key]
        return names

    def indexed(self, directory: str) -> tuple[ShardFiles, list[str], list[bytes]] | None:
        """The shard, its files' crc32s as its entry says and the identities compared (packed), when the folder,
        the manifest and every file it lists are unchanged."""
        key = directory[len(self.base) :]
        entry = self.old["shards"].get(key)
        prefix = directory + _SEP
        try:
            ids, version, parts, summaries, texts, crcs = entry  # type: ignore[misc]
            names = [*parts, *(summaries or ()), *texts]
            if len(names) != len(crcs):
                return None
            packed = [
                _packed_identity(directory),
                _packed_identity(prefix + MANIFEST),
                *[_packed_identity(prefix + name) for name in names],
            ]
            if _digest(b"".join(packed)) != ids:
                return None
            found = _files(directory, version, parts, summaries, texts)
        except (OSError, TypeError, ValueError, struct.error):
            return None
        self.new["shards"][key] = entry
        return found, crcs, packed

    def record(self, directory: str, entry: list[Any]) -> list[bytes] | None:
        """Index a validated shard (_validate's entry: the identities, then what the index keeps beside them);
        its identities packed when it was indexed."""
        key = directory[len(self.base) :]
        ids, *kept = entry
        if self.settled_ids(*ids):
            try:
                packed = [_IDENTITY.pack(*ident) for ident in ids]
            except struct.error:  # not a file's identity (the record's values are checked as ints only)
                return None
            self.new["shards"][key] = [_digest(b"".join(packed)), *kept]
            return packed
        if key in self.old["shards"]:  # kept, though it will not match again (as for folders)
            self.new["shards"][key] = self.old["shards"][key]
        return None

    def indexed_iteration(self, folder: str) -> list[tuple[str, str, ShardFiles, list[str]]] | None:
        """Every shard below an iteration folder (view, folder, files, crc32s) as the index holds them, when that
        folder, every folder below it and every shard's folder, manifest and file are unchanged: one digest of
        their identities compared per iteration, where shard by shard a scan of 2,000 iterations spends more
        time on its own bookkeeping than on the 30,000 stats."""
        key = folder[len(self.base) :]
        entry = self.old["iterations"].get(key)
        if entry is None:
            return None
        try:
            digest, folders, shard_names = entry
            paths, found = [folder, *[folder + _SEP + f for f in folders]], []
            for name in shard_names:
                shard = self.old["shards"][key + _SEP + name]
                _, version, parts, summaries, texts, crcs = shard
                names = [*parts, *(summaries or ()), *texts]
                if len(names) != len(crcs):
                    return None
                directory = folder + _SEP + name
                prefix = directory + _SEP
                paths += [directory, prefix + MANIFEST, *[prefix + n for n in names]]
                found.append(
                    (
                        _VIEW_OF[name.split(_SEP, 1)[0]],
                        directory,
                        _files(directory, version, parts, summaries, texts),
                        crcs,
                        shard,
                    )
                )
            if _digest(b"".join([_packed_identity(p) for p in paths])) != digest:
                return None
        except (OSError, TypeError, ValueError, KeyError, AttributeError, struct.error):
            return None
        self.new["iterations"][key] = entry
        for _, directory, _, _, shard in found:
            self.new["shards"][directory[len(self.base) :]] = shard
        return [(view, directory, files, crcs) for view, directory, files, crcs, _ in found]

    def record_iteration(self, folder: str, shards: dict[str, list[bytes]]) -> None:
        """Index an iteration folder whose every folder was listed at settled identities and whose every shard
        (`shards`: folder -> packed identities) was indexed; its folders' own entries are then not needed."""
        key = folder[len(self.base) :]
        below = sorted(k for k in self.folder_ids if k.startswith(key + _SEP))
        if key not in self.folder_ids or not all(self.folder_ids[k][1] for k in (key, *below)):
            return
        names = sorted(shards)
        packed = [self.folder_ids[k][0] for k in (key, *below)]
        packed += [ident for name in names for ident in shards[name]]
        self.new["iterations"][key] = [
            _digest(b"".join(packed)),
            [k[len(key) + 1 :] for k in below],
            [name[len(folder) + 1 :] for name in names],
        ]
        for k in (key, *below):
            self.new["folders"].pop(k, None)

    def save(self, whole_root: bool) -> None:
        """Written when it changed, under a temporary name then renamed (atomic); best effort: a root that cannot
        be written, or a concurrent scan winning the rename, only means more validation later. A whole-root scan
        drops the entries of folders gone since; a narrowed one keeps the others'."""
        new = self.new if whole_root else {k: {**self.old[k], **self.new[k]} for k in self.new}
        if new == self.old:
            return
        body = json.dumps(new, separators=(",", ":"), sort_keys=True).encode()
        tmp = self.path.with_name(f".{INDEX}.tmp-{os.getpid()}")
        try:
            self.path.parent.mkdir(exist_ok=True)
            tmp.write_bytes(json.dumps({"version": VERSION, "digest": _digest(body)}).encode() + b"\n" + body)
            os.replace(tmp, self.path)
            _LOADED[str(self.path)] = (identity(str(self.path)), new)
        except OSError:
            tmp.unlink(missing_ok=True)


def _files(directory: str, version: str, parts: list[str], summaries: list[str] | None, texts: list[str]) -> ShardFiles:
    """A shard's files from their names (as its manifest, or its index entry, lists them)."""
    prefix = directory + _SEP
    return ShardFiles(
        [prefix + n for n in parts],
        version,
        None if summaries is None else [prefix + n for n in summaries],
        tuple(prefix + n for n in texts),
    )


def _digest(body: bytes) -> str:
    return hashlib.blake2b(body, digest_size=16).hexdigest()


_IDENTITY = struct.Struct("<QqqQQ")  # size, mtime_ns, ctime_ns (signed: before 1970), inode, device


def _ids_digest(ids: list[list[int]]) -> str:
    """One digest of identities (what the index keeps of them): equal exactly when every identity is (up to a
    128-bit blake2b collision). Packed, not formatted: a scan digests thousands of them."""
    return _digest(b"".join([_IDENTITY.pack(*ident) for ident in ids]))


def _packed_identity(path: str) -> bytes:
    """identity(path), packed as _ids_digest packs it (a stat and no list: the scan's inner loop)."""
    st = os.stat(path)
    return _IDENTITY.pack(st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino, st.st_dev)


@functools.lru_cache(maxsize=64)
def _matcher(pattern: str) -> Callable[[str], Any]:
    return re.compile(fnmatch.translate(pattern)).match


def _folders(index: _Index, bases: list[str], names: tuple[str, ...]) -> list[str]:
    """The folders below `bases` that `names` match level by level, as glob.glob matches them (a pattern never
    matches a hidden name), each level from the index while unchanged."""
    found = bases
    for name in names:
        match = _matcher(name)
        found = [folder + _SEP + sub for folder in found for sub in index.subfolders(folder) if match(sub)]
    return found


def _validate(directory: str, schema: pa.Schema, force: bool) -> tuple[ShardFiles, list[str], list[Any] | None]:
    """The shard checked from its manifest (raises ShardError/OSError), its files' crc32s, and its index entry
    (None: not indexable, e.g. a root where verification records cannot be written)."""
    global VALIDATED
    VALIDATED += 1
    d = Path(directory)
    manifest_id = identity(directory + _SEP + MANIFEST)  # before reading it: a later replacement has a new inode
    manifest = committed_manifest(d, schema)
    summaries, texts = summary_parts(manifest), text_parts(manifest)
    for part in manifest.parts:
        check_part(d, part, schema, force)
    for part in [*summaries, *texts]:
        check_summary(d, part, force)
    files = _files(
        directory,
        manifest.schema,
        [p.name for p in manifest.parts],
        [p.name for p in summaries] if summaries else None,
        [p.name for p in texts],
    )
    listed = [*manifest.parts, *summaries, *texts]
    crcs = [p.crc32 for p in listed]
    # The identities each file was verified at (the record's, never a stat taken now): a change after the
    # check makes the entry fail, never pass.
    record, file_ids = verified.load(d), []
    for p in listed:
        e = record.get(p.name)
        if not e or e.get("crc32") != p.crc32 or e.get("size") != p.bytes:
            return files, crcs, None
        file_ids.append([e.get(k) for k in verified.IDENTITY])
        if not all(isinstance(v, int) for v in file_ids[-1]):
            return files, crcs, None
    dir_id = identity(directory)  # after the checks wrote the record; a part added since changes it again
    if set(fnmatch.filter(os.listdir(directory), PART_GLOB)) - {p.name for p in manifest.parts}:
        return files, crcs, None  # one appeared while validating: the next scan names it
    return (
        files,
        crcs,
        [
            [dir_id, manifest_id, *file_ids],
            manifest.schema,
            [p.name for p in manifest.parts],
            [p.name for p in summaries] if summaries else None,
            [p.name for p in texts],
            crcs,
        ],
    )


def _not_committed(directory: str) -> bool:
    """A folder without a manifest that holds parts: a stage writing it, or one that crashed before committing."""
    names = os.listdir(directory)
    return bool(fnmatch.filter(names, PART_GLOB) or fnmatch.filter(names, ".part-*"))


def _named_as_input(directory: str) -> str | None:
    """The manifest of a shard of the same iteration that records `directory`'s manifest as its input (so
    `directory` was committed and has lost its manifest since), or None. Read only for a folder of parts without a
    manifest: rare, and the whole iteration's manifests are few."""
    iteration = directory
    while not os.path.basename(iteration).startswith("iteration="):
        if os.path.dirname(iteration) == iteration:
            return None
        iteration = os.path.dirname(iteration)
    lost = directory + _SEP + MANIFEST
    for manifest in sorted(Path(iteration).rglob(MANIFEST)):
        try:
            inputs = json.loads(manifest.read_bytes()).get("inputs") or []
        except (OSError, ValueError, AttributeError):
            continue  # a manifest unreadable itself is named where its own shard is scanned
        # recorded relative to the root (earlier cleaners: absolute)
        if any(isinstance(i, str) and (i == lost or lost.endswith(_SEP + i)) for i in inputs):
            return str(manifest)
    return None


def _shard(
    index: _Index, directory: str, schema: pa.Schema, verify: bool, problems: list[Problem]
) -> tuple[ShardFiles, list[str], list[bytes] | None] | None:
    """A shard folder through the index, else validated from its manifest: its files, their crc32s and its packed
    identities when it is indexed (None: it is not, or not yet). None for a folder that is no committed, valid
    shard (named in `problems` when it holds parts)."""
    indexed = None if verify else index.indexed(directory)
    if indexed is not None:
        return indexed
    if not os.path.isfile(directory + _SEP + MANIFEST):
        if _not_committed(directory):
            named_by = _named_as_input(directory)
            problems.append(
                Problem(
                    Path(directory),
                    f"{directory}: committed, but its {MANIFEST} is gone ({named_by} "
                    "names it as its input): restore the file from a copy of the store, or remove the "
                    "iteration's shards and run them again",
                    True,
                )
                if named_by
                else Problem(
                    Path(directory),
                    f"{directory}: not committed (no {MANIFEST}: its stage is "
                    "writing it or crashed before committing; rerun the stage)",
                    False,
                )
            )
        return None
    try:
        found, crcs, entry = _validate(directory, schema, verify)
    except (ShardError, OSError) as e:
        problems.append(Problem(Path(directory), str(e), True))
        return None
    return found, crcs, None if entry is None else index.record(directory, entry)


def scan(root: Path, verify: bool = False, iterations: str = ITERATIONS) -> Scan:
    """The committed, validated shards under `root`, through the root's index (`verify`: every file checked in
    full whatever the index and the verification records say). `iterations` narrows the scan to some iteration
    folders (a glob under the root, e.g. `runs/demo/iteration=0007`): a catalog of one iteration costs the
    same at iteration 2,000 as at 20. Only a whole-root scan packs files (storage/packs.py)."""
    root = Path(root).resolve()
    index, whole_root = _Index(root), iterations == ITERATIONS
    cut = len(index.base)
    found: dict[str, list[tuple[str, ShardFiles, list[str]]]] = {view: [] for view in SOURCES}
    problems: dict[str, list[Problem]] = {view: [] for view in SOURCES}
    for it in _folders(index, [str(root)], tuple(Path(iterations).parts)):
        unchanged = None if verify else index.indexed_iteration(it)
        if unchanged is not None:
            for view, directory, files, crcs in unchanged:
                found[view].append((directory, files, crcs))
            continue
        indexed: dict[str, list[bytes]] = {}  # shard folder -> packed identities, of each shard indexed
        complete = True  # every folder below `it` a shard, and each one indexed
        for view, (names, schema) in SOURCES.items():
            for directory in _folders(index, [it], names):
                shard = _shard(index, directory, schema, verify, problems[view])
                if shard is None or shard[2] is None:
                    complete = False
                if shard is not None:
                    found[view].append((directory, shard[0], shard[1]))
                    if shard[2] is not None:
                        indexed[directory] = shard[2]
        if complete and not verify:
            index.record_iteration(it, indexed)
    shards: dict[str, list[ShardFiles]] = {view: [] for view in SOURCES}
    packable: dict[str, dict[str, tuple[str, str]]] = {kind: {} for kind in packs.KINDS}  # path -> crc32, version
    for view in SOURCES:
        kinds = [(kind, what) for kind, (v, what) in packs.KINDS.items() if v == view]
        for _, files, crcs in sorted(found[view], key=lambda f: f[0]):
            shards[view].append(files)
            for kind, what in kinds:  # crcs are in the order parts, summaries, texts
                first, paths = (0, files.parts) if what == "parts" else (len(files.parts), files.summaries or ())
                for i, path in enumerate(paths, first):
                    packable[kind][path[cut:]] = (crcs[i], files.version)
    held: dict[str, list[tuple[str, str, set[str]]]] = {}
    if whole_root:
        pk = packs.Packs(root, index.old["packs"], packable, index.settled, verify)
        pk.update()
        index.new["packs"], held = pk.packs, pk.of()
        pk.collect()
    index.save(whole_root)
    ordered = [p for view in SOURCES for p in sorted(problems[view], key=lambda p: str(p.path))]
    return Scan(shards, ordered, held)
