"""`cleaner view` (issue 32): server-side time of one trajectory page at 16k tokens and of the index pages over
the store-scale benchmark's 200-iteration store, and what decoding text at commit (storage/texts.py) costs.

- Trajectory page: a raw shard of 64 rows with the real Qwen3 tokenizer (policies/qwen3-tokenizer, 151,936 ids),
  each row 8 positions whose first attempt fails and whose retry works, 16,384 tokens in its attempt tree; purified
  by purifier.saar in modes saar (γ 0.5) and raw, so the page aligns a 16k-token raw variant and a spliced one.
- Index: benchmarks/store_generator.py's 200 iterations × 64 rows × 8,192 tokens, catalog published; the runs
  page (/) and the run's iteration page (/runs/scale).
- Text at commit: the same 64 × 8,192-token raw shard written with and without its text file.
Times are the app's own (its Server-Timing header: the handler, the queries, the rendering, not the HTTP
client), through FastAPI's TestClient; warm is the best of 5 after a first view, which also loads the tokenizer
and the iteration's catalog.
"""

from __future__ import annotations

import math
import random
import re
import shutil
import tempfile
import time
from pathlib import Path

import numpy as np
import pyarrow as pa

from benchmarks.common import BenchResult, Row

ROOT = Path(__file__).resolve().parent.parent
QWEN3 = ROOT / "policies" / "qwen3-tokenizer"
TOKENS = 16_384
ROWS = 64


def _ms(response) -> float:
    return float(re.search(r"dur=([\d.]+)", response.headers["server-timing"]).group(1)) / 1000


def _timed(client, url: str, repeat: int = 5) -> tuple[float, float]:
    """(first view, best of `repeat` after it), server-side seconds."""
    first = client.get(url)
    assert first.status_code == 200, first.text[-2000:]
    return _ms(first), min(_ms(client.get(url)) for _ in range(repeat))


def _long_trajectory(rng: random.Random, idx: int, vocab: int, positions: int = 8):
    """A raw row whose attempt tree holds TOKENS tokens: every position a failed call, its error and a retry."""
    from pipeline.trajectory import Attempt, Position, ToolResult, Trajectory, TrajectoryStats, fingerprint

    per_turn = TOKENS // positions // 2 - 64  # two turns and two 64-token tool responses per position
    prompt = [rng.randrange(vocab) for _ in range(64)]
    lived: list[int] = []
    pos = []

    def attempt(k: int, context: list[int], failed: bool) -> Attempt:
        ids = [rng.randrange(vocab) for _ in range(per_turn)]
        result = (
            ToolResult(
                status="failure",
                text="Tool call failure\nNameError: x",
                error_label="NameError",
                error_class="model",
                exit_code=1,
            )
            if failed
            else ToolResult(status="success", text="Tool call success\nstdout: 1", exit_code=0)
        )
        return Attempt(
            attempt_idx=k,
            turn_ids=ids,
            logprobs=[-rng.random() * 2 for _ in ids],
            call_start=per_turn // 2,
            call_status="ok",
            context_len=len(context),
            context_fingerprint=fingerprint(context),
            code=f"print({idx} + {k})",
            result=result,
            feedback_ids=[rng.randrange(vocab) for _ in range(64)],
        )

    for p in range(positions):
        first = attempt(0, prompt + lived, True)
        retry = attempt(1, prompt + lived, False)
        pos.append(Position(p, [first, retry], "recovered"))
        lived += retry.turn_ids + retry.feedback_ids
    return Trajectory(
        run_id="long",
        iteration=0,
        prompt_id=f"p{idx // 8:03d}",
        sample_idx=idx % 8,
        policy_version="v",
        seed=idx,
        task_source="world",
        question="What is 1 + 1?",
        ground_truth="2",
        saar_gate=True,
        gate_p=1.0,
        live_mode="purified",
        gamma_live=0.5,
        max_retries=3,
        prompt_ids=prompt,
        lived_ids=lived,
        lived_mask=[1] * len(lived),
        lived_logprobs=[-0.5] * len(lived),
        positions=pos,
        final_turn=None,
        final_answer="2",
        reward=rng.choice([-1.0, 1.0]),
        finish_reason="stop",
        stats=TrajectoryStats(response_tokens=len(lived)),
    )


def _long_store(root: Path) -> None:
    from pipeline.trajectory import purified_to_row, trajectory_to_row
    from purifier.saar import purify
    from storage.layout import RunLayout, record_path
    from storage.schemas import PURIFIED, RAW
    from storage.shards import write_shard
    from storage.texts import load_decoder

    decode_batch = load_decoder(QWEN3 / "tokenizer.json")
    decode = lambda ids: decode_batch([list(ids)])[0]  # noqa: E731
    rng = random.Random(0)
    raws = [_long_trajectory(rng, i, 151_000) for i in range(ROWS)]
    layout = RunLayout(root, "long")
    write_shard(
        layout.raw_dir(0),
        pa.Table.from_pylist([trajectory_to_row(t) for t in raws], schema=RAW),
        RAW,
        "b",
        inputs=[str(QWEN3)],
    )
    manifest = [record_path(root, layout.raw_dir(0) / "_MANIFEST.json")]
    for mode in ("saar", "raw"):
        rows = []
        for t in raws:
            p = purify(t, 0.5, mode, decode)
            p.advantage = t.reward
            rows.append(purified_to_row(p))
        write_shard(
            layout.purified_dir(0, mode, 0.5 if mode == "saar" else 0.0),
            pa.Table.from_pylist(rows, schema=PURIFIED),
            PURIFIED,
            "b",
            inputs=manifest,
        )


