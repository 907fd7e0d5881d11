"""Several real vLLM CPU servers, and servers that go away: every trajectory's turns go to one server and both
servers get work; a server killed mid-rollout (its command killed with SIGKILL, which takes the server with
it) hands its trajectories to the other; the only server vanishing mid-rollout, or none answering at all,
ends the stage in one line with nothing committed."""

from __future__ import annotations

import socket
import threading
import time

import pytest

from pipeline.chat import load_chat
from pipeline.config import DEFAULT_POLICY, load_config
from pipeline.engines.vllm import VLLMEngine, VLLMUnavailable
from rollout_gen.agent import AgentLoop, RolloutIdentity
from rollout_gen.sandbox import SandboxPool
from rollout_gen.stage import run_rollout_stage
from rollout_gen.world.tasks import eval_tasks
from storage.layout import RunLayout
from storage.shards import read_manifest
from tests.flow_helpers import cleaner
from tests.vllm_helpers import CuttableProxy, ServerInAnotherCommand, overrides, requires_vllm, shared_url

pytestmark = [requires_vllm, pytest.mark.slow]


@pytest.fixture(scope="module")
def servers():
    other = ServerInAnotherCommand()  # starts while the shared one does
    try:
        first = shared_url()
        yield first, other
    finally:
        if other.proc.poll() is None:
            other.kill_command()


def _prompt_tokens(url: str) -> float:
    """What the server itself counted (Prometheus /metrics), not what the client believes it sent."""
    import urllib.request

    with urllib.request.urlopen(url + "/metrics", timeout=10) as r:
        text = r.read().decode()
    return sum(
        float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith("vllm:prompt_tokens_total")
    )


def _roll(urls: list[str], on_route=None, n_tasks: int = 8):
    cfg = load_config(
        None,
        [
            "rollout.samples_per_prompt=4",
            "rollout.max_response_tokens=512",
            "rollout.engine_tuning.deterministic=false",
            "rollout.engine_tuning.max_in_flight=16",
        ],
    )
    chat = load_chat(DEFAULT_POLICY)
    engine = VLLMEngine(urls, DEFAULT_POLICY, tokenizer=chat.tokenizer, max_in_flight=16, deterministic=False)
    engine.serve(DEFAULT_POLICY)
    engine.on_route = on_route
    try:
        with SandboxPool(cfg.rollout.sandbox) as sandbox:
            trajs = AgentLoop(engine, sandbox, chat, cfg.rollout).run(
                eval_tasks(cfg.world)[:n_tasks], RolloutIdentity("m", 0, "v")
            )
    finally:
        engine.close()
    return engine, trajs


def test_every_trajectorys_turns_go_to_one_server_and_both_servers_get_work(servers):
    first, other = servers
    urls = [first, other.wait()]
    before = [_prompt_tokens(u) for u in urls]
    routes: dict = {}
    engine, trajs = _roll(urls, on_route=lambda key, idx: routes.setdefault(key, set()).add(idx))
    assert len(trajs) == 32 and not any(t.finish_reason.startswith("agent_error") for t in trajs)
    assert len(routes) == 32 and all(len(s) == 1 for s in routes.values())  # sticky: one server per trajectory
    assert {next(iter(s)) for s in routes.values()} == {0, 1}
    assert min(engine.router.requests) > 0
    after = [_prompt_tokens(u) for u in urls]
    assert all(a > b for a, b in zip(after, before))  # both servers say they prefilled our prompts


def test_a_server_killed_mid_rollout_hands_its_trajectories_to_the_other(servers):
    first, other = servers
    urls = [first, other.wait()]
    sent = {"other": 0}
    killer: list[threading.Thread] = []

    def on_route(key, idx):
        if idx == 1:
            sent["other"] += 1
            if sent["other"] == 10:  # mid-rollout: kill the command that owns the second server
                killer.append(threading.Thread(target=other.kill_command))
                killer[0].start()

    engine, trajs = _roll(urls, on_route)
    assert killer, "the second server never got 10 requests"
    assert len(trajs) == 32 and not any(t.finish_reason.startswith("agent_error") for t in trajs)
    assert engine.stats["failovers"] >= 1
    deadline = time.monotonic() + 20
    while other.group_alive() and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not other.group_alive(), "the vLLM server outlived the command that started it"


def test_the_only_server_vanishing_mid_rollout_fails_the_stage_in_one_line(servers, tmp_path):
    first, _ = servers
    proxy = CuttableProxy(first)

    def cut_when_busy():
        deadline = time.monotonic() + 120
        while proxy.connections < 30 and time.monotonic() < deadline:
            time.sleep(0.01)
        proxy.cut()

    threading.Thread(target=cut_when_busy, daemon=True).start()
    cfg = load_config(None, overrides(tmp_path, [proxy.url]))
    with pytest.raises(VLLMUnavailable) as e:
        run_rollout_stage(cfg, "cut", 0, DEFAULT_POLICY, show_progress=False)
    msg = str(e.value)
    assert "\n" not in msg and proxy.url in msg and "no other vLLM server left" in msg
    raw = RunLayout(tmp_path, "cut").raw_dir(0)
    assert read_manifest(raw) is None and not any(raw.rglob("*.parquet"))  # nothing half-written


def test_a_server_that_is_down_ends_the_command_in_one_line(tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    p = cleaner(
        ["rollout", "--run", "down", "--iteration", "0", *overrides(tmp_path, [f"http://127.0.0.1:{port}"])], tmp_path
    )
    out, _ = p.communicate(timeout=300)
    assert p.returncode != 0
    lines = [ln for ln in out.splitlines() if ln.strip() and "Warning" not in ln and "pynvml" not in ln]
    assert lines and f"vLLM server at http://127.0.0.1:{port} is unreachable" in lines[-1] and "Traceback" not in out
    assert read_manifest(RunLayout(tmp_path, "down").raw_dir(0)) is None


def _group(pgid: int) -> list[int]:
    """Live processes of a process group (zombies left out)."""
    import os
    from pathlib import Path

    out = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[2]) == pgid and fields[0] != "Z":
            out.append(int(stat.parent.name))
    return [p for p in out if p != os.getpid()]


def test_a_server_runs_from_a_folder_of_its_own_and_goes_with_its_group_when_its_guard_died(tmp_path, monkeypatch):
    """`python -m` put the user's working directory first on the server's import path: a folder named z3/ there
    broke vLLM's engine at its first request. And a guard killed alone left the server running after cleaner
    stopped it (stop() signalled the group only while the guard lived)."""
    import os
    import signal

    from pipeline.config import DEFAULT_VLLM_VENV
    from pipeline.engines.vllm_server import start_servers
    from tests.vllm_helpers import MAX_MODEL_LEN, SERVER_ARGS

    (tmp_path / "z3").mkdir()
    monkeypatch.chdir(tmp_path)
    (s,) = start_servers(
        DEFAULT_POLICY, 1, DEFAULT_VLLM_VENV, "float32", MAX_MODEL_LEN, SERVER_ARGS, 600.0, log=lambda line: None
    )
    try:
        members = _group(s.pid)
        assert members and {os.readlink(f"/proc/{p}/cwd") for p in members} == {str(s.log.parent)}
        os.kill(s.pid, signal.SIGKILL)
        s.proc.wait(timeout=30)
        time.sleep(1)
        assert _group(s.pid), "the server went with its guard: nothing to clean up"
    finally:
        s.stop()
    deadline = time.time() + 30
    while _group(s.pid) and time.time() < deadline:
        time.sleep(0.2)
    assert not _group(s.pid)
