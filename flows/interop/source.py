"""What an export reads and where it writes: the committed shards of a run that a selection names (iterations, a
purified partition), their rows a row group at a time, the tokenizer of the checkpoint that sampled them, and the
output folder, staged beside its final name and renamed into place whole."""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator

import pyarrow as pa

from storage.errors import CleanerError, os_error
from storage.layout import DEFAULT_MEASURE_KEY, RunLayout, format_threshold, missing_run, resolve_recorded
from storage.schemas import PURIFIED, RAW
from storage.shards import Manifest, committed_manifest, iter_part_batches, read_manifest
from storage.texts import TOKENIZER_FILE, load_decoder

# rows read at a time: 64 rows of 8,192 tokens with their attempt trees are a few MiB as Arrow (trl-sft stays
# column-wise); formats built row by row hold a batch as Python objects (~3 MiB a row at 8,192 tokens), so fewer
BATCH_ROWS = 64
ROWWISE_BATCH_ROWS = 16
# mode=saar/gamma=0.50, mode=saar/gamma=0.50-difflib-code, mode=saar_is/tau=0.30, mode=raw/gamma=0.00
PARTITION = re.compile(r"^mode=(?P<mode>[a-z_]+)/(?P<kind>gamma|tau)=(?P<value>\d+(\.\d+)?)(-(?P<measure>[\w-]+))?$")

Decode = Callable[[list[list[int]]], list[str]]


class InteropError(CleanerError, ValueError):
    """An export or import that cannot go on (a selection that names nothing, an output folder in use, a file that
    is not what its format says); nothing was written."""

    exit_code = 2


@dataclass(frozen=True)
class Partition:
    """A purified partition as `--partition` names it (its folder under an iteration's purified/)."""

    path: str
    mode: str
    threshold_kind: str  # "gamma" (similarity modes and the others, at 0.00) or "tau" (importance-ratio modes)
    threshold: float
    measure: str  # the similarity measure's key; the default one when the folder has no suffix

    def describe(self) -> str:
        symbol = "τ" if self.threshold_kind == "tau" else "γ"
        return f"mode {self.mode}, {symbol} = {self.threshold:g}, similarity measure {self.measure}"


def parse_partition(text: str) -> Partition:
    path = text.strip().strip("/")
    m = PARTITION.match(path)
    if m is None:
        raise InteropError(
            f"--partition {text!r}: expected a purified partition such as mode=saar/gamma=0.50 or "
            "mode=saar_is/tau=0.30 (the folder under an iteration's purified/)"
        )
    # the folder as the writer names it: gamma=0.5 is gamma=0.50
    folder = f"{m['kind']}={format_threshold(float(m['value']))}" + (f"-{m['measure']}" if m["measure"] else "")
    path = f"mode={m['mode']}/{folder}"
    return Partition(path, m["mode"], m["kind"], float(m["value"]), m["measure"] or DEFAULT_MEASURE_KEY)


@dataclass(frozen=True)
class Shard:
    """One committed shard an export reads."""

    iteration: int
    directory: Path
    schema: pa.Schema
    manifest: Manifest

    def batches(self, batch_rows: int = BATCH_ROWS) -> Iterator[pa.Table]:
        """Its rows, validated part by part (size, crc32, schema, rows), `batch_rows` at a time."""
        for part in self.manifest.parts:
            yield from iter_part_batches(self.directory, part, self.schema, batch_rows)


@dataclass(frozen=True)
class Selection:
    """Per iteration, its raw shard and (when a partition is named) the partition's shard."""

    run_id: str
    raw: list[Shard]
    purified: list[Shard]
    partition: Partition | None


def _partitions_of(iteration_dir: Path) -> list[str]:
    return sorted(
        p.relative_to(iteration_dir / "purified").as_posix()
        for p in (iteration_dir / "purified").glob("mode=*/*")
        if read_manifest(p) is not None
    )


