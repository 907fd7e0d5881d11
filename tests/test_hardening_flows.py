"""Issue #13 §5 with the real `cleaner train` (real Prefect temporary server): kill -9 of the command at
each stage leaves no Prefect server behind, a rerun removes the killed purification's staging, and a
read-only workspace fails at once with one line instead of a database storm and a timeout."""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import threading
import time
from pathlib import Path

import pytest

from storage.layout import RunLayout
from tests.flow_helpers import cleaner, command_env, prefect_api, project_server, temporary_server_env, tiny_config


class Cleaner:
    """`cleaner ARGS` in its own session, its output collected line by line as it comes: on Prefect's temporary
    server, or on the server at api_url."""

    def __init__(self, args: list[str], root: Path, api_url: str | None = None) -> None:
        env = (
            command_env(PYTHONUNBUFFERED="1", PREFECT_API_URL=api_url)
            if api_url
            else temporary_server_env(PYTHONUNBUFFERED="1")
        )
        self.p = cleaner(args, root, env=env)
        self.lines: list[str] = []
        self._reader = threading.Thread(target=lambda: self.lines.extend(iter(self.p.stdout.readline, "")), daemon=True)
        self._reader.start()

    @property
    def out(self) -> str:
        return "".join(self.lines)

    def wait_for(self, ready, what: str, timeout: float = 300) -> None:
        deadline = time.time() + timeout
        while not ready():
            assert self.p.poll() is None, f"exited before {what}:\n{self.out[-3000:]}"
            assert time.time() < deadline, f"no {what} within {timeout}s:\n{self.out[-3000:]}"
            time.sleep(0.01)

    def cleanup(self) -> None:
        """Whatever is left of the process group this test started (never anything else)."""
        try:
            os.killpg(self.p.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.p.wait(timeout=30)


def descendants(pid: int) -> list[int]:
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        children.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    out, todo = [], [pid]
    while todo:
        for c in children.get(todo.pop(), []):
            out.append(c)
            todo.append(c)
    return out


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def listening(port: int) -> bool:
    with socket.socket() as s:
        s.settimeout(1)
        return s.connect_ex(("127.0.0.1", port)) == 0


def test_kill_9_of_train_at_every_stage_leaves_no_prefect_server_and_reruns_clean_staging(tmp_path):
    config = tiny_config(tmp_path, flow={"iterations": 1, "tensorboard": False}, purify={"modes": ["saar"]})
    layout = RunLayout(tmp_path, "tiny")
    staging = layout.iteration_dir(0) / ".staging"
    stages = {  # each stage's own first message (flows/training.py), or its staging
        "rollout": lambda c: "[rollout it 0] loading" in c.out,
        "purify": lambda c: any(staging.glob("purify-*/")),
        "update": lambda c: "[update it 0] loading the trainer" in c.out,
    }
    for stage, started in stages.items():
        c = Cleaner(["train", "-c", str(config)], tmp_path)
        try:
            c.wait_for(lambda started=started, c=c: started(c), f"the {stage} stage")
            servers = [
                pid
                for pid in descendants(c.p.pid)
                if b"prefect\x00server\x00start" in Path(f"/proc/{pid}/cmdline").read_bytes()
            ]
            (port,) = {int(m) for m in re.findall(r"server on http://127\.0\.0\.1:(\d+)", c.out)}
            assert servers and listening(port), c.out[-2000:]
            os.kill(c.p.pid, signal.SIGKILL)  # the command alone, as a user's kill -9 would
            c.p.wait(timeout=30)
            deadline = time.time() + 20  # a killed multi-threaded process closes its sockets when its last thread exits
            while (any(alive(pid) for pid in servers) or listening(port)) and time.time() < deadline:
                time.sleep(0.2)
            assert not any(alive(pid) for pid in servers), f"Prefect server outlived kill -9 during {stage}"
            assert not listening(port), (
                stage,
                port,
                subprocess.run(["ss", "-ltnp"], capture_output=True, text=True).stdout,
            )
        finally:
            c.cleanup()
        if stage == "purify":
            assert any(staging.glob("purify-*/")), "the killed purification left no staging to clean"
    # the third run purified again (the second was killed mid-way) before it was killed in update
    assert read_committed(layout), "purify was not redone by the rerun"
    assert not staging.exists(), list(staging.iterdir())


def read_committed(layout: RunLayout) -> bool:
    from storage.shards import read_manifest

    return read_manifest(layout.purified_dir(0, "saar", 0.5)) is not None


def test_train_on_a_read_only_workspace_is_one_line_before_any_server(tmp_path):
    where = tmp_path / "ro"
    where.mkdir()
    r = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=1m,ro", "tmpfs", str(where)], capture_output=True, text=True
    )
    if r.returncode != 0:
        pytest.skip(f"cannot mount a read-only tmpfs here (needs root with CAP_SYS_ADMIN): {r.stderr.strip()}")
    try:
        c = Cleaner(["train", f"storage.root={where}"], tmp_path)
        try:
            c.p.wait(timeout=60)
            c._reader.join(timeout=10)
        finally:
            c.cleanup()
        lines = [line for line in c.out.splitlines() if line.strip()]
        # refused before the temporary server starts (it would say so), so before any database is tried
        assert c.p.returncode == 1 and len(lines) == 1 and "read-only" in lines[0], c.out[-3000:]
    finally:
        subprocess.run(["umount", "-l", str(where)], capture_output=True)


def test_a_user_error_inside_the_flow_is_one_line_without_retry_or_traceback(tmp_path):
    import shutil

    from pipeline.config import DEFAULT_POLICY

    from flows.run_config import freeze_run_config
    from pipeline.config import load_config

    policy = tmp_path / "policy"
    shutil.copytree(DEFAULT_POLICY, policy)
    workspace = f"storage.root={tmp_path / 'ws'}"
    # a run already started, whose policy was truncated since: a new run's is refused before Prefect starts
    freeze_run_config(load_config(None, [workspace, f"rollout.policy={policy}"]), "demo")
    weights = policy / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:100_000])
    # On the project's real server, whose API keeps each run's state after the command ends.
    with project_server(tmp_path, workspace) as url:
        c = Cleaner(["train", workspace, f"rollout.policy={policy}", "flow.iterations=1"], tmp_path, api_url=url)
        try:
            c.p.wait(timeout=300)
            c._reader.join(timeout=10)
        finally:
            c.cleanup()
        (run,) = prefect_api(url, "/flow_runs/filter", {})
        tasks = prefect_api(url, "/task_runs/filter", {"flow_runs": {"id": {"any_": [run["id"]]}}})
    out = c.out
    assert c.p.returncode == 1 and "Traceback" not in out, out[-3000:]
    assert out.strip().splitlines()[-1].startswith("cleaner train: ") and "truncated safetensors" in out
    # the error's line once (the command's last), not again in each of Prefect's task and flow records
    assert out.count("truncated safetensors") == 1, out[-3000:]
    assert "CheckpointError" in out  # Prefect's records still say what failed
    assert run["state"]["type"] == "FAILED", run["state"]
    # the rollout failed once, not retried (flow.task_retries=1): it would fail the same way again
    assert [(t["name"].split("-")[0], t["state"]["type"], t["run_count"]) for t in tasks] == [("rollout", "FAILED", 1)]
    assert "CheckpointError" in tasks[0]["state"]["message"], tasks[0]["state"]
