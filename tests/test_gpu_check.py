"""scripts/gpu_check.sh --double: the GPU check's whole logic on a CPU machine, against the SGLang contract
double (the CPU engine behind SGLang's /generate contract) started by the script as a server process.

What this shows: the script runs two real iterations over HTTP (rollout, purify with SGLang recompute,
local then DeepSpeed update, weight reload after each), measures the train/inference mismatch, and writes
a report with every field the GPU run fills, the GPU-only ones marked as not run. What it cannot show:
anything about SGLang itself or a GPU; the double *is* the project's CPU engine, so its mismatch against the
trainer's forward is float rounding (both fp32 on the CPU), which is what the bounds below check.
"""
from __future__ import annotations

import json
import math
import os
import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path

import psutil
import pytest

from pipeline.config import DEFAULT_POLICY
from pipeline.processes import alive
from storage.checkpoints import DONE_MARKER
from storage.layout import RunLayout
from storage.shards import is_committed

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "scripts" / "gpu_check.sh"
# The smallest run that still trains on a signal: the tiny world policy (the default init-policy checkpoint
# is the Qwen3 vocabulary, 3x slower on the CPU engine), 2 tasks x 4 samples (GRPO needs a group whose
# rewards differ), one mini-batch per update.
SMALL = ["--checkpoint", str(DEFAULT_POLICY), "--tasks", "2", "rollout.samples_per_prompt=4", "train.mini_batches=1"]


def _script(*args: str, timeout: float = 600) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", str(SCRIPT), *args], capture_output=True, text=True, timeout=timeout, cwd=ROOT)


def _not_run(field) -> bool:
    return isinstance(field, dict) and set(field) == {"not_run"} and isinstance(field["not_run"], str) and field["not_run"]


def _finite(x) -> bool:
    return isinstance(x, float) and math.isfinite(x)


@pytest.fixture(scope="module")
def checked(tmp_path_factory):
    out = tmp_path_factory.mktemp("gpu-check")
    done = _script("--double", "--out", str(out), *SMALL)
    assert done.returncode == 0, done.stderr[-4000:]
    return json.loads((out / "report.json").read_text()), out, done


@pytest.mark.slow
def test_double_run_commits_two_iterations_and_reloads_the_server_after_each_update(checked):
    report, out, done = checked
    assert report["ok"] is True and report["error"] is None and report["mode"] == "double"
    assert done.stderr.strip().splitlines()[-1].startswith("[gpu-check] ok: mismatch on")
    its = report["iterations"]
    assert [it["iteration"] for it in its] == [0, 1] and report["committed_iterations"] == 2
    layout = RunLayout(Path(report["workspace"]), report["run_id"])
    for i, it in enumerate(its):
        assert it["committed"]["raw"] and it["committed"]["purified"] and it["committed"]["checkpoint"]
        assert is_committed(layout.raw_dir(i)) and (layout.checkpoint_dir(i + 1) / DONE_MARKER).is_file()
        assert it["rollout"]["trajectories"] == 8 and it["rollout"]["generated_tokens"] > 0
        assert {"saar γ=0.5", "raw γ=0"} <= set(it["purify"]["partitions"])
    # local, then DeepSpeed with one rank (gloo here; NCCL on a GPU), each a real step on real tokens
    local, ds = report["update"]["local"], report["update"]["deepspeed"]
    assert local["strategy"] == "local" and local["backend"] is None
    assert ds["strategy"] == "deepspeed" and ds["ranks"] == 1 and ds["backend"] == "gloo"
    assert json.loads((layout.checkpoint_dir(2) / DONE_MARKER).read_text())["strategy"] == "deepspeed"
    for u in (local, ds):
        assert u["steps"] >= 1 and u["trained_tokens"] > 0 and _finite(u["tokens_per_s"]) and u["tokens_per_s"] > 0
    # each reload was seen by scoring on the server: its log-probs moved from the old weights to the new ones
    for it in its:
        rl = it["reload"]
        assert rl["verified"] is True and 0.8 < rl["moved_fraction"] < 1.2, rl
        assert rl["new_vs_old_max"] > 0 and rl["probe_tokens"] > 0
        assert rl["checkpoint"].endswith(f"iteration={it['iteration'] + 1:04d}")
        assert rl["server_vs_new"]["mean"] < rl["server_vs_old"]["mean"]


@pytest.mark.slow
def test_mismatch_is_measured_on_real_tokens_and_is_rounding_for_the_double(checked):
    report, _, _ = checked
    m = report["mismatch"]
    for kind in ("unspliced", "recomputed"):  # recomputed: tokens SGLang's prefill scored after a splice
        s = m[kind]
        assert s["count"] > 0, kind
        assert all(_finite(s[k]) for k in ("mean", "p50", "p99", "max")), s
        assert 0 <= s["mean"] <= s["p99"] <= s["max"] < 1e-4, s  # fp32 CPU engine vs the fp32 trainer forward
    # the unspliced figure uses SGLang's own sampling log-probs: the purified shard holds the raw shard's values
    assert m["raw_check"]["tokens"] > 0 and m["raw_check"]["max_abs_diff"] == 0.0
    per_it = [p for it in report["iterations"] for p in it["mismatch"]["partitions"] if p["trained"]]
    assert len(per_it) == 2 and sum(p["unspliced"]["count"] for p in per_it) == m["unspliced"]["count"]


