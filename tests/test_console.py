"""The console of a real one-iteration `cleaner train`: no library noise, readable summaries."""

from __future__ import annotations

from tests.flow_helpers import command_env, prefect_api, project_server, run_cleaner, tiny_config

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
    cfg = tiny_config(
        tmp_path,
        flow={"run_id": "quiet", "iterations": 1, "tensorboard": False},
        rollout={"tasks_per_iteration": 2, "samples_per_prompt": 2},
        train={"mini_batches": 1},
    )
    env = {
        k: v
        for k, v in command_env(tmp_path).items()
        if k not in ("PYTHONWARNINGS", "HF_HUB_DISABLE_PROGRESS_BARS", "PREFECT_API_URL")
    }
    p = run_cleaner(["train", "-c", str(cfg)], cwd=tmp_path, env=env)
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
    # Rerun on a project server: every stage is committed, and its task run's final state says so in Prefect's
    # API, rather than a plain "Completed()".
    with project_server(tmp_path, "-c", str(cfg)) as url:
        again = run_cleaner(["train", "-c", str(cfg)], cwd=tmp_path, env={**env, "PREFECT_API_URL": url})
        assert again.returncode == 0, again.stderr[-3000:]
        (rerun,) = prefect_api(url, "/flow_runs/filter", {"sort": "START_TIME_DESC", "limit": 1})
        tasks = prefect_api(url, "/task_runs/filter", {"flow_runs": {"id": {"any_": [rerun["id"]]}}})
    assert rerun["state"]["type"] == "COMPLETED", rerun["state"]
    states = {t["name"].split("-")[0]: (t["state"]["type"], t["state"]["message"]) for t in tasks}
    assert states == {stage: ("COMPLETED", "skipped (committed)") for stage in ("rollout", "purify", "update")}, tasks
