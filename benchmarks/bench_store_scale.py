"""A store at real size (issue #31): `cleaner inspect` and the catalog's republication after a commit, at 20,
200 and 2,000 iterations of a run, stores built by benchmarks/store_generator.py with the project's writer.

20 and 200 iterations hold 64 × 8,192-token rows per iteration (raw + saar purified + metrics); the 2,000-
iteration store holds 64 × 1,024-token rows (the same number of shards and files, an eighth of the bytes: the
8,192-token version would be 28 GB and 20 minutes to write here). What inspect reads does not grow with the
tokens per row since the row summaries (storage/summaries.py); what grows is the number of shards, which the
scan index (storage/shard_index.py) and the packs of small files (storage/packs.py) keep out of most of it.
"""
from __future__ import annotations

import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.common import BenchResult, Row
from benchmarks.store_generator import build
from storage.shard_index import SETTLE_NS

ROOT = Path(__file__).resolve().parent.parent


def _cli(root: Path, *args: str) -> float:
    t0 = time.perf_counter()
    out = subprocess.run([sys.executable, "-m", "flows.cli", "inspect", *args, f"storage.root={root}"], cwd=ROOT,
                         capture_output=True, text=True, env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin",
                                                              "TOKENIZERS_PARALLELISM": "false"})
    if out.returncode != 0:
        raise RuntimeError(out.stderr[-2000:])
    return time.perf_counter() - t0


def _best(root: Path, *args: str, repeat: int = 3) -> float:
    return min(_cli(root, *args) for _ in range(repeat))


def _republish(root: Path, iteration: int, tokens: int) -> float:
    """One more iteration committed, then the catalog published again (what a flow does after a commit)."""
    from storage.catalog import publish

    build(root, 1, tokens=tokens, start=iteration, log=None)
    t0 = time.perf_counter()
    publish(root, root / "catalog.duckdb")
    return time.perf_counter() - t0


def run() -> BenchResult:
    tmp = Path(tempfile.mkdtemp(prefix="bench-store-"))
    rows: list[Row] = []
    notes: list[str] = []
    measured: dict[int, tuple[float, float, float, float]] = {}
    try:
        for n, tokens in ((20, 8192), (200, 8192), (2000, 1024)):
            root = tmp / f"store-{n}"
            t0 = time.perf_counter()
            build(root, n, tokens=tokens, log=None)
            built = time.perf_counter() - t0
            size = sum(f.stat().st_size for f in root.rglob("*") if f.is_file())
            first = _cli(root, "--sql", "SELECT 1")  # first process: every part checked once, the index built
            # A store's history is older than the index's settle time (identities younger are not indexed):
            # measured once the last shards written have settled too, as any store a moment after its last commit.
            time.sleep(SETTLE_NS / 1e9 + 0.5)
            _cli(root, "--sql", "SELECT 1")
            sql = _best(root, "--sql", "SELECT count(*) FROM raw_trajectories")
            summary = _best(root)
            republish = min(_republish(root, n + k, tokens) for k in range(3))
            measured[n] = (sql, summary, republish, size)
            notes.append(f"{n} iterations × 64 rows × {tokens:,} tokens: {size / 2**30:.2f} GiB, built in {built:.0f} s; "
                         f"the first inspect after it (index and packs built) {first:.1f} s")
            shutil.rmtree(root, ignore_errors=True)
        base = measured[20]
        for n in (200, 2000):
            sql, summary, republish, _ = measured[n]
            rows.append(Row(f"cleaner inspect --sql 'count(*)' at {n} iterations (vs 20)", sql, base[0], "s",
                            higher_is_better=False, target="<= 1.5× and <= 2 s",
                            passed=n < 2000 or (sql <= 1.5 * base[0] and sql <= 2.0)))
            rows.append(Row(f"cleaner inspect (summary tables) at {n} iterations (vs 20)", summary, base[1], "s",
                            higher_is_better=False, target="<= 1.5× and <= 2 s",
                            passed=n < 2000 or (summary <= 1.5 * base[1] and summary <= 2.0)))
            rows.append(Row(f"republish the catalog after one more commit at {n} iterations (vs 20)", republish,
                            base[2], "s", higher_is_better=False, target="<= 0.5 s" if n == 2000 else "",
                            passed=republish <= 0.5 if n == 2000 else None))
        notes.append("inspect times are whole `cleaner inspect` processes (Python start-up and imports included, "
                     "about 0.5 s here), best of 3, after a first process has checked every part once and built the "
                     "scan index and the packs; republish is storage.catalog.publish in-process right after an "
                     "iteration was committed, best of 3")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return BenchResult("store_scale", "A store at real size: inspect and republication at 20, 200 and 2,000 "
                       "iterations.", rows, notes)
