"""A sandbox worker: a warm Python process that forks one isolated child per tool call.

Run as `python -m rollout_gen.sandbox_worker` by `rollout_gen.sandbox.SandboxPool`, never imported
by the pipeline process. Requests and replies are JSON lines on stdin/stdout. The worker itself
executes nothing it is sent; only the forked child does, after these layers go up:

- its own session/process group (killed whole on timeout) and a fresh temp working directory;
- rlimits: address space, CPU seconds, processes, file size, open files, no core dumps;
- a scrubbed environment; an audit hook that refuses sockets, subprocesses, forks, signals to
  other processes, ctypes, and file writes outside the temp directory;
- when the worker runs as root: a private network namespace (set up once per worker) and an
  unprivileged uid of its own, so the code cannot signal the worker or write the host's files.
"""
from __future__ import annotations

import ctypes
import json
import os
import resource
import shutil
import signal
import sys
import tempfile
import time
import traceback

# Warm imports the model's code commonly needs: the child inherits them already loaded.
import math, fractions, decimal, itertools, functools, collections, statistics, random, re, string  # noqa: E401,F401

CLONE_NEWNET = 0x40000000
SANDBOX_UID_BASE = 61000
SAFE_ENV = {"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8", "PYTHONIOENCODING": "utf-8", "HOME": "/nonexistent"}
BLOCKED_EVENTS = (
    "socket.__new__", "socket.connect", "socket.bind", "subprocess.Popen", "os.system", "os.exec",
    "os.posix_spawn", "os.spawn", "os.fork", "os.forkpty", "os.kill", "os.killpg", "pty.spawn",
    "ctypes.dlopen", "ctypes.dlsym", "ctypes.cdata", "os.chown", "os.chmod", "os.setuid", "shutil.rmtree",
)
WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_APPEND | os.O_TRUNC


def _private_network() -> bool:
    """Move this worker (and so every child) into an empty network namespace, if allowed."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return libc.unshare(CLONE_NEWNET) == 0
    except OSError:
        return False


def _world_traversable(path: str) -> bool:
    """Can an unprivileged uid read the interpreter's stdlib? (Not when Python lives under /root.)"""
    import stat

    path = os.path.realpath(path)
    parts = path.split(os.sep)
    for i in range(2, len(parts) + 1):
        mode = os.stat(os.sep.join(parts[:i]) or os.sep).st_mode
        if not mode & stat.S_IXOTH:
            return False
    return bool(os.stat(path).st_mode & stat.S_IROTH)


def _install_guard(workdir: str) -> None:
    root = os.path.realpath(workdir)

    def inside(path: object) -> bool:
        if isinstance(path, int):
            return True  # an already-open descriptor
        try:
            p = os.path.realpath(os.fsdecode(path))
        except (TypeError, ValueError):
            return False
        return p == root or p.startswith(root + os.sep)

    def hook(event: str, args: tuple) -> None:
        if event in BLOCKED_EVENTS:
            raise PermissionError(f"sandbox: {event} is not allowed")
        if event == "open":
            path, mode, flags = args
            writing = (isinstance(mode, str) and any(c in mode for c in "wax+")) or (
                isinstance(flags, int) and flags & WRITE_FLAGS
            )
            if writing and not inside(path):
                raise PermissionError(f"sandbox: writing {path!r} outside the working directory")
        elif event in ("os.remove", "os.rename", "os.mkdir", "os.rmdir", "os.symlink", "os.link", "os.truncate"):
            if not all(inside(a) for a in args if isinstance(a, (str, bytes, os.PathLike))):
                raise PermissionError(f"sandbox: {event} outside the working directory")

    sys.addaudithook(hook)


