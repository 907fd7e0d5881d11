"""The console of a real one-iteration `cleaner train`: no library noise, readable summaries."""
from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
NOISE = (
    "GCSFileSystem",  # Beam's optional cloud file systems
    "apitools not found",
    "pynvml",  # torch.cuda's FutureWarning
    "Setting accelerator to CPU",  # DeepSpeed
    "Loading weights",  # transformers' per-load progress bar
    "Writing model shards",
    "kernels",  # bitsandbytes
)


def test_one_iteration_train_prints_no_library_noise(tmp_path):
    cfg = tmp_path / "tiny.yaml"
    cfg.write_text(f"storage: {{root: {tmp_path}}}\nflow: {{run_id: quiet, iterations: 1}}\n"
                   "rollout: {tasks_per_iteration: 2, samples_per_prompt: 2}\n"
                   "purify: {modes: [saar, raw], gammas: [0.5]}\ntrain: {mini_batches: 1}\n")
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONWARNINGS", "HF_HUB_DISABLE_PROGRESS_BARS")}
    env.update(PYTHONPATH=str(ROOT), PREFECT_HOME=str(tmp_path / ".prefect"))
    p = subprocess.run([sys.executable, "-m", "flows.cli", "train", "-c", str(cfg)], cwd=tmp_path, env=env,
                       capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stderr[-3000:]
    console = p.stdout + p.stderr
    for noise in NOISE:
        assert noise not in console, f"{noise!r} printed:\n{console}"
    # The per-iteration summary is prose, not a Python repr of tuples.
    assert "purified saar γ=0.50: 4 rows, raw: 4 rows" in console, console
    assert "[('saar'" not in console
    # A progress indication for each stage, on stderr (stdout keeps the command's result alone).
    for stage in ("[rollout it 0]", "[purify it 0]", "[update] step 1"):
        assert stage in p.stderr, f"no progress for {stage}:\n{p.stderr}"
    assert p.stdout.strip().startswith("final checkpoint:"), p.stdout
    # Entropy is not measured by default: it reads as not measured, never as 0.
    assert "entropy n/a" in p.stderr and "entropy 0.000" not in p.stderr
    import duckdb

    con = duckdb.connect(str(tmp_path / "catalog.duckdb"), read_only=True)
    entropy = con.sql("SELECT value FROM metrics WHERE name = 'entropy'").fetchall()
    assert entropy and all(v is None for (v,) in entropy)  # null in the metrics shard
    con.close()
    # Rerun: every stage is committed and says so, rather than a plain "Completed()".
    again = subprocess.run([sys.executable, "-m", "flows.cli", "train", "-c", str(cfg)], cwd=tmp_path, env=env,
                           capture_output=True, text=True, timeout=600)
    assert again.returncode == 0, again.stderr[-3000:]
    for stage in ("rollout", "purify", "update"):
        assert re.search(rf"Task run '{stage}-\w+' - Finished in state Completed\('skipped \(committed\)'\)",
                         again.stderr), again.stderr
