"""The training flow end to end: real Prefect temporary server, real Beam, real OpenRLHF update, real
sandbox; each flow runs as `cleaner train` in its own process, like a user's."""

from __future__ import annotations

import os
import shutil
import signal
import time
from pathlib import Path

from pipeline.trajectory import trajectory_from_row
from storage.catalog import Catalog
from storage.layout import RunLayout
from storage.schemas import RAW
from storage.shards import read_manifest, read_shard

from tests.flow_helpers import cleaner, run_cleaner, tiny_config, train


def fingerprint(root: Path) -> dict:
    """Every committed output of the run: manifests' parts and the checkpoints' weights."""
    layout = RunLayout(root, "tiny")
    out = {}
    for manifest in sorted(layout.run_dir.glob("iteration=*/**/_MANIFEST.json")):
        if "metrics" in str(manifest):
            continue  # wall times differ between runs
        m = read_manifest(manifest.parent)
        key = str(manifest.parent.relative_to(root))
        if manifest.parent.name == "raw":  # tool-call durations are wall-clock: compare everything else
            trajs = [trajectory_from_row(r) for r in read_shard(manifest.parent, RAW).to_pylist()]
            for t in trajs:
                for a in [a for p in t.positions for a in p.attempts]:
                    if a.result is not None:
                        a.result.duration_s = 0.0
            out[key] = trajs
        else:
            out[key] = [(p.name, p.rows, p.crc32) for p in m.parts]
    for ckpt in sorted(layout.run_dir.glob("checkpoints/iteration=*")):
        out[str(ckpt.relative_to(root))] = (ckpt / "model.safetensors").read_bytes()
    return out


def test_flow_outputs_exist_and_add_up(uninterrupted):
    root = uninterrupted
    layout = RunLayout(root, "tiny")
    assert layout.run_json.is_file()
    for i in (0, 1):
        raw = read_manifest(layout.raw_dir(i))
        assert raw.rows == 16
        for mode, gamma in (("saar", 0.5), ("raw", 0.0)):
            pur = read_manifest(layout.purified_dir(i, mode, gamma))
            dead = read_manifest(layout.dead_letter_dir(i, mode, gamma))
            assert pur.rows + dead.rows + 4 * pur.extra.get("filtered_groups", 0) == raw.rows
        assert read_manifest(layout.metrics_dir(i, "update")).rows > 0
        assert (layout.checkpoint_dir(i + 1) / "model.safetensors").is_file()
    with Catalog(root) as cat:
        counts = cat.query("SELECT iteration, count(*) AS n FROM raw_trajectories GROUP BY 1 ORDER BY 1").to_pylist()
        assert counts == [{"iteration": 0, "n": 16}, {"iteration": 1, "n": 16}]
        versions = cat.query(
            "SELECT iteration, any_value(policy_version) AS v FROM raw_trajectories GROUP BY 1 ORDER BY 1"
        ).to_pylist()
        assert versions[0]["v"] != versions[1]["v"]  # iteration 1 sampled from the updated policy
    p = cleaner(["report", "--run", "tiny", f"storage.root={root}"], root)
    out, _ = p.communicate(timeout=300)
    assert p.returncode == 0, out
    assert (layout.run_dir / "report" / "index.html").is_file()
    assert len(list((layout.run_dir / "report").glob("*.png"))) == 7  # is_ratio.png too
    page = (layout.run_dir / "report" / "index.html").read_text()
    assert (
        page.count("<figcaption>") == 7
        and "Run config as the run started (run.json)" in page
        and '"run_id": "tiny"' in page
    )
    assert "0.5" in page and "rapidfuzz-segment" in page  # every variant with its γ and measure
    assert list((layout.run_dir / "tensorboard").glob("events.out.tfevents.*"))


