"""Whether a process we started still runs, its stop, and its death with its starter: shared by the
services cleaner starts and stops by pid (the project's Prefect server, the local Dask cluster, vLLM servers)."""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import time
from typing import Callable

import psutil

PR_SET_PDEATHSIG = 1  # linux/prctl.h
SCHEDULE_PID_ENV = "CLEANER_SCHEDULE_PID"  # set by `cleaner schedule` for its firings: the process they live under


def alive(pid: int) -> bool:
    """True while `pid` runs; a zombie (exited, not yet reaped by its parent) counts as gone."""
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False
    except psutil.AccessDenied:
        return True


def dies_with(parent: int, sig: int) -> Callable[[], None]:
    """A Popen preexec_fn: the kernel sends the child `sig` when the thread that started it dies, however it
    dies (kill -9 included), so no server outlives its command; `parent` is the starter's os.getpid()."""

    def set_pdeathsig() -> None:
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, sig, 0, 0, 0)
        if os.getppid() != parent:  # the parent died before prctl took effect
            os._exit(1)

    return set_pdeathsig


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
        with contextlib.suppress(ChildProcessError):
            os.waitpid(pid, os.WNOHANG)
        if not alive(pid):
            return


def keep_interrupts_from_finalizers() -> None:
    """A Ctrl-C (KeyboardInterrupt) raised inside a finalizer (`__del__` of a regex, a tokenizer, a socket being
    collected) is printed by Python as "Exception ignored … Traceback" and dropped, so the command went on as if
    nothing was pressed. This delivers it again 50 ms later, outside the finalizer, and prints nothing. Through
    sys.unraisablehook, not a SIGINT handler: asyncio.run keeps its own Ctrl-C handling only over Python's default
    handler. Left alone where another hook is installed already (a test runner's)."""
    import sys
    import threading

    if sys.unraisablehook is not sys.__unraisablehook__:
        return

    def hook(unraisable) -> None:
        if unraisable.exc_type is not None and issubclass(unraisable.exc_type, KeyboardInterrupt):
            threading.Timer(0.05, os.kill, (os.getpid(), signal.SIGINT)).start()
            return
        sys.__unraisablehook__(unraisable)

    sys.unraisablehook = hook


def stop_when_orphaned(parent: int, what: str, grace_s: float = 20.0, poll_s: float = 0.5) -> None:
    """Interrupt this process as Ctrl-C does once `parent` is gone (killed with -9, by the OOM killer), and end it
    `grace_s` later if it still runs. A schedule's firing is a process of its own that Prefect's runner starts:
    orphaned, it went on training without a server and hung at its exit sending logs to it. A thread that polls,
    not PR_SET_PDEATHSIG: the kernel sends that when the starting *thread* ends, and the runner's is not ours."""
    import sys
    import threading

    start_ppid = os.getppid()

    def watch() -> None:
        while alive(parent) and os.getppid() == start_ppid:
            time.sleep(poll_s)
        with contextlib.suppress(OSError, ValueError):
            print(
                f"[{what}] pid {parent} is gone (killed): stopping as Ctrl-C would; committed stages are kept and "
                "a rerun resumes",
                file=sys.stderr,
                flush=True,
            )
        os.kill(os.getpid(), signal.SIGINT)
        time.sleep(grace_s)  # the interrupted run reports to a server that died with its command: don't wait for it
        os._exit(130)

    threading.Thread(target=watch, name=f"{what}-orphan-watch", daemon=True).start()
