"""Run every benchmark (or those named) and rewrite benchmarks/RESULTS.md: `python -m benchmarks.run [name ...]`."""

from __future__ import annotations

import importlib
import sys

from benchmarks.common import RESULTS_MD, record

BENCHMARKS = [
    "storage",
    "world",
    "rollout",
    "async_rollout",
    "purify",
    "off_policy",
    "dask",
    "measures",
    "trainer",
    "e2e",
    "scale",
    "eval",
    "store_scale",
    "bytes",
    "viewer",
    "vllm",
    "purify_memory",
    "interop",
    "retry_seeds",
]


def main(argv: list[str]) -> int:
    names = argv or BENCHMARKS
    for name in names:
        if name not in BENCHMARKS:
            print(f"unknown benchmark {name!r}; known: {', '.join(BENCHMARKS)}", file=sys.stderr)
            return 2
        print(f"[bench] {name} ...", flush=True)
        result = importlib.import_module(f"benchmarks.bench_{name}").run()
        record(result)
        for row in result.rows:
            ratio = f" ({row.ratio:.2f}× baseline)" if row.ratio else ""
            print(f"  {row.metric}: {row.value:,.1f} {row.unit}{ratio}")
    print(f"[bench] wrote {RESULTS_MD}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
