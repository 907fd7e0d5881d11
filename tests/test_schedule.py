"""Scheduling that fires: `cleaner schedule` on the embedded default starts a real local Prefect server,
serves the training deployment on a short interval, and the server's scheduler creates runs that
complete and commit a raw shard. Everything is stopped by its own pid."""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import time
from pathlib import Path

import pytest

from storage.layout import RunLayout
from storage.shards import read_manifest
from tests.flow_helpers import cleaner, command_env, prefect_api, run_cleaner, tiny_config


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    stat = Path(f"/proc/{pid}/stat")
    return stat.exists() and stat.read_text().split(") ")[-1][0] != "Z"


def _gone(pid: int, within_s: float = 30.0) -> bool:
    deadline = time.time() + within_s
    while time.time() < deadline and _alive(pid):
        time.sleep(0.2)
    return not _alive(pid)


def _as_from_a_terminal() -> None:
    """preexec_fn: Ctrl-C reaches the command as it would from a terminal. A parent without job control
    (a CI script, `cmd &` in a shell script) starts its children with SIGINT ignored, and then Python
    installs no KeyboardInterrupt handler: the command would rightly ignore the test's Ctrl-C."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def _as_from_a_script_background() -> None:
    """preexec_fn: `cleaner schedule &` in a shell script without job control starts with SIGINT ignored."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)


def _tiny_config(tmp_path: Path) -> Path:
    return tiny_config(
        tmp_path,
        flow={"run_id": "sched", "iterations": 1, "tensorboard": False},
        rollout={"tasks_per_iteration": 2, "samples_per_prompt": 2},
        purify={"modes": ["saar"]},
        train={"mini_batches": 1},
    )


def _start_schedule(tmp_path: Path, interval: int, name: str, preexec_fn=_as_from_a_terminal) -> subprocess.Popen:
    """`cleaner schedule` on the tiny config, in its own process group, as from a terminal; output in
    schedule.log."""
    cfg = _tiny_config(tmp_path)
    env = {k: v for k, v in command_env().items() if not k.startswith("PREFECT_")}
    with open(tmp_path / "schedule.log", "w") as log:
        return cleaner(
            ["schedule", "--interval", str(interval), "--no-ui", "--name", name, "-c", str(cfg)],
            tmp_path,
            env=env,
            cwd=tmp_path,
            stdout=log,
            preexec_fn=preexec_fn,
        )


def _wait_for(p: subprocess.Popen, log: Path, text: str, within_s: float) -> None:
    """Until the running schedule's log shows `text`."""
    deadline = time.time() + within_s
    while text not in log.read_text() and time.time() < deadline:
        assert p.poll() is None, log.read_text()[-3000:]
        time.sleep(0.5)
    assert text in log.read_text(), log.read_text()[-3000:]


def _completed_runs(url: str) -> list[dict]:
    return prefect_api(url, "/flow_runs/filter", {"flow_runs": {"state": {"type": {"any_": ["COMPLETED"]}}}})


