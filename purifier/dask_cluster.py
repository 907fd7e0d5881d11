"""A local Dask cluster for `purify.runner=dask`: one scheduler and N worker processes on 127.0.0.1.

Dask's own entry points do the work: `dask scheduler --scheduler-file` and `dask worker --scheduler-file`
(the workers find the scheduler through its file), and `Client.shutdown()` to stop (the scheduler closes its
workers, then itself). What stays hand-written, and why: the join loop (`_wait_workers`) rather than
`Client.wait_for_workers`, because it fails at once with the worker's last log line when a worker exits while
starting (a bad --memory-limit) and checks that the workers that joined are the processes it started;
and since `cleaner cluster start` returns while the cluster keeps running and `stop`/`status` are other
commands, so the processes are recorded by pid in `<dir>/cluster.json` (by default `<storage.root>/.dask/`;
a LocalCluster dies with the process that made it); and a cluster whose scheduler is gone (killed, crashed)
cannot be shut down through it, so `stop` then ends what is left by those pids alone (its own session and
process group), never by name. Workers run without a nanny, so each worker is exactly one recorded process
(one that dies is not restarted: the scheduler reruns its tasks on the others). Start-up is bounded; a
cluster that does not come up is stopped again and reported in one line naming its log.

Workers import the project, so they get PYTHONPATH=<this checkout> and the interpreter that started
them (the same venv). A multi-node cluster needs the same on every node: docs/scale_out.md.
"""

from __future__ import annotations

import fcntl
import json
import logging
import os
import socket
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from pipeline.processes import alive, terminate
from storage.errors import CleanerError

HOST = "127.0.0.1"
CLUSTER_DIR = ".dask"
STATE_FILE = "cluster.json"
CHECKOUT = Path(__file__).resolve().parent.parent


class ClusterError(CleanerError):
    """The local Dask cluster could not be started, found or reached."""


@dataclass(frozen=True)
class Cluster:
    address: str  # what purify.dask_address must be set to (None there finds it through this file)
    scheduler_pid: int
    worker_pids: tuple[int, ...]
    directory: str  # holds cluster.json, scheduler.json and one log per process
    threads: int = 1
    resources: str = ""

    @property
    def pids(self) -> tuple[int, ...]:
        return (*self.worker_pids, self.scheduler_pid)


@dataclass(frozen=True)
class ClusterStatus:
    cluster: Cluster
    alive: dict[int, bool] = field(default_factory=dict)  # pid → still running

    @property
    def running(self) -> bool:
        return all(self.alive.values())

    def line(self) -> str:
        up = sum(self.alive[p] for p in self.cluster.worker_pids)
        state = "running" if self.running else ("partly running" if any(self.alive.values()) else "stopped")
        sched = "up" if self.alive[self.cluster.scheduler_pid] else "down"
        return (
            f"Dask cluster {state} at {self.cluster.address}: scheduler pid {self.cluster.scheduler_pid} {sched}, "
            f"{up}/{len(self.cluster.worker_pids)} workers up (pids {', '.join(map(str, self.cluster.worker_pids))}); "
            f"logs in {self.cluster.directory}"
        )


def cluster_dir(root: Path) -> Path:
    """Where the local cluster of a storage root keeps its pid file and logs."""
    return Path(root).resolve() / CLUSTER_DIR


def _state_path(directory: Path) -> Path:
    return Path(directory) / STATE_FILE


def read_cluster(directory: Path) -> Cluster | None:
    try:
        data = json.loads(_state_path(directory).read_text())
        data["worker_pids"] = tuple(data["worker_pids"])
        return Cluster(**data)
    except (OSError, ValueError, TypeError, KeyError):
        return None


def _ours(pid: int, directory: Path) -> bool:
    """The pid still runs a process this module started for `directory` (not a reused pid)."""
    try:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except OSError:
        return False
    return any(str(Path(directory).resolve()).encode() in arg for arg in cmdline)


def status(directory: Path) -> ClusterStatus | None:
    """The recorded cluster and which of its processes still run; None when none was started here."""
    cluster = read_cluster(directory)
    if cluster is None:
        return None
    return ClusterStatus(cluster, {pid: alive(pid) and _ours(pid, directory) for pid in cluster.pids})


def running_address(directory: Path) -> str:
    """The scheduler address of the cluster started in `directory`; one line when there is none."""
    st = status(directory)
    if st is None:
        raise ClusterError(
            f"purify.runner=dask: no purify.dask_address and no local Dask cluster in {directory} "
            "(start one with `cleaner cluster start`, or set purify.dask_address=tcp://HOST:8786)"
        )
    if not st.alive[st.cluster.scheduler_pid] or not any(st.alive[p] for p in st.cluster.worker_pids):
        raise ClusterError(
            f"purify.runner=dask: the local Dask cluster in {directory} is not running "
            f"({st.line()}); restart it with `cleaner cluster stop` then `cleaner cluster start`"
        )
    return st.cluster.address


