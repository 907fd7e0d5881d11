"""Prefect servers on 127.0.0.1, each stopped by its own pid: the project's persistent server, and
the temporary server of one command.

The temporary server (`start_temporary_server`, used by train/demo/eval when PREFECT_API_URL is
unset) dies with its command, even under kill -9, so it cannot schedule anything. `cleaner schedule`
and `cleaner server start` therefore run `prefect server start` with the project's Prefect home
(`<root>/.prefect`), record its pid, port and URL in `<root>/.prefect/server.json`, and reuse it
while it answers. Only that pid (and its process group) is ever signalled.
"""

from __future__ import annotations

import atexit
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import asdict, dataclass
from pathlib import Path

from flows.console import working
from flows.env import configure_prefect
from pipeline.processes import alive, dies_with, terminate
from storage.errors import CleanerError
from storage.locks import turn

HOST = "127.0.0.1"


class ServerError(CleanerError):
    """The local Prefect server could not be started or reached."""


@dataclass(frozen=True)
class ServerState:
    pid: int
    port: int
    url: str  # the API URL: what PREFECT_API_URL must be set to
    log: str
    owner: int | None = None  # the command whose life it is bound to (`cleaner schedule`), None for `server start`


def prefect_home(root: Path) -> Path:
    return Path(root).resolve() / ".prefect"


def _state_path(root: Path) -> Path:
    return prefect_home(root) / "server.json"


def healthy(url: str, timeout: float = 2.0) -> bool:
    try:
        with urllib.request.urlopen(f"{url}/health", timeout=timeout) as r:
            return r.status == 200
    except OSError:
        return False


def _recorded(root: Path) -> ServerState | None:
    """The server state file's record, or None when it is missing or unreadable."""
    try:
        return ServerState(**json.loads(_state_path(root).read_text()))
    except (OSError, ValueError, TypeError):
        return None


def running_server(root: Path) -> ServerState | None:
    """The project's server if its recorded pid is alive and it answers; None otherwise."""
    state = _recorded(root)
    return state if state is not None and alive(state.pid) and healthy(state.url) else None


def free_port() -> int:
    with socket.socket() as s:
        s.bind((HOST, 0))
        return s.getsockname()[1]


def check_api(url: str) -> None:
    """A Prefect API the user named (PREFECT_API_URL) answers, else one line before any flow starts (Prefect's
    own client gives a 100-line traceback, after the command has printed as if it were working)."""
    try:
        with urllib.request.urlopen(f"{url.rstrip('/')}/health", timeout=5.0):
            return
    except urllib.error.HTTPError as e:
        if e.code == 404 and not url.rstrip("/").endswith("/api"):  # the UI's address, pasted
            raise ServerError(
                f"PREFECT_API_URL={url}: a server answers there, but not Prefect's API; the API is under /api "
                f"(PREFECT_API_URL={url.rstrip('/')}/api)"
            ) from None
        return  # a server answered (Prefect Cloud may want a key for /health): the flow's own calls say the rest
    except (OSError, ValueError) as e:
        reason = str(getattr(e, "reason", "") or e)
        raise ServerError(
            f"PREFECT_API_URL={url}: no Prefect server answers there ({reason}); start one (`cleaner "
            "server start`, then export the URL it prints) or unset PREFECT_API_URL to use a temporary "
            "one"
        ) from None


def _wait_started(proc: subprocess.Popen, url: str, timeout: float, what: str, log_path: Path) -> None:
    """Return once `url` answers; else stop the process and raise one line: what went wrong (it exited, or
    the time ran out) and the last line of its log."""
    deadline, problem = time.monotonic() + timeout, f"did not answer on {url} within {timeout:.0f} s"
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            problem = f"exited with code {proc.returncode} while starting"
            break
        if healthy(url):
            return
        time.sleep(0.2)
    terminate(proc.pid)
    tail = log_path.read_text(errors="replace").strip().splitlines()[-1:] or ["(no output)"]
    raise ServerError(f"{what} {problem}: {tail[0]} (log: {log_path})")


def _launch(
    port: int, env: dict[str, str], log_path: Path, flags: list[str], bound: bool
) -> tuple[subprocess.Popen, str]:
    """`prefect server start` in the foreground of a child of ours (Prefect's own command; its web server runs
    in that one process), output to log_path, in its own group: stopped as a whole, by our pid; with its API
    URL. bound: the child dies with this process, however it dies (kill -9 included)."""
    env = {**env, "PREFECT_SERVER_ANALYTICS_ENABLED": "false"}
    env.pop("PREFECT_API_URL", None)  # the server itself must not try to talk to another one
    cmd = [
        sys.executable,
        "-m",
        "prefect",
        "server",
        "start",
        "--host",
        HOST,
        "--port",
        str(port),
        "--analytics-off",
        *flags,
    ]
    with open(log_path, "ab") as log:
        proc = subprocess.Popen(
            cmd,
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env=env,
            start_new_session=True,
            preexec_fn=dies_with(os.getpid(), signal.SIGKILL) if bound else None,
        )
    return proc, f"http://{HOST}:{port}/api"


