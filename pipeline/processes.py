"""Whether a process we started still runs: shared by the services cleaner starts and stops by pid
(the project's Prefect server, the local Dask cluster)."""
from __future__ import annotations

import os
import signal
import time

import psutil


def alive(pid: int) -> bool:
    """True while `pid` runs; a zombie (exited, not yet reaped by its parent) counts as gone."""
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False
    except psutil.AccessDenied:
        return True


def terminate(pid: int, grace: float = 10.0) -> None:
    """SIGTERM the process group led by `pid`, then SIGKILL after `grace` seconds; reap it if it is our child."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(pid, sig)
        except ProcessLookupError:
            pass
        except PermissionError:
            return
        deadline = time.monotonic() + grace
        while time.monotonic() < deadline and alive(pid):
            time.sleep(0.05)
        try:
            os.waitpid(pid, os.WNOHANG)
        except ChildProcessError:
            pass
        if not alive(pid):
            return