@pytest.mark.slow
def test_report_has_every_field_with_the_gpu_only_ones_not_run(checked):
    report, out, _ = checked
    for key in ("device", "versions", "sglang_venv", "server", "checkpoint", "mismatch", "rollout", "update",
                "stages", "wall_s", "iterations", "committed_iterations", "reload_verified"):
        assert key in report, key
    gpu_only = [report["device"]["card"], report["device"]["driver"], report["device"]["cuda"], report["sglang_venv"],
                report["server"]["sglang"], report["rollout"]["tokens_per_s_per_gpu"]]
    gpu_only += [report["update"][s]["tokens_per_s_per_gpu"] for s in ("local", "deepspeed")]
    gpu_only += [report["update"][s]["gpu"] for s in ("local", "deepspeed")]
    gpu_only += [it["reload"]["model_info"] for it in report["iterations"]]
    assert all(_not_run(f) for f in gpu_only), gpu_only
    assert report["versions"]["torch"] and report["versions"]["deepspeed"] and report["versions"]["cleaner_commit"]
    assert report["checkpoint"] == {"path": str(DEFAULT_POLICY), "made_by": "given (--checkpoint)"}
    # wall time per stage: every stage of both iterations ran, and the totals add them up
    ran = [(s["stage"], s["iteration"]) for s in report["stages"]]
    for i in (0, 1):
        for stage in ("rollout", "purify", "mismatch", "update", "reload", "reload_check"):
            assert (stage, i) in ran
    assert all(s["status"] == "ok" and s["wall_s"] > 0 for s in report["stages"])
    assert report["wall_s"]["total"] >= sum(s["wall_s"] for s in report["stages"])
    # the server was the script's own, on 127.0.0.1, and is gone
    server = report["server"]
    assert server["kind"] == "contract double" and server["url"].startswith("http://127.0.0.1:")
    assert server["stopped"] is True and not alive(server["pid"])
    md = (out / "report.md").read_text()
    assert "| unspliced | " in md and "not run (--double" in md and "| update | 1 | ok |" in md


@pytest.mark.slow
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGKILL], ids=["sigterm", "sigkill"])
def test_the_server_dies_with_the_script(tmp_path, sig):
    """SIGTERM: the script stops its server by pid and writes its report; kill -9: the kernel kills the server
    (PR_SET_PDEATHSIG). The script execs its driver, so the pid bash gets is the driver's."""
    err = tmp_path / "stderr.txt"
    with open(err, "w") as f:
        proc = subprocess.Popen(["bash", str(SCRIPT), "--double", "--out", str(tmp_path), *SMALL], cwd=ROOT,
                                stdout=subprocess.DEVNULL, stderr=f)
    double = None
    deadline = time.monotonic() + 120
    try:
        while double is None or not (tmp_path / "double.url").is_file():
            try:
                kids = psutil.Process(proc.pid).children(recursive=True)
                double = next((k for k in kids if "--serve-double" in " ".join(k.cmdline())), None)
            except psutil.Error:  # a process ended while we looked: the assertion below says whether it was the script
                pass
            assert time.monotonic() < deadline and proc.poll() is None, f"the double never started: {err.read_text()[-2000:]}"
            time.sleep(0.2)
        os.kill(proc.pid, sig)
        assert proc.wait(timeout=60) in (143, -signal.SIGKILL, -signal.SIGTERM)
        gone = time.monotonic() + 20
        while alive(double.pid) and time.monotonic() < gone:
            time.sleep(0.1)
        assert not alive(double.pid), "the contract double outlived the script"
    finally:
        if proc.poll() is None:
            proc.kill()
    if sig == signal.SIGTERM:
        report = json.loads((tmp_path / "report.json").read_text())
        assert report["ok"] is False and report["error"] == "interrupted" and report["server"]["stopped"] is True


def _one_line(done: subprocess.CompletedProcess) -> str:
    lines = done.stderr.strip().splitlines()
    assert done.returncode == 2 and len(lines) == 1, done.stderr
    return lines[0]


def test_a_checkpoint_that_does_not_exist_is_one_line_and_writes_nothing(tmp_path):
    line = _one_line(_script("--double", "--checkpoint", str(tmp_path / "nope"), "--out", str(tmp_path / "out")))
    assert line == f"gpu_check: checkpoint {tmp_path / 'nope'} does not exist"
    assert not (tmp_path / "out").exists()


def test_an_sglang_url_that_does_not_answer_is_one_line(tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # closed again: nothing listens there
    line = _one_line(_script("--double", "--url", f"http://127.0.0.1:{port}", "--out", str(tmp_path / "out")))
    assert line.startswith(f"gpu_check: SGLang URL http://127.0.0.1:{port} does not answer")
    assert not (tmp_path / "out").exists()
    # the figures are per GPU of this machine: a server elsewhere is refused before any request is sent
    line = _one_line(_script("--double", "--url", "http://gpu-node.invalid:30000", "--out", str(tmp_path / "out")))
    assert "must run on this machine (127.0.0.1)" in line


@pytest.mark.skipif(bool(shutil.which("nvidia-smi")), reason="this machine may have a GPU")
def test_no_gpu_without_double_is_one_line(tmp_path):
    line = _one_line(_script("--out", str(tmp_path / "out")))
    assert line.startswith("gpu_check: no CUDA GPU on this machine") and "--double" in line
    assert not (tmp_path / "out").exists() and not (ROOT / ".venv-sglang").exists()
