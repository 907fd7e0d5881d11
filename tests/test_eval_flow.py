"""Evaluation inside the training flow (flow.eval_every): a one-iteration `cleaner train`, run like a user's,
evaluates checkpoints 0 and 1 on held-out world tasks with SAAR at test time on and off, as Prefect tasks;
the metrics shard (stage=eval) is in the catalog's `metrics` view and `cleaner report` plots and tabulates it."""

from __future__ import annotations

from storage.catalog import Catalog
from storage.layout import RunLayout
from storage.shards import read_manifest

from tests.flow_helpers import run_cleaner, tiny_config


def test_flow_eval_every_writes_metrics_the_catalog_and_report_show(tmp_path):
    cfg = tiny_config(
        tmp_path,
        "ev.yaml",
        flow={
            "run_id": "ev",
            "iterations": 1,
            "tensorboard": False,
            "eval_every": 1,
            "eval_samples": 2,
            "eval_limit": 4,
        },
        rollout={"tasks_per_iteration": 2, "samples_per_prompt": 2},
        purify={"modes": ["saar"]},
        train={"mini_batches": 1},
    )
    p = run_cleaner(["train", "-c", str(cfg)], tmp_path)
    assert p.returncode == 0, (p.stdout + p.stderr)[-3000:]
    layout = RunLayout(tmp_path, "ev")
    for i in (0, 1):  # the initial policy, and the last checkpoint
        manifest = read_manifest(layout.metrics_dir(i, "eval"))
        assert manifest is not None and manifest.extra["tasks"] == 4
    with Catalog(tmp_path) as cat:
        rows = (
            cat.con.sql("SELECT iteration, name, value FROM metrics WHERE run_id = 'ev' AND stage = 'eval'")
            .to_arrow_table()
            .to_pylist()
        )
    got = {(r["iteration"], r["name"]): r["value"] for r in rows}
    for i in (0, 1):
        for setting in ("saar_on", "saar_off"):
            assert 0.0 <= got[(i, f"{setting}/all/pass@1")] <= 1.0
            assert got[(i, f"{setting}/world/trajectories")] == 8.0  # 4 tasks × 2 samples
            assert (i, f"{setting}/all/tool_failures_per_trajectory") in got
            assert (i, f"{setting}/all/pass@1_se") in got and (i, f"{setting}/wall_s") in got
    assert not any(name.startswith("saar_on/all/pass@4") for _, name in got)  # k stops at the 2 samples
    r = run_cleaner(["report", "--run", "ev", f"storage.root={tmp_path}"], tmp_path)
    assert r.returncode == 0, r.stderr[-2000:]
    page = (layout.run_dir / "report" / "index.html").read_text().replace("<wbr>", "")  # headers wrap at "_"
    assert "Held-out evaluation" in page and "saar_on pass@1" in page and "saar_off tool failures/traj" in page
    for plot in ("eval_pass1.png", "eval_tool_errors.png"):
        assert plot in page and (layout.run_dir / "report" / plot).stat().st_size > 0