def test_schedule_starts_a_local_server_and_a_scheduled_run_completes(tmp_path):
    p = _start_schedule(tmp_path, 20, "sched-test")
    state_file = tmp_path / ".prefect" / "server.json"
    server_pid, url, completed = None, None, []
    try:
        deadline = time.time() + 360
        while time.time() < deadline and not completed:
            assert p.poll() is None, (tmp_path / "schedule.log").read_text()[-3000:]
            if url is None and state_file.exists():
                state = json.loads(state_file.read_text())
                server_pid, url = state["pid"], state["url"]
            if url is not None:
                completed = [r for r in _completed_runs(url) if r["name"]]
            time.sleep(2)
        out = (tmp_path / "schedule.log").read_text()
        assert completed, f"no scheduled run completed within the deadline:\n{out[-3000:]}"
        assert completed[0]["deployment_id"] is not None  # created by the deployment's schedule, not by hand
        assert read_manifest(RunLayout(tmp_path, "sched").raw_dir(0)).rows == 4
        # The printed trigger command works from a plain shell (no PREFECT_HOME, nothing but the URL).
        trigger = re.search(r"^\s+(PREFECT_API_URL=\S+) (\S*prefect deployment run .+)$", out, re.M)
        assert trigger, out[-3000:]
        # a shell without the venv on its PATH: the printed command names the venv's prefect
        plain = {
            "PATH": "/usr/bin:/bin",
            "HOME": str(tmp_path),
            trigger.group(1).split("=", 1)[0]: trigger.group(1).split("=", 1)[1],
        }
        ran = subprocess.run(["bash", "-c", trigger.group(2)], env=plain, capture_output=True, text=True, timeout=120)
        assert ran.returncode == 0, ran.stdout + ran.stderr
        # the next firing (scheduled or that trigger) does new work: iteration 1, from checkpoint 1
        layout = RunLayout(tmp_path, "sched")
        deadline = time.time() + 300
        while time.time() < deadline and read_manifest(layout.raw_dir(1)) is None:
            assert p.poll() is None, (tmp_path / "schedule.log").read_text()[-3000:]
            time.sleep(2)
        raw1 = read_manifest(layout.raw_dir(1))
        assert raw1 is not None, (tmp_path / "schedule.log").read_text()[-3000:]
        assert raw1.inputs[0].endswith("checkpoints/iteration=0001")
        assert "prefect deployment run" not in out.replace(trigger.group(0), "")  # only the command that works
        # one firing at a time: a firing while another trains is cancelled, never run beside it
        # (among the firings that ran to their end; one still running when this looks has no end time yet)
        runs = sorted(
            (r for r in prefect_api(url, "/flow_runs/filter", {}) if r["state_type"] == "COMPLETED"),
            key=lambda r: r["start_time"],
        )
        for earlier, later in zip(runs, runs[1:]):
            assert earlier["end_time"] <= later["start_time"], [
                (r["name"], r["start_time"], r["end_time"]) for r in (earlier, later)
            ]
    finally:
        os.killpg(p.pid, signal.SIGINT)  # Ctrl-C: the command stops the server it started
        hung = False
        try:
            p.wait(timeout=60)
        except subprocess.TimeoutExpired:
            hung = True
            os.killpg(p.pid, signal.SIGKILL)
            p.wait(timeout=30)
        if server_pid is not None and not _gone(server_pid):
            os.killpg(server_pid, signal.SIGKILL)
            raise AssertionError("the Prefect server outlived `cleaner schedule`")
    tail = (tmp_path / "schedule.log").read_text()[-3000:]
    assert not hung, f"`cleaner schedule` still ran 60 s after Ctrl-C:\n{tail}"
    assert not state_file.exists(), f"stopped without removing {state_file}:\n{tail}"


@pytest.mark.parametrize("started", [_as_from_a_terminal, _as_from_a_script_background])
def test_sigterm_during_a_firing_stops_as_ctrl_c_does(tmp_path, started):
    """`kill PID` (systemd, docker stop) while a firing trains: Prefect's runner answered it with sys.exit inside its
    event loop, the server stopped under the firing, which retried the API for 2.5 minutes (330 lines of
    tracebacks). Now: the firing is interrupted and recorded as crashed, the command ends in seconds, quietly."""
    p = _start_schedule(tmp_path, 10, "sigterm-test", started)
    log = tmp_path / "schedule.log"
    try:
        _wait_for(p, log, "[rollout it 0]", within_s=240)
        state = json.loads((tmp_path / ".prefect" / "server.json").read_text())
        p.send_signal(signal.SIGTERM)  # this process alone, as `kill PID` does
        code = p.wait(timeout=60)
    finally:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
    text = log.read_text()
    assert code == 0 and "Traceback" not in text and "Error logging to API" not in text, text[-4000:]
    assert "Crash detected! Execution was aborted by an interrupt signal" in text, text[-3000:]
    assert _gone(state["pid"]), "the Prefect server outlived `cleaner schedule`"


def test_a_killed_schedule_command_takes_its_server_down(tmp_path):
    """kill -9 of `cleaner schedule` (a CI timeout, an OOM kill) leaves no Prefect server running."""
    p = _start_schedule(tmp_path, 3600, "killed")
    state_file = tmp_path / ".prefect" / "server.json"
    deadline = time.time() + 180
    while time.time() < deadline and not state_file.exists():
        assert p.poll() is None, (tmp_path / "schedule.log").read_text()[-3000:]
        time.sleep(0.5)
    server_pid = json.loads(state_file.read_text())["pid"]
    assert _alive(server_pid)
    os.killpg(p.pid, signal.SIGKILL)
    p.wait(timeout=30)
    if not _gone(server_pid):
        os.killpg(server_pid, signal.SIGKILL)
        raise AssertionError("the Prefect server outlived a killed `cleaner schedule`")


