"""Compare two stores' runs file by file: Parquet content (wall-clock fields aside), checkpoint weights and optimizer
state byte for byte. `python scripts/compare_runs.py STORE_A STORE_B` prints each difference and exits 1 if any.

Used to show a redesign kept the demo's outputs: run `cleaner demo` in a tree of the old commit and of the new one,
then compare their workspace/ directories."""

from __future__ import annotations

import hashlib
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

# Measured, not computed: they differ between any two runs of the same code
WALL_CLOCK = {"duration_s", "wall_s", "created_at", "committed_at", "seconds"}
BYTES = (".safetensors", ".pt", ".bin")


def _without_wall_clock(value: object) -> object:
    if isinstance(value, dict):
        return {k: _without_wall_clock(v) for k, v in value.items() if k not in WALL_CLOCK}
    if isinstance(value, list):
        return [_without_wall_clock(v) for v in value]
    return value


def _rows(path: Path) -> tuple[pa.Schema, list]:
    table = pq.read_table(path)
    # a metrics shard holds one (name, value) row per metric: its wall-clock rows are left out whole
    return table.schema, [_without_wall_clock(r) for r in table.to_pylist() if r.get("name") not in WALL_CLOCK]


def compare(a: Path, b: Path) -> list[str]:
    files_a = {p.relative_to(a) for p in (a / "runs").rglob("*") if p.is_file()}
    files_b = {p.relative_to(b) for p in (b / "runs").rglob("*") if p.is_file()}
    diffs = [f"only in {a}: {p}" for p in sorted(files_a - files_b)]
    diffs += [f"only in {b}: {p}" for p in sorted(files_b - files_a)]
    for rel in sorted(files_a & files_b):
        if rel.suffix == ".parquet":
            (schema_a, rows_a), (schema_b, rows_b) = _rows(a / rel), _rows(b / rel)
            if schema_a.names != schema_b.names:
                diffs.append(f"{rel}: columns {sorted(set(schema_a.names) ^ set(schema_b.names))} differ")
                common = [n for n in schema_a.names if n in schema_b.names]
                rows_a = [{k: r[k] for k in common} for r in rows_a]
                rows_b = [{k: r[k] for k in common} for r in rows_b]
            if rows_a != rows_b:
                diffs.append(f"{rel}: rows differ")
        elif rel.suffix in BYTES:
            if hashlib.sha256((a / rel).read_bytes()).digest() != hashlib.sha256((b / rel).read_bytes()).digest():
                diffs.append(f"{rel}: bytes differ")
    return diffs


def main(argv: list[str]) -> int:
    if len(argv) != 2:
        print(__doc__, file=sys.stderr)
        return 2
    diffs = compare(Path(argv[0]), Path(argv[1]))
    for d in diffs:
        print(d)
    print(f"{len(diffs)} difference(s)")
    return 1 if diffs else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