def test_sigkill_during_purification_then_rerun_is_identical(uninterrupted, tmp_path):
    """Iteration 1's purification runs on a Dask scheduler without workers, so it cannot finish before the kill
    (its staging exists and nothing is committed, whatever the machine's speed); the rerun purifies it on the
    default runner and the run ends as the uninterrupted one did."""
    from distributed import LocalCluster

    done, here = RunLayout(uninterrupted, "tiny"), RunLayout(tmp_path, "tiny")
    shutil.copytree(done.iteration_dir(0), here.iteration_dir(0))  # iteration 0 as committed
    shutil.copytree(done.checkpoint_dir(1), here.checkpoint_dir(1))
    shutil.copy(done.run_json, here.run_json)
    staging = here.iteration_dir(1) / ".staging"
    with LocalCluster(n_workers=0, host="127.0.0.1", scheduler_port=0, dashboard_address=":0") as no_workers:
        p = cleaner(
            [
                "train",
                "-c",
                str(tiny_config(tmp_path)),
                "purify.runner=dask",
                f"purify.dask_address={no_workers.scheduler_address}",
            ],
            tmp_path,
        )
        try:
            while not any(staging.glob("purify-*")):  # iteration 1's purification has started its pipeline
                assert p.poll() is None, f"flow ended before iteration 1 was purified:\n{p.stdout.read()[-3000:]}"
                time.sleep(0.5)
        finally:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait(timeout=60)
    assert read_manifest(here.purified_dir(1, "saar", 0.5)) is None
    train(tmp_path)
    assert fingerprint(tmp_path) == fingerprint(uninterrupted)


def test_wrong_key_missing_checkpoint_and_unreachable_sglang_each_say_one_thing(tmp_path):
    cases = [
        (["train", "flow.iteratons=2"], "unknown config key 'flow.iteratons' (did you mean 'flow.iterations'?)"),
        (
            ["rollout", "rollout.policy=/nonexistent/ckpt", f"storage.root={tmp_path}"],
            "checkpoint /nonexistent/ckpt does not exist",
        ),
        (
            ["rollout", "rollout.engine=sglang", "rollout.sglang_url=http://127.0.0.1:9", f"storage.root={tmp_path}"],
            "SGLang server at http://127.0.0.1:9 is unreachable",
        ),
    ]
    for args, message in cases:
        p = cleaner(args, tmp_path)
        out, _ = p.communicate(timeout=300)
        assert p.returncode != 0 and message in out, out[-2000:]
        assert "Traceback" not in out


def test_eval_flow_compares_saar_on_and_off(tmp_path, capsys):
    import json

    from flows.eval_cmd import evaluate_world
    from pipeline.config import load_config

    p = run_cleaner(
        ["eval", "--world", "--flow", "--json", "--limit", "4", f"storage.root={tmp_path}", "world.eval_size=12"],
        tmp_path,
    )
    assert p.returncode == 0, p.stderr[-3000:]
    result = json.loads(p.stdout)  # --json: stdout is one JSON document, logs and progress go to stderr
    assert set(result) == {"saar_on", "saar_off", "saar_latency_overhead", "benchmarks", "answer_match"}
    assert result["answer_match"] == "equivalent"  # the rule the numbers were scored by (docs/eval.md)
    # SAAR off at test time is the plain evaluation of the same tasks (gate_p 0), computed here on its own
    cfg = load_config(None, [f"storage.root={tmp_path}", "world.eval_size=12", "rollout.saar.gate_p=0"])
    plain = evaluate_world(cfg, cfg.rollout.policy, limit=4, show_progress=False)
    off = result["saar_off"]
    assert (off["pass@1"], off["first_call_failure_rate"], off["generated_tokens"]) == (
        plain["accuracy"],
        plain["first_call_failure_rate"],
        plain["generated_tokens"],
    )
    assert off["tool_failures_per_trajectory"] == plain["benchmarks"]["all"]["tool_failures_per_trajectory"]
    # per benchmark (task source), as `cleaner eval` prints them: each source's SAAR on beside its SAAR off
    sources = list(plain["benchmarks"])
    assert set(result["benchmarks"]) == {f"{s} · SAAR {o}" for s in sources for o in ("on", "off")}  # sorted keys
    assert all(result["benchmarks"][f"{s} · SAAR off"] == plain["benchmarks"][s] for s in sources)
    from flows.eval_cmd import print_flow_metrics

    print_flow_metrics("flow", result, 1, as_json=False)
    printed = capsys.readouterr().out
    assert "per benchmark" in printed and all(f"{s} · SAAR on" in printed for s in sources) and "{" not in printed
    table = run_cleaner(["eval", "--world", "--limit", "3", f"storage.root={tmp_path}"], tmp_path)
    assert table.returncode == 0, table.stderr[-3000:]
    assert "accuracy" in table.stdout and "┃ metric" in table.stdout and "{" not in table.stdout
    assert "trajectories" in table.stderr  # the rollout's progress, never on stdout
