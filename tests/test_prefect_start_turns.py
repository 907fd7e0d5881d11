"""Commands started together on one root take turns to start their temporary Prefect servers (flows/server.py):
two that set up a new root's Prefect database at once failed ("duplicate column name", exit code 3), in 2 of 3
tries of a user's probe. A real `start_temporary_server` in a child process, the turn held by this test."""

from __future__ import annotations

import fcntl
import os
import subprocess
import sys
import time
from pathlib import Path


def test_a_command_waits_for_another_starting_a_server_on_its_root(tmp_path):
    root, started = tmp_path / "ws", tmp_path / "started"
    home = root / ".prefect"
    home.mkdir(parents=True)
    code = (
        "import sys\nfrom pathlib import Path\nfrom flows.server import start_temporary_server\n"
        f"url = start_temporary_server(Path({str(root)!r}))\nPath({str(started)!r}).write_text(url)\n"
        "import time\ntime.sleep(120)\n"
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith("PREFECT_")}
    env["PYTHONPATH"] = str(Path(__file__).resolve().parent.parent)
    fd = os.open(home / ".server-start.lock", os.O_RDWR | os.O_CREAT, 0o644)
    fcntl.flock(fd, fcntl.LOCK_EX)  # another command is starting its server on this root
    child = subprocess.Popen([sys.executable, "-c", code], env=env, stderr=subprocess.DEVNULL)
    try:
        time.sleep(4)
        assert child.poll() is None and not started.exists()  # it waits its turn
        assert not (home / "temporary-server.log").exists()  # no server launched yet
        os.close(fd)
        deadline = time.monotonic() + 150
        while not started.exists() and child.poll() is None and time.monotonic() < deadline:
            time.sleep(0.5)
        assert started.exists() and started.read_text().startswith("http://"), child.poll()
    finally:
        child.kill()  # its server dies with it (PR_SET_PDEATHSIG)
        child.wait()