def test_run_ids_from_a_template():
    from flows.run_config import run_id_for

    t = time.mktime((2026, 11, 24, 23, 5, 9, 0, 0, -1))
    assert run_id_for("nightly-{date}", "demo", t) == "nightly-20261124"
    assert run_id_for("{run_id}-{date}-{time}", "demo", t) == "demo-20261124-230509"


def test_a_prefect_api_url_nobody_answers_is_one_line(tmp_path):
    """A stale PREFECT_API_URL (a `cleaner server` since stopped) gave a 100-line traceback, after `schedule` had
    printed its banner as if it were serving."""
    from tests.flow_helpers import run_cleaner

    env = {**command_env(tmp_path), "PREFECT_API_URL": "http://127.0.0.1:9/api"}
    for args in (["train", "-c", str(tiny_config(tmp_path))], ["schedule", "--interval", "60", "--no-ui"]):
        out = run_cleaner(args, tmp_path, env=env, timeout=120)
        assert out.returncode == 1 and "Traceback" not in out.stderr, out.stdout + out.stderr
        assert (
            out.stderr.strip()
            .splitlines()[-1]
            .startswith(f"cleaner {args[0]}: PREFECT_API_URL=http://127.0.0.1:9/api: no Prefect server answers there")
        ), out.stderr
        assert "trigger a run" not in out.stdout and not (tmp_path / "runs").exists()


def test_schedule_arguments_are_checked_before_a_server_starts(tmp_path, capsys):
    """A bad cron or a negative interval was a 58-line pydantic traceback after the server had started and the
    banner had printed; --interval 0 said "give --interval"; a --new-run template naming an unknown field failed
    with a KeyError at every firing. Each is now one line, exit 2, before anything starts."""
    from tests.flow_helpers import refused

    base = ["schedule", "--no-ui", f"storage.root={tmp_path / 'ws'}"]
    refused([*base, "--cron", "not a cron"], capsys, 2, "--cron 'not a cron': not a cron expression")
    refused([*base, "--cron", "61 * * * *"], capsys, 2, "not a cron expression")
    refused([*base, "--interval", "-5"], capsys, 2, "--interval -5: seconds between firings, a number above 0")
    refused([*base, "--interval", "0"], capsys, 2, "--interval 0: seconds between firings")
    refused([*base, "--interval", "10", "--cron", "* * * * *"], capsys, 2, "not both")
    refused([*base, "--interval", "60", "--new-run", "x-{nope}"], capsys, 2, "--new-run 'x-{nope}'", "{nope}")
    refused([*base, "--interval", "60", "--new-run", "a/{date}"], capsys, 2, "must be a plain folder name")
    assert not (tmp_path / "ws" / ".prefect" / "server.log").exists()  # no server was started


def test_a_port_in_use_and_an_api_url_without_api_are_one_line(tmp_path):
    """`cleaner server start --port P` with P taken said "started" (another store's server answered on P) or
    "exited …: flag."; a PREFECT_API_URL pasted without /api (the UI's address) gave a 62-line traceback."""
    import http.server
    import socket
    import threading

    from flows.server import ServerError, check_api, start_server

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(ServerError, match=f"--port {port}: 127.0.0.1:{port} is in use"):
            start_server(tmp_path / "ws", port=port)
    httpd = http.server.HTTPServer(("127.0.0.1", 0), http.server.SimpleHTTPRequestHandler)  # answers 404 on /health
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    try:
        url = f"http://127.0.0.1:{httpd.server_address[1]}"
        with pytest.raises(ServerError, match=r"not Prefect's API; the API is under /api"):
            check_api(url)
    finally:
        httpd.shutdown()