def start_server(
    root: Path, port: int | None = None, timeout: float = 180.0, ui: bool = True, bound: bool = False
) -> tuple[ServerState, bool]:
    """Start (or reuse) the project's Prefect server once /health answers: (state, started by this call).
    bound: the server dies with this process, however it dies (kill -9 included): for a command that
    owns its server (`cleaner schedule`), not for `cleaner server start`."""
    home = prefect_home(root)
    with _starting_turn(home):  # two at once would set up one database, or start two servers for one store
        current = running_server(root)
        if current is not None:
            return current, False
        return _start_project_server(root, home, port, ui, bound, timeout), True


def _start_project_server(root: Path, home: Path, port: int | None, ui: bool, bound: bool, timeout: float):
    if port:  # taken: Prefect exits after seconds with a wrapped line ("flag."), or another store's server answered
        with socket.socket() as s:  # on it and was taken for ours
            try:
                s.bind((HOST, port))
            except OSError as e:
                raise ServerError(
                    f"--port {port}: {HOST}:{port} is in use ({e.strerror}), by another program or another store's "
                    "server; give another port, or none for a free one"
                ) from None
    port = port or free_port()
    log_path = home / "server.log"
    proc, url = _launch(port, {**os.environ, "PREFECT_HOME": str(home)}, log_path, ["--ui" if ui else "--no-ui"], bound)
    state = ServerState(proc.pid, port, url, str(log_path), owner=os.getpid() if bound else None)
    _wait_started(proc, url, timeout, "prefect server", log_path)
    tmp = _state_path(root).with_suffix(".tmp")
    tmp.write_text(json.dumps(asdict(state)))
    os.replace(tmp, _state_path(root))
    return state


def owning_command(root: Path) -> int | None:
    """The pid of the running command that owns the project's server (`cleaner schedule`), if any."""
    state = _recorded(root)
    if state is None or state.owner is None or state.owner == os.getpid():
        return None
    return state.owner if alive(state.pid) and alive(state.owner) else None


def forget_server(root: Path, pid: int) -> None:
    """Remove the server record if it still names `pid` (a server that died): one recorded since is another's."""
    state = _recorded(root)
    if state is not None and state.pid == pid:
        _state_path(root).unlink(missing_ok=True)


def stop_server(root: Path) -> ServerState | None:
    """Stop the project's server by its recorded pid; returns what was stopped (None: nothing ran)."""
    state = _recorded(root)
    if state is None:
        return None
    owner = owning_command(root)
    if owner is not None:  # its schedule would go on firing into a dead API, with tracebacks, and not stop on Ctrl-C
        raise ServerError(
            f"the project's Prefect server (pid {state.pid}) belongs to `cleaner schedule` (pid {owner}), which "
            f"stops it when it ends: stop that command instead (Ctrl-C in its terminal, or kill {owner})"
        )
    if alive(state.pid):
        terminate(state.pid)
    _state_path(root).unlink(missing_ok=True)
    return state


# ---- the temporary server of one command --------------------------------------------------------


def _starting_turn(home: Path):
    """This command's turn to start a server on the Prefect database under `home`."""
    home.mkdir(parents=True, exist_ok=True)
    return turn(
        home / ".server-start.lock",
        waiting=lambda: print(
            f"waiting for another command starting a Prefect server on {home} …", file=sys.stderr, flush=True
        ),
    )


def start_temporary_server(root: Path) -> str | None:
    """Start a temporary Prefect server for this command, bound to its life; returns its API URL (also
    exported as PREFECT_API_URL), or None when the user set one.

    Prefect would start its own temporary server on first use, but only stops it from an atexit hook:
    after kill -9 of the command it kept running and listening. This one is Prefect's `prefect server
    start` without UI, scheduler or late-run service (nothing to schedule in one command), our child: it dies
    with the command (PR_SET_PDEATHSIG) and is stopped by its own pid on a normal exit.
    """
    if os.environ.get("PREFECT_API_URL"):
        check_api(os.environ["PREFECT_API_URL"])
        return None
    configure_prefect(root)
    home = Path(os.environ["PREFECT_HOME"])
    # commands started together take turns to start their servers: two that set up a new root's database at once
    # failed ("duplicate column name", "table … already exists": exit code 3)
    with _starting_turn(home):
        port = free_port()
        log_path = home / "temporary-server.log"
        flags = ["--no-ui", "--no-scheduler", "--no-late-runs"]
        proc, url = _launch(port, dict(os.environ), log_path, flags, bound=True)
        atexit.register(lambda: proc.poll() is None and terminate(proc.pid))  # a normal exit; kill -9: PDEATHSIG
        with working(f"Starting temporary Prefect server on http://{HOST}:{port} (stops with this command)"):
            _wait_started(
                proc,
                url,
                float(os.environ["PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS"]),
                "the temporary Prefect server (start-up timeout: PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS)",
                log_path,
            )
    os.environ["PREFECT_API_URL"] = url
    return url