def worker_env(threads: int, extra: dict[str, str]) -> dict[str, str]:
    """The environment of every cluster process (this one's with `extra`): the checkout importable, one BLAS/torch
    thread per task thread, and a fixed hash seed (Beam and Dask key by tokenize/crc32, but user code may use
    hash())."""
    env = {**os.environ, **extra}
    env["PYTHONPATH"] = os.pathsep.join([str(CHECKOUT), *[p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]])
    env.update(
        {
            "PYTHONHASHSEED": "0",
            "OMP_NUM_THREADS": str(threads),
            "MKL_NUM_THREADS": str(threads),
            "TOKENIZERS_PARALLELISM": "false",
            "PYTHONUNBUFFERED": "1",
        }
    )
    return env


def _popen(cmd: list[str], log: Path, env: dict[str, str]) -> subprocess.Popen:
    with open(log, "ab") as out:
        # its own session and process group: a Ctrl-C on the starting command does not reach it, and
        # stop() signals exactly this group, by its recorded pid
        return subprocess.Popen(
            cmd,
            stdout=out,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env=env,
            cwd=str(CHECKOUT),
            start_new_session=True,
        )


def _tail(log: Path) -> str:
    try:
        lines = [ln for ln in log.read_text(errors="replace").splitlines() if ln.strip()]
    except OSError:
        return "(no log)"
    return lines[-1].strip() if lines else "(no output)"


def _wait_address(proc: subprocess.Popen, scheduler_file: Path, log: Path, deadline: float) -> str:
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise ClusterError(
                f"the Dask scheduler exited with code {proc.returncode} while starting: {_tail(log)} (log: {log})"
            )
        try:
            return json.loads(scheduler_file.read_text())["address"]
        except (OSError, ValueError, KeyError):
            time.sleep(0.1)
    raise ClusterError(f"the Dask scheduler did not start within the time allowed: {_tail(log)} (log: {log})")


def _wait_workers(address: str, procs: list[subprocess.Popen], logs: list[Path], deadline: float) -> None:
    from distributed import Client

    left = max(1.0, deadline - time.monotonic())
    try:
        client = Client(address, timeout=f"{left:.0f}s", set_as_default=False)
    except (OSError, TimeoutError) as e:
        raise ClusterError(f"the Dask scheduler at {address} does not answer: {e}") from None
    try:
        while True:
            for proc, log in zip(procs, logs):
                if proc.poll() is not None:
                    raise ClusterError(
                        f"a Dask worker exited with code {proc.returncode} while starting: {_tail(log)} (log: {log})"
                    )
            pids = set(client.run(os.getpid).values()) if client.scheduler_info(n_workers=-1)["workers"] else set()
            if {p.pid for p in procs} <= pids:
                return
            if time.monotonic() > deadline:
                raise ClusterError(
                    f"{len(pids)}/{len(procs)} Dask workers joined {address} within the time allowed: "
                    f"{_tail(logs[0])} (logs in {logs[0].parent})"
                )
            time.sleep(0.2)
    finally:
        client.close()


def start(
    directory: Path,
    workers: int = 2,
    threads: int = 1,
    port: int = 0,
    timeout: float = 60.0,
    resources: str = "",
    memory_limit: str = "auto",
    env: dict[str, str] | None = None,
) -> Cluster:
    """Start a scheduler on 127.0.0.1 (`port` 0: a free one) and `workers` worker processes, and return once
    every worker has joined, at most `timeout` seconds later; on failure everything started is stopped.
    `resources` is passed to each worker (e.g. "GPU=1"); `env` extends the workers' environment."""
    if workers < 1 or threads < 1:
        raise ClusterError(f"a Dask cluster needs at least one worker and one thread (got {workers} and {threads})")
    _check_options(port, timeout, resources)
    directory = Path(directory).resolve()
    try:
        directory.mkdir(parents=True, exist_ok=True)
        lock = open(directory / ".start.lock", "w")  # noqa: SIM115 - held until this start ends
    except OSError as e:
        raise ClusterError(f"{directory}: cannot hold the Dask cluster's files: {e.strerror or e}") from None
    with lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise ClusterError(
                f"another `cleaner cluster start` is starting a Dask cluster from {directory}; "
                "see `cleaner cluster status` once it is done"
            ) from None
        return _start(
            directory,
            workers=workers,
            threads=threads,
            port=port,
            timeout=timeout,
            resources=resources,
            memory_limit=memory_limit,
            env=env,
        )


def _check_options(port: int, timeout: float, resources: str) -> None:
    """What `cleaner cluster start` is given, checked before anything starts."""
    if not 0 <= port <= 65535:
        raise ClusterError(f"--port {port}: a port is 0 (a free one) to 65535")
    if port:
        with socket.socket() as s:
            try:
                s.bind((HOST, port))
            except OSError:
                raise ClusterError(f"--port {port}: in use on {HOST}; give another, or 0 for a free one") from None
    if not timeout > 0:
        raise ClusterError(f"--timeout {timeout}: seconds the workers have to join, > 0")
    for item in resources.replace(",", " ").split():
        name, _, amount = item.partition("=")
        try:
            float(amount)
        except ValueError:
            raise ClusterError(
                f'--resources {resources!r}: expected NAME=NUMBER pairs, e.g. "GPU=1 MEM=10e9"'
            ) from None
        if not name.isidentifier():
            raise ClusterError(f"--resources {resources!r}: {name!r} is not a resource name")