def test_a_firing_left_running_by_a_killed_schedule_no_longer_blocks_the_next(tmp_path, monkeypatch):
    """A schedule killed during a firing (kill -9, OOM, a reboot) left that run Running in the store's database,
    holding the deployment's one concurrency slot through a lease its server kept in memory: every firing of the
    next `cleaner schedule` was cancelled, for good and without a word. The next schedule's own server now marks
    such runs crashed, which frees the slot."""
    from prefect import get_client
    from prefect.client.schemas.objects import ConcurrencyLimitConfig, ConcurrencyLimitStrategy, StateType
    from prefect.states import Pending, Running

    from flows.env import configure_prefect
    from flows.flow_commands import crash_stale_firings
    from flows.server import start_server, stop_server

    root = tmp_path / "ws"
    configure_prefect(root)
    server, started = start_server(root, ui=False)
    assert started
    monkeypatch.setenv("PREFECT_API_URL", server.url)
    try:
        with get_client(sync_client=True) as client:
            flow_id = client.create_flow_from_name("cleaner-training")
            deployment = client.create_deployment(
                flow_id,
                "nightly",
                concurrency_limit=1,
                concurrency_options=ConcurrencyLimitConfig(
                    limit=1, collision_strategy=ConcurrencyLimitStrategy.CANCEL_NEW
                ).model_dump(exclude={"limit"}),
            )
            run = client.create_flow_run_from_deployment(deployment)
            client.set_flow_run_state(run.id, Pending())  # takes the slot, as a firing does
            client.set_flow_run_state(run.id, Running())
            limit = client.read_deployment(deployment).global_concurrency_limit
            assert client.read_global_concurrency_limit_by_name(limit.name).active_slots == 1
    finally:
        stop_server(root)  # the command is killed: its server, and the slot's lease in its memory, are gone
    server, started = start_server(root, ui=False)
    monkeypatch.setenv("PREFECT_API_URL", server.url)
    try:
        assert crash_stale_firings("cleaner-training/nightly") == 1
        with get_client(sync_client=True) as client:
            assert client.read_flow_run(run.id).state.type == StateType.CRASHED
            assert client.read_global_concurrency_limit_by_name(limit.name).active_slots == 0
        assert crash_stale_firings("cleaner-training/nightly") == 0
        assert crash_stale_firings("cleaner-training/never-served") == 0
    finally:
        stop_server(root)


def test_a_firing_ends_when_its_schedule_is_killed(tmp_path):
    """kill -9 of `cleaner schedule` alone (the OOM killer, `kill -9 PID`) while a firing trains: the firing,
    reparented to init, went on without a server and hung at its exit sending logs. Now it stops as Ctrl-C does,
    within seconds, and says why."""
    import psutil

    p = _start_schedule(tmp_path, 10, "orphaned")
    log = tmp_path / "schedule.log"
    orphans: list[int] = []
    try:
        _wait_for(p, log, "[rollout it 0]", within_s=240)
        # Prefect's runner starts each firing by multiprocessing's spawn (beside its resource tracker)
        firings = [c for c in psutil.Process(p.pid).children() if "--multiprocessing-fork" in c.cmdline()]
        assert len(firings) == 1, [c.cmdline() for c in psutil.Process(p.pid).children()]
        firing = firings[0]
        orphans.append(firing.pid)
        p.send_signal(signal.SIGKILL)  # this process alone
        p.wait(timeout=30)
        gone = _gone(firing.pid, within_s=60)
    finally:
        for pid in {p.pid, *orphans, *(c.pid for c in psutil.Process(os.getpid()).children(recursive=True))}:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
    text = log.read_text()
    assert gone, f"the firing outlived its killed `cleaner schedule` by a minute:\n{text[-3000:]}"
    assert "is gone (killed): stopping as Ctrl-C would" in text, text[-3000:]


def test_a_schedule_keeps_its_server_and_ends_in_one_line_when_it_dies(tmp_path):
    """`cleaner server stop` under a running schedule stopped the schedule's own server: the schedule went on
    polling a dead API with a traceback a minute and no longer stopped on Ctrl-C. Now that stop is refused, naming
    the schedule; and a server that dies all the same (killed, out of memory) ends its schedule in one line."""
    p = _start_schedule(tmp_path, 3600, "owned")
    log = tmp_path / "schedule.log"
    state_file = tmp_path / ".prefect" / "server.json"
    try:
        _wait_for(p, log, "[schedule] every firing trains", within_s=180)
        server_pid = json.loads(state_file.read_text())["pid"]
        env = {k: v for k, v in command_env().items() if not k.startswith("PREFECT_")}
        stop = run_cleaner(["server", "stop", "-c", str(_tiny_config(tmp_path))], env=env, cwd=tmp_path)
        assert stop.returncode == 1 and f"belongs to `cleaner schedule` (pid {p.pid})" in stop.stderr, stop
        assert _alive(server_pid) and p.poll() is None
        os.kill(server_pid, signal.SIGKILL)
        code = p.wait(timeout=30)
    finally:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
    text = log.read_text()
    assert code == 1 and f"its Prefect server (pid {server_pid}) stopped" in text, text[-3000:]
    assert "Traceback" not in text and not state_file.exists(), text[-3000:]