def _text_cost(tmp: Path) -> tuple[float, float, int, int]:
    """(commit s with text, without, text bytes, part bytes) of a 64 × 8,192-token raw shard (random Qwen3 ids)."""
    from benchmarks.store_generator import raw_table
    from storage.layout import RunLayout
    from storage.schemas import RAW
    from storage.shards import read_manifest, write_shard
    from storage.texts import load_decoder

    load_decoder(QWEN3 / "tokenizer.json")  # loaded once per process in a stage too
    table = raw_table("t", 0, 64, 8192, np.random.default_rng(0))
    times: dict[bool, float] = {}
    for k in range(3):
        for with_text in (True, False):
            out = RunLayout(tmp, f"t{k}{int(with_text)}").raw_dir(0)
            t0 = time.perf_counter()
            write_shard(out, table, RAW, "b", inputs=[str(QWEN3)] if with_text else [])
            times[with_text] = min(times.get(with_text, math.inf), time.perf_counter() - t0)
    m = read_manifest(RunLayout(tmp, "t01").raw_dir(0))
    return times[True], times[False], sum(p["bytes"] for p in m.extra["texts"]), sum(p.bytes for p in m.parts)


def run() -> BenchResult:
    from fastapi.testclient import TestClient

    from benchmarks.store_generator import build
    from flows.viewer.app import create_app
    from storage.catalog import publish

    tmp = Path(tempfile.mkdtemp(prefix="bench-viewer-"))
    rows: list[Row] = []
    notes: list[str] = []
    try:
        long_root = tmp / "long"
        _long_store(long_root)
        publish(long_root, long_root / "catalog.duckdb")
        client = TestClient(create_app(long_root, long_root / "catalog.duckdb"))
        page = "/runs/long/0/trajectory?prompt=p000&sample=0"
        first, warm = _timed(client, page)
        size = len(client.get(page).content)
        rows.append(
            Row(
                "trajectory page, 16,384-token attempt tree, saar + raw variants aligned (warm)",
                warm,
                None,
                "s",
                higher_is_better=False,
                target="<= 1 s",
                passed=warm <= 1.0,
            )
        )
        rows.append(
            Row(
                "the same page, first view (tokenizer and iteration catalog loaded)",
                first,
                None,
                "s",
                higher_is_better=False,
            )
        )
        table_first, table_warm = _timed(client, "/runs/long/0")
        notes.append(
            f"trajectory page: {size / 2**20:.1f} MiB of HTML; the iteration's table of 64 such rows "
            f"{table_warm:.2f} s warm ({table_first:.2f} s first)"
        )

        with_text, without, text_bytes, part_bytes = _text_cost(tmp / "text")
        rows.append(
            Row(
                "commit of a 64 × 8,192-token raw shard with its decoded text (vs without)",
                with_text,
                without,
                "s",
                higher_is_better=False,
            )
        )
        notes.append(
            f"text at commit: {text_bytes / 2**20:.1f} MiB of text beside {part_bytes / 2**20:.1f} MiB of "
            f"parts ({text_bytes / part_bytes:.0%}; random ids, the worst case for compression)"
        )

        store = tmp / "store-200"
        t0 = time.perf_counter()
        build(store, 200, tokens=8192, log=None)
        built = time.perf_counter() - t0
        publish(store, store / "catalog.duckdb")
        client = TestClient(create_app(store, store / "catalog.duckdb"))
        for url, name in (("/", "runs page (/)"), ("/runs/scale", "run page (its 200 iterations)")):
            first, warm = _timed(client, url)
            rows.append(
                Row(
                    f"{name} over the 200-iteration store (warm)",
                    warm,
                    None,
                    "s",
                    higher_is_better=False,
                    target="<= 1 s",
                    passed=warm <= 1.0,
                )
            )
            notes.append(f"{name}: first view {first:.2f} s (opens the published catalog)")
        notes.append(f"200 iterations × 64 rows × 8,192 tokens built in {built:.0f} s (benchmarks/store_generator.py)")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return BenchResult(
        "viewer",
        "cleaner view: server-side page times at 16k tokens and over a 200-iteration store; "
        "the cost of decoded text at commit.",
        rows,
        notes,
    )


if __name__ == "__main__":
    result = run()
    for row in result.rows:
        base = f" (baseline {row.baseline:.3f})" if row.baseline is not None else ""
        print(f"{row.metric}: {row.value:.3f} {row.unit}{base} {row.target}")
    for note in result.notes:
        print(f"  {note}")