def select(root: Path, run_id: str, iterations: list[int] | None, partition: Partition | None) -> Selection:
    """The committed shards of `run_id` an export reads: every iteration with a committed raw shard (and the
    partition, when named) unless `iterations` names some, each of which must have them."""
    layout = RunLayout(root, run_id)
    missing = missing_run(root, run_id)
    if missing:
        raise InteropError(missing)
    known = [i for i in layout.iterations() if read_manifest(layout.raw_dir(i)) is not None]
    if iterations is None:
        chosen = known
        if partition is not None:
            chosen = [i for i in known if read_manifest(layout.iteration_dir(i) / "purified" / partition.path)]
    else:
        chosen = list(dict.fromkeys(iterations))
        for i in chosen:
            if i not in known:
                raise InteropError(
                    f"run {run_id!r} has no iteration {i} with a committed raw shard (no "
                    f"{layout.raw_dir(i) / '_MANIFEST.json'}); its iterations: "
                    f"{', '.join(map(str, known)) or 'none'}"
                )
    if not chosen and partition is not None and known:
        have = sorted({p for i in known for p in _partitions_of(layout.iteration_dir(i))})
        raise InteropError(
            f"run {run_id!r} has no committed partition {partition.path} in any iteration under {root} "
            f"(its partitions: {', '.join(have) or 'none'})"
        )
    if not chosen:
        raise InteropError(f"run {run_id!r} has no committed iteration under {root}")
    raw, purified = [], []
    for i in chosen:
        raw.append(Shard(i, layout.raw_dir(i), RAW, committed_manifest(layout.raw_dir(i), RAW)))
        if partition is None:
            continue
        where = layout.iteration_dir(i) / "purified" / partition.path
        if read_manifest(where) is None:
            have = _partitions_of(layout.iteration_dir(i))
            raise InteropError(
                f"run {run_id!r} iteration {i} has no committed partition {partition.path} (no "
                f"{where / '_MANIFEST.json'}); its partitions: {', '.join(have) or 'none'}"
            )
        purified.append(Shard(i, where, PURIFIED, committed_manifest(where, PURIFIED)))
    return Selection(run_id, raw, purified, partition)


def sampling_checkpoint(root: Path, raw_manifest: Manifest) -> Path | None:
    """The checkpoint a raw shard's manifest names as its input (the policy that sampled it), if it names one."""
    return resolve_recorded(root, raw_manifest.inputs[0]) if raw_manifest.inputs else None


def decoder_of(checkpoint: Path | None) -> Decode | None:
    """The batch decoder of a checkpoint's tokenizer (special tokens kept), or None when it has no tokenizer.json
    (a synthetic store): text is then left out, never guessed."""
    if checkpoint is None or not (Path(checkpoint) / TOKENIZER_FILE).is_file():
        return None
    return load_decoder(Path(checkpoint) / TOKENIZER_FILE)


def check_out_dir(out: Path) -> Path:
    """--out as a folder an export may create: absent or empty, in a folder that exists."""
    out = Path(out)
    if out.exists() and not out.is_dir():
        raise InteropError(f"--out {out}: is a file; give a new or empty folder")
    if out.is_dir() and any(out.iterdir()):
        raise InteropError(f"--out {out}: the folder is not empty; give a new or empty folder (nothing was written)")
    if not out.parent.is_dir():
        raise InteropError(f"--out {out}: folder {out.parent} does not exist")
    return out


@contextlib.contextmanager
def staged_output(out: Path) -> Iterator[Path]:
    """A staging folder beside `out` for the block to write into, renamed to `out` when the block ends without
    error and removed otherwise: `out` is whole or absent, never half-written."""
    from storage.staging import clean_stale, locked

    out = check_out_dir(out)
    prefix = f".{out.name}.staging"
    # an export killed (-9) left its staging folder; a live one holds the flock of the folder's .lock (on a shared
    # filesystem too, where a pid names nothing)
    clean_stale(out.parent, prefix, remove_root=False)
    staging = out.parent / f"{prefix}-{uuid.uuid4().hex[:8]}"
    with locked(staging.with_name(staging.name + ".lock")):
        try:
            staging.mkdir()
        except OSError as e:
            raise os_error(e, f"creating {staging}") from None
        try:
            yield staging
            if out.is_dir():
                out.rmdir()  # empty (checked above); a file written into it meanwhile makes this fail, loudly
            os.rename(staging, out)
        except OSError as e:
            shutil.rmtree(staging, ignore_errors=True)
            raise os_error(e, f"writing {out}") from None
        except BaseException:
            shutil.rmtree(staging, ignore_errors=True)
            raise