def _start(
    directory: Path,
    *,
    workers: int,
    threads: int,
    port: int,
    timeout: float,
    resources: str,
    memory_limit: str,
    env: dict[str, str] | None,
) -> Cluster:
    current = status(directory)
    if current is not None and any(current.alive.values()):
        raise ClusterError(
            f"a Dask cluster already runs from {directory} ({current.line()}); stop it with `cleaner cluster stop`"
        )
    try:
        _state_path(directory).unlink(missing_ok=True)  # a stale record: none of its pids runs
        scheduler_file = directory / "scheduler.json"
        scheduler_file.unlink(missing_ok=True)
    except OSError as e:
        raise ClusterError(f"{directory}: cannot hold the Dask cluster's files: {e.strerror or e}") from None
    base = worker_env(threads, env or {})
    deadline = time.monotonic() + timeout
    started: list[subprocess.Popen] = []
    try:
        log = directory / "scheduler.log"
        sched = _popen(
            [
                sys.executable,
                "-m",
                "distributed.cli.dask_scheduler",
                "--host",
                HOST,
                "--port",
                str(port),
                "--no-dashboard",
                "--scheduler-file",
                str(scheduler_file),
            ],
            log,
            base,
        )
        started.append(sched)
        address = _wait_address(sched, scheduler_file, log, deadline)
        logs = []
        for i in range(workers):
            logs.append(directory / f"worker-{i}.log")
            cmd = [
                sys.executable,
                "-m",
                "distributed.cli.dask_worker",
                "--scheduler-file",
                str(scheduler_file),
                "--name",
                f"worker-{i}",
                "--nworkers",
                "1",
                "--nthreads",
                str(threads),
                "--no-nanny",
                "--no-dashboard",
                "--host",
                HOST,
                "--memory-limit",
                memory_limit,
                "--local-directory",
                str(directory / f"worker-{i}"),
                # an orphaned worker (its scheduler killed) exits instead of waiting forever
                "--death-timeout",
                "60",
            ]
            if resources:
                cmd += ["--resources", resources]
            started.append(_popen(cmd, logs[-1], base))
        _wait_workers(address, started[1:], logs, deadline)
        cluster = Cluster(address, sched.pid, tuple(p.pid for p in started[1:]), str(directory), threads, resources)
        tmp = _state_path(directory).with_suffix(".tmp")
        tmp.write_text(json.dumps(asdict(cluster), indent=1))
        os.replace(tmp, _state_path(directory))
        return cluster
    except BaseException:
        for proc in reversed(started):
            terminate(proc.pid, grace=5.0)
        raise


def _shutdown(cluster: Cluster, grace: float) -> None:
    """Dask's own stop, through a running scheduler: it closes its workers, then itself."""
    from distributed import Client

    quiet = logging.getLogger("distributed")  # a scheduler closing under its client logs the lost connection
    level = quiet.level
    quiet.setLevel(logging.CRITICAL)
    try:
        with Client(cluster.address, timeout=f"{max(1.0, min(grace, 5.0)):.0f}s", set_as_default=False) as client:
            client.shutdown()
    except (OSError, TimeoutError):
        pass  # not answering: the pids below end what is left
    finally:
        quiet.setLevel(level)
    deadline = time.monotonic() + grace
    while time.monotonic() < deadline and any(alive(p) for p in cluster.pids):
        for pid in cluster.pids:
            _reap(pid)
        time.sleep(0.1)


def _reap(pid: int) -> None:
    try:
        os.waitpid(pid, os.WNOHANG)  # one that exited and is our child (started in this process): reap it
    except ChildProcessError:
        pass


def stop(directory: Path, grace: float = 10.0) -> Cluster | None:
    """Stop the recorded cluster: `Client.shutdown()` through its scheduler when that still runs, then by its
    pids (workers first) whatever is left; returns it, or None when none was recorded. A recorded pid that now
    belongs to another program is left alone."""
    directory = Path(directory).resolve()
    cluster = read_cluster(directory)
    if cluster is None:
        return None
    if alive(cluster.scheduler_pid) and _ours(cluster.scheduler_pid, directory):
        _shutdown(cluster, grace)
    for pid in cluster.pids:
        if alive(pid) and _ours(pid, directory):
            terminate(pid, grace)
        _reap(pid)  # one that died earlier (kill -9) and is our child
    _state_path(directory).unlink(missing_ok=True)
    (directory / "scheduler.json").unlink(missing_ok=True)
    return cluster
