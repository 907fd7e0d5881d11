"""Retention (`cleaner gc`): which checkpoints and replay partitions of a run can go, and removing them
one at a time without ever leaving a half-removed one.

What a run keeps, whatever is asked:
- the newest `keep_last` committed checkpoints (at least the newest: the next rollout and a resumed
  update start from it), every checkpoint named in `keep`, and any checkpoint folder without its done
  marker (an update is writing it, or died doing so: its rerun owns it);
- the partitions the run's own flow writes and trains on (`protected`, from its frozen config) and every raw
  shard.

An item is removed by renaming it into `<root>/.trash/` (one rename: the catalog and every reader see it
whole or not at all), then deleting it there; a gc killed in between leaves only trash, which the next gc
empties. The catalog is republished by the caller.
"""

from __future__ import annotations

import os
import shutil
import uuid
from dataclasses import dataclass
from pathlib import Path

from storage.checkpoints import DONE_MARKER
from storage.errors import CleanerError
from storage.layout import RunLayout, missing_run

TRASH = ".trash"


class RetentionError(CleanerError, ValueError):
    """A gc request that cannot be carried out as asked; nothing was removed."""


@dataclass(frozen=True)
class Removal:
    path: Path
    what: str  # "checkpoint" | "partition" | "dead letters" | "partial update" | "update staging" | "update config"
    bytes: int


def _size(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def _iteration_of(path: Path) -> int:
    return int(path.name.split("=", 1)[1])


def plan(
    root: Path,
    run_id: str,
    keep_last: int,
    keep: tuple[int, ...] = (),
    partitions: tuple[str, ...] = (),
    protected: set[str] | frozenset[str] = frozenset(),
) -> list[Removal]:
    """What `gc` would remove: checkpoints beyond the newest `keep_last` (and not in `keep`), and the
    purified and dead-letter partitions named like `mode=saar/gamma=0.30` in every iteration."""
    if keep_last < 1:
        raise RetentionError(
            f"--keep-last {keep_last}: at least 1 (the newest checkpoint is what a resumed run starts from)"
        )
    root = Path(root)
    if root.exists() and not root.is_dir():
        raise RetentionError(f"storage.root {root} is not a folder")
    layout = RunLayout(root, run_id)
    missing = missing_run(root, run_id)
    if missing:
        raise RetentionError(missing)
    for name in partitions:
        if name.count("/") != 1 or not name.startswith("mode=") or "=" not in name.split("/")[1]:
            raise RetentionError(
                f"--remove-partition {name!r}: expected the form mode=MODE/gamma=G (or tau=T), "
                "as under iteration=*/purified/"
            )
        if name in protected:
            raise RetentionError(
                f"--remove-partition {name}: the run's own flow writes it (purify.modes/gammas or "
                "train.mode/gamma): a resumed run would purify it again; only replay partitions go"
            )
    done = sorted(
        (p for p in (layout.run_dir / "checkpoints").glob("iteration=*") if (p / DONE_MARKER).is_file()),
        key=_iteration_of,
    )
    numbers = [_iteration_of(p) for p in done]
    for k in keep:  # a typo would keep nothing it meant to, silently
        if k not in numbers:
            raise RetentionError(
                f"--keep {k}: run {run_id!r} has no checkpoint {k} (its checkpoints: "
                f"{', '.join(map(str, numbers)) or 'none'})"
            )
    kept = set(done[-keep_last:]) | {p for p in done if _iteration_of(p) in keep}
    out = [Removal(p, "checkpoint", _size(p)) for p in done if p not in kept]
    # what an update attempt leaves beside its checkpoint once that is committed (killed, or other settings):
    # its partial mini-batches, its staging folder, a DeepSpeed launch's frozen config; nothing reads them any more
    for suffix, what in ((".partial", "partial update"), (".tmp", "update staging"), (".config.yaml", "update config")):
        for p in sorted((layout.run_dir / "checkpoints").glob(f"iteration=*{suffix}")):
            if (p.with_name(p.name.removesuffix(suffix)) / DONE_MARKER).is_file():
                out.append(Removal(p, what, _size(p) if p.is_dir() else p.stat().st_size))
    for name in partitions:
        for kind, what in (("purified", "partition"), ("dead_letter", "dead letters")):
            for p in sorted(layout.run_dir.glob(f"iteration=*/{kind}/{name}")):
                if p.is_dir():
                    out.append(Removal(p, what, _size(p)))
    return out


def partitions_of(root: Path, run_id: str) -> list[str]:
    """The purified partitions (mode=…/gamma=… or tau=…) some iteration of the run holds."""
    return sorted(
        {f"{p.parent.name}/{p.name}" for p in RunLayout(root, run_id).run_dir.glob("iteration=*/purified/mode=*/*")}
    )


def empty_trash(root: Path) -> None:
    trash = Path(root) / TRASH
    if trash.is_dir():
        for entry in trash.iterdir():
            if entry.is_dir():
                shutil.rmtree(entry, ignore_errors=True)
            else:
                entry.unlink(missing_ok=True)


def remove(root: Path, item: Removal) -> None:
    """Rename the item into the trash (atomic: it is gone from the store at once), then delete it."""
    trash = Path(root) / TRASH
    trash.mkdir(exist_ok=True)
    target = trash / f"{uuid.uuid4().hex[:8]}-{item.path.name}"
    try:
        os.rename(item.path, target)
    except FileNotFoundError:  # removed meanwhile (another gc of the run): what this one came to do
        return
    if target.is_dir():
        shutil.rmtree(target, ignore_errors=True)
    else:
        target.unlink(missing_ok=True)