def test_a_dead_servers_record_is_forgotten_but_not_one_written_since(tmp_path):
    """A schedule whose server died removes its record; one that `cleaner server start` wrote in the meantime names
    another, live server, which stop_server would have stopped."""
    from flows.server import forget_server, prefect_home

    record = prefect_home(tmp_path) / "server.json"
    record.parent.mkdir(parents=True)
    record.write_text(json.dumps({"pid": 4242, "port": 1, "url": "http://127.0.0.1:1/api", "log": "x"}))
    forget_server(tmp_path, 999_999)
    assert record.exists()
    forget_server(tmp_path, 4242)
    assert not record.exists()


def test_a_schedule_on_the_projects_running_server_says_it_uses_it(tmp_path, monkeypatch, capsys):
    """With `cleaner server start` running, schedule said "starting a local Prefect server" and used the running
    one (rightly), leaving it up at its end."""
    import flows.server
    import flows.training
    from flows.cli import main
    from flows.server import ServerState

    state = ServerState(4242, 1234, "http://127.0.0.1:1234/api", str(tmp_path / "server.log"))
    for name in ("PREFECT_API_URL", "CLEANER_SCHEDULE_PID"):  # the command sets both: restored after the test
        monkeypatch.setenv(name, "")  # (delenv of an absent variable records nothing to restore)
        monkeypatch.delenv(name)
    monkeypatch.setattr(flows.server, "running_server", lambda root: state)
    monkeypatch.setattr(flows.server, "start_server", lambda *a, **kw: (state, False))
    monkeypatch.setattr(flows.training.training_flow, "serve", lambda **kw: None)  # the serving is not the point
    assert main(["schedule", "--interval", "60", f"storage.root={tmp_path}"]) == 0
    out = capsys.readouterr().out
    assert "[schedule] using the project's running Prefect server (pid 4242" in out and "starting a" not in out
    assert "it stays up when this command ends" in out
    owned = ServerState(4242, 1234, state.url, state.log, owner=777)  # another schedule's: it ends with that one
    monkeypatch.setattr(flows.server, "running_server", lambda root: owned)
    monkeypatch.delenv("PREFECT_API_URL")  # the first command set it
    assert main(["schedule", "--interval", "60", f"storage.root={tmp_path}"]) == 0
    assert "it belongs to `cleaner schedule` pid 777, and ends with it" in capsys.readouterr().out


def test_a_stopping_schedule_interrupts_a_firing_started_late_and_kills_what_still_runs(monkeypatch):
    """Ctrl-C reached the firings running then, but a submission already under way could start one more while the
    runner paused the deployment (seconds on a loaded server): it never got the Ctrl-C, and the runner waited for it
    without a bound (a schedule still ran 60 s after Ctrl-C in a full suite's run). From the stop on, a new firing
    is interrupted as it appears, and any firing left after the grace period is killed. Real processes stand in for
    the firings (multiprocessing's `--multiprocessing-fork` children) and for the schedule's Prefect server."""
    import sys

    from flows import flow_commands

    def child(code: str, *flags: str) -> subprocess.Popen:
        return subprocess.Popen([sys.executable, "-c", code, *flags])

    deaf = "import signal, time\nsignal.signal(signal.SIGINT, signal.SIG_IGN)\ntime.sleep(60)"
    running = child(deaf, "--multiprocessing-fork")  # got the Ctrl-C already, and is not ending
    server = child("import time\ntime.sleep(60)")  # the schedule's Prefect server: not a firing
    started = [running, server]
    try:
        time.sleep(0.5)
        flow_commands._bound_firings(server.pid, grace_s=4.0)
        late = child("import time\ntime.sleep(60)", "--multiprocessing-fork")  # submitted before the stop
        started.append(late)
        assert late.wait(timeout=3) != 0  # interrupted as it appeared (KeyboardInterrupt)
        assert running.poll() is None  # not interrupted twice
        assert running.wait(timeout=10) == -signal.SIGKILL  # killed at the end of the grace period
        assert server.poll() is None
    finally:
        for p in started:
            p.kill()
            p.wait()
