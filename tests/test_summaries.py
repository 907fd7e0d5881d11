"""Row summaries written at commit (issue #31 §2): equal, row for row, to the same columns computed from the
parts (what the catalog does for shards committed without them), on real rollouts and purifications."""

from __future__ import annotations

import json
import math

from storage.catalog import Catalog
from storage.layout import RunLayout
from storage.shards import MANIFEST, read_manifest, summary_parts


def _rows(cat: Catalog, view: str, keys: str) -> list[dict]:
    return cat.query(f"SELECT * FROM {view} ORDER BY {keys}").to_pylist()


def test_summaries_equal_what_the_parts_say(world_copy):
    from purifier.stage import run_purify_stage

    cfg = world_copy
    cfg.purify.modes = ["saar", "raw", "saar_is"]
    run_purify_stage(cfg, "w", 0)
    layout = RunLayout(cfg.storage.root, "w")
    shards = [layout.raw_dir(0), *layout.iteration_dir(0).glob("purified/mode=*/*=*")]
    assert all(summary_parts(read_manifest(d)) for d in shards)
    keys = {"raw_summary": "prompt_id, sample_idx", "purified_summary": "mode, gamma, prompt_id, sample_idx"}
    with Catalog(cfg.storage.root) as cat:
        written = {v: _rows(cat, v, k) for v, k in keys.items()}
        spliced = sum(r["splices"] for r in written["purified_summary"])
        failed = sum(r["failed_attempt_tokens"] for r in written["raw_summary"])
    for d in shards:  # the same shards as an earlier cleaner committed them: no summaries in the manifest
        m = json.loads((d / MANIFEST).read_text())
        m["extra"].pop("summaries")
        (d / MANIFEST).write_text(json.dumps(m))
    with Catalog(cfg.storage.root) as cat:
        computed = {v: _rows(cat, v, k) for v, k in keys.items()}
    assert spliced > 0 and failed > 0 and len(written["raw_summary"]) == 64
    for view in keys:
        for a, b in zip(written[view], computed[view], strict=True):
            assert a.keys() == b.keys()
            for k in a:
                assert a[k] == b[k] or (isinstance(a[k], float) and math.isnan(a[k]) and math.isnan(b[k])), (view, k)
