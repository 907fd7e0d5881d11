"""`cleaner export` and `cleaner import` at real size (issue 45): iterations of 64 × 8,192-token raw rows whose
checkpoint is the real Qwen3 tokenizer (policies/qwen3-tokenizer, 151,936 ids; the rows are benchmarks/
store_generator.py's: random ids, one position, one attempt each) and their saar partitions, exported as trl-sft
and as ATIF, and the ATIF imported back as a new run. Each step runs in a process of its own, so its peak
resident set is its own. Export and import hold a batch of rows at a time, so memory is bounded by a batch, not
by the run: the peak of three iterations is compared with that of one. Rows/s against reading the shards alone
(validated, every row decoded to Arrow), and the bytes written against the source shards'."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.common import BenchResult, Row, peak_rss_bytes

ROOT = Path(__file__).resolve().parent.parent
QWEN3 = ROOT / "policies" / "qwen3-tokenizer"
ROWS, TOKENS, ITERATIONS = 64, 8192, 3


def _store(root: Path) -> int:
    """The iterations (raw shard + saar partition each) under root; returns the raw parts' bytes."""
    import numpy as np

    from benchmarks.store_generator import purified_table, raw_table
    from storage.layout import RunLayout
    from storage.schemas import PURIFIED, RAW
    from storage.shards import write_shard

    layout = RunLayout(root, "big")
    total = 0
    for i in range(ITERATIONS):
        raw = raw_table("big", i, ROWS, TOKENS, np.random.default_rng(i))
        manifest = write_shard(layout.raw_dir(i), raw, RAW, "gen", inputs=[str(QWEN3)])
        write_shard(layout.purified_dir(i, "saar", 0.5), purified_table(raw), PURIFIED, "gen")
        total += sum(p.bytes for p in manifest.parts)
    return total


def _step(kind: str, root: Path, out: Path, iterations: list[int] | None) -> dict:
    """One measured step, in this (fresh) process; the code it runs is imported before the clock starts."""
    from flows.export_cmd import run_export
    from flows.import_cmd import run_import
    from flows.interop.source import select
    from pipeline.config import load_config
    from storage.layout import RunLayout
    from storage.shards import read_manifest

    cfg = load_config(None, [f"storage.root={root}"])
    before = peak_rss_bytes()
    t0 = time.perf_counter()
    if kind == "read":
        rows = sum(b.num_rows for s in select(root, "big", iterations, None).raw for b in s.batches())
        written = 0
    elif kind == "import":
        files = sorted(out.glob("raw/*.jsonl"))[: len(iterations) if iterations else None]
        rows = run_import(cfg, files, "atif", "imported").rows
        layout = RunLayout(root, "imported")
        written = sum(p.bytes for i in layout.iterations() for p in read_manifest(layout.raw_dir(i)).parts)
    else:
        done = run_export(cfg, "big", iterations, "mode=saar/gamma=0.50" if kind == "trl-sft" else None, kind, out)
        rows, written = done.rows, done.bytes
    return {
        "seconds": time.perf_counter() - t0,
        "rows": rows,
        "bytes": written,
        "peak_rss": peak_rss_bytes(),
        "rss_before": before,
    }


def _in_process(kind: str, root: Path, out: Path, iterations: list[int] | None = None) -> dict:
    argv = [kind, str(root), str(out), ",".join(map(str, iterations or []))]
    done = subprocess.run(
        [sys.executable, "-m", "benchmarks.bench_interop", *argv], cwd=ROOT, capture_output=True, text=True, check=True
    )
    return json.loads(done.stdout.strip().splitlines()[-1])


def _grown(step: dict) -> float:
    return (step["peak_rss"] - step["rss_before"]) / 2**20


def run() -> BenchResult:
    tmp = Path(tempfile.mkdtemp(prefix="bench-interop-"))
    rows: list[Row] = []
    notes: list[str] = []
    try:
        source_bytes = _store(tmp / "ws")
        read = _in_process("read", tmp / "ws", tmp / "none")
        sft = _in_process("trl-sft", tmp / "ws", tmp / "sft")
        atif = _in_process("atif", tmp / "ws", tmp / "atif")
        back = _in_process("import", tmp / "ws", tmp / "atif")
        atif_one = _in_process("atif", tmp / "ws", tmp / "atif-one", [0])
        shutil.rmtree(tmp / "ws" / "runs" / "imported")
        back_one = _in_process("import", tmp / "ws", tmp / "atif", [0])
        read_rate = read["rows"] / read["seconds"]
        size = f"{ITERATIONS} × {ROWS} × {TOKENS:,} tokens"
        for name, step in (("export trl-sft", sft), ("export atif", atif), ("import atif", back)):
            rows.append(
                Row(f"{name}, {size} (vs reading the raw shards)", step["rows"] / step["seconds"], read_rate, "rows/s")
            )
        for name, step in (("trl-sft export", sft), ("ATIF export", atif), ("imported raw shards", back)):
            rows.append(
                Row(
                    f"{name} bytes (vs the source raw shards)",
                    step["bytes"] / 2**20,
                    source_bytes / 2**20,
                    "MiB",
                    higher_is_better=False,
                )
            )
        for name, many, one in (("export atif", atif, atif_one), ("import atif", back, back_one)):
            rows.append(
                Row(
                    f"{name}: peak RSS growth over {ITERATIONS} iterations (vs over 1)",
                    _grown(many),
                    _grown(one),
                    "MiB",
                    higher_is_better=False,
                    target="<= 1.2× (bounded by a batch)",
                    passed=_grown(many) <= 1.2 * _grown(one),
                )
            )
        notes.append(
            f"source: {ITERATIONS} iterations × {ROWS} rows × {TOKENS:,} lived tokens (random Qwen3 ids), "
            f"{source_bytes / 2**20:.1f} MiB of raw parts; read + validate alone {read['seconds']:.2f} s "
            f"(peak RSS growth {_grown(read):.0f} MiB); trl-sft export peak growth {_grown(sft):.0f} MiB"
        )
        notes.append(
            "the ATIF export holds each token id and log-prob as JSON text (one trajectory a line), so it "
            "is several times the zstd Parquet shards; the import rebuilds the rows exactly "
            "(tests/test_import.py) and commits them with their decoded text"
        )
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return BenchResult(
        "interop",
        "cleaner export / import at real size: 64 × 8,192-token rows an iteration with "
        "the Qwen3 tokenizer, each step in its own process (rows/s, bytes, peak memory).",
        rows,
        notes,
    )


if __name__ == "__main__":
    if len(sys.argv) == 5:
        chosen = [int(i) for i in sys.argv[4].split(",") if i] or None
        print(json.dumps(_step(sys.argv[1], Path(sys.argv[2]), Path(sys.argv[3]), chosen)))
    else:
        result = run()
        for row in result.rows:
            base = f" (baseline {row.baseline:.3f})" if row.baseline is not None else ""
            print(f"{row.metric}: {row.value:.3f} {row.unit}{base}")
        for note in result.notes:
            print(f"  {note}")