def _child(code: str, workdir: str, req: dict, uid: int | None) -> None:
    """Runs in the forked child; never returns."""
    try:
        os.setsid()
        out = os.open(os.path.join(workdir, "stdout"), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        err = os.open(os.path.join(workdir, "stderr"), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        os.dup2(out, 1)
        os.dup2(err, 2)
        devnull = os.open(os.devnull, os.O_RDONLY)
        os.dup2(devnull, 0)
        for fd in (out, err, devnull):
            os.close(fd)
        if uid is not None:
            for name in ("stdout", "stderr"):
                os.chown(os.path.join(workdir, name), uid, uid)
            os.chown(workdir, uid, uid)
            os.setgroups([])
            os.setgid(uid)
            os.setuid(uid)
        mem = int(req["memory_mb"]) * 2**20
        cpu = int(req["timeout_s"]) + 1
        for res, value in (
            (resource.RLIMIT_AS, mem), (resource.RLIMIT_CPU, cpu), (resource.RLIMIT_CORE, 0),
            (resource.RLIMIT_FSIZE, int(req["max_file_mb"]) * 2**20), (resource.RLIMIT_NOFILE, 64),
            (resource.RLIMIT_NPROC, int(req["max_processes"])),
        ):
            resource.setrlimit(res, (value, value))
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # over-size writes raise OSError instead
        os.chdir(workdir)
        os.environ.clear()
        os.environ.update(SAFE_ENV)
        sys.stdout = open(1, "w", encoding="utf-8", errors="replace", closefd=False)
        sys.stderr = open(2, "w", encoding="utf-8", errors="replace", closefd=False)
        sys.dont_write_bytecode = True
        for name in ("_posixsubprocess", "_ctypes"):  # no process spawning or FFI behind the audit hook's back
            sys.modules[name] = None  # type: ignore[assignment]
        _install_guard(workdir)
    except BaseException:  # the sandbox could not be built: say so on the real stderr channel
        traceback.print_exc()
        os._exit(121)
    status = 0
    try:
        compiled = compile(code, "<code>", "exec")
        exec(compiled, {"__name__": "__main__", "__builtins__": __builtins__})
    except SystemExit as e:
        status = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    except BaseException as e:
        tb = e.__traceback__
        while tb is not None and tb.tb_frame.f_code.co_filename != "<code>":
            tb = tb.tb_next  # hide the worker's own frames
        sys.stderr.write("".join(traceback.format_exception(type(e), e, tb)))
        status = 1
    try:
        sys.stdout.flush()
        sys.stderr.flush()
    finally:
        os._exit(status)


def _read_head(path: str, limit: int) -> tuple[str, int]:
    try:
        with open(path, "rb") as f:
            data = f.read(limit * 4 + 4)
        size = os.path.getsize(path)
    except OSError:
        return "", 0
    return data.decode("utf-8", errors="replace")[:limit], size


def _kill_uid(uid: int) -> None:
    """Kill every process left running under this worker's sandbox uid (escaped process groups)."""
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            if os.stat(f"/proc/{pid}").st_uid == uid:
                os.kill(int(pid), signal.SIGKILL)
        except (OSError, ProcessLookupError):
            pass


def run_one(req: dict, base: str, uid: int | None) -> dict:
    workdir = tempfile.mkdtemp(dir=base)
    start = time.monotonic()
    pid = os.fork()
    if pid == 0:
        _child(req["code"], workdir, req, uid)
    deadline = start + float(req["timeout_s"])
    timed_out, status = False, None
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            break
        if time.monotonic() >= deadline:
            timed_out = True
            try:
                os.killpg(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            _, status = os.waitpid(pid, 0)
            break
        time.sleep(0.0005 if time.monotonic() - start < 0.05 else 0.005)
    duration = time.monotonic() - start
    try:
        os.killpg(pid, signal.SIGKILL)  # stragglers the code left in its group
    except (ProcessLookupError, PermissionError):
        pass
    if uid is not None:
        _kill_uid(uid)
    limit = int(req["output_chars"])
    stdout, out_size = _read_head(os.path.join(workdir, "stdout"), limit)
    stderr, err_size = _read_head(os.path.join(workdir, "stderr"), limit)
    shutil.rmtree(workdir, ignore_errors=True)
    exit_code = os.waitstatus_to_exitcode(status) if status is not None else None
    return {
        "id": req.get("id"), "stdout": stdout, "stderr": stderr, "stdout_bytes": out_size, "stderr_bytes": err_size,
        "exit_code": exit_code, "timed_out": timed_out, "duration_s": duration, "setup_failed": exit_code == 121,
    }


def main() -> None:
    worker_idx = int(sys.argv[1]) if len(sys.argv) > 1 else 0
    isolated_net = _private_network()
    # A uid of its own only where that uid can still read the stdlib; otherwise the audit hook and
    # rlimits are the fence (RLIMIT_NPROC does not bind root, so forking is refused by the hook).
    separate_uid = os.geteuid() == 0 and _world_traversable(os.path.dirname(os.__file__))
    uid = SANDBOX_UID_BASE + worker_idx if separate_uid else None
    base = tempfile.mkdtemp(prefix=f"cleaner-sandbox-{worker_idx}-")
    os.chmod(base, 0o711)
    out = sys.stdout
    out.write(json.dumps({"ready": True, "pid": os.getpid(), "network_isolated": isolated_net,
                          "uid": uid}) + "\n")
    out.flush()
    try:
        for line in sys.stdin:
            if not line.strip():
                continue
            try:
                reply = run_one(json.loads(line), base, uid)
            except Exception as e:  # the worker's own failure: reported as infra, not the model's
                reply = {"internal_error": f"{type(e).__name__}: {e}"}
            out.write(json.dumps(reply) + "\n")
            out.flush()
    finally:
        shutil.rmtree(base, ignore_errors=True)


if __name__ == "__main__":
    main()
