"""A sandbox worker: a warm Python process that forks one isolated child per tool call.

Run as a script by `rollout_gen.sandbox.SandboxPool`, never imported by the pipeline process. Requests
and replies are JSON lines on stdin/stdout. The worker executes nothing it is sent; only the code
process of a call does, behind these layers (each put up where the kernel allows; what was put up is
reported in the worker's first line and logged by the pool when something is missing):

Per worker, once (kernel-enforced):
- private mount, network, IPC and UTS namespaces (plus a user namespace when not root): no network;
  the whole filesystem is remounted read-only; the user's home directory is covered by an empty
  tmpfs, with only the interpreter's own directories bound back (read-only) so an unprivileged uid
  can import the stdlib even when Python lives under /root; call directories live on a small tmpfs.
- the worker is a child subreaper: whatever a call leaves running is re-parented to it and killed.
- a pid namespace whose init (pid 1, with a /proc showing that namespace only) serves every call and,
  after each, kills everything else left in it, whatever its uid.

Per call: init forks the call process (own session, killed whole on timeout), which, before running
anything it was sent:
- switches to an unprivileged uid of its own (when the worker is root of the initial user namespace),
  drops every capability and sets no_new_privs;
- applies rlimits (address space, CPU seconds, processes, file size, open files, no core) and a
  scrubbed environment;
- loads a seccomp filter (libseccomp through `pyseccomp`) refusing exec, fork (threads stay allowed),
  signals to other processes, pidfd, ptrace, mknod, mount and namespace calls, uid changes, sockets,
  and other kernel attack surface;
- installs an audit hook (a second, Python-level layer that gives readable errors).
"""

from __future__ import annotations

import ctypes
import errno
import json
import os
import pwd
import resource
import select
import shutil
import signal
import stat
import sys
import tempfile
import time
import traceback
from contextlib import suppress

# Warm imports the model's code commonly needs: the child inherits them already loaded. unittest.mock holds the
# stand-ins the LiveCodeBench scorer runs a program with (rollout_gen/lcb.py): 60 ms a program to import cold.
import math, fractions, decimal, itertools, functools, collections, statistics, random, re, string  # noqa: E401,F401
import ast, unittest.mock  # noqa: E401,F401

try:  # a ctypes binding to the system's libseccomp (same API as libseccomp's own Python binding)
    import pyseccomp as seccomp
except (ImportError, OSError, RuntimeError):  # no binding or no libseccomp.so.2: degrade, reported
    seccomp = None

CLONE_THREAD = 0x00010000
CLONE_NEWNS, CLONE_NEWUTS, CLONE_NEWIPC = 0x00020000, 0x04000000, 0x08000000
CLONE_NEWUSER, CLONE_NEWPID, CLONE_NEWNET = 0x10000000, 0x20000000, 0x40000000
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC = 0x1, 0x2, 0x4, 0x8
MS_BIND, MS_REC, MS_PRIVATE = 0x1000, 0x4000, 0x40000
PR_SET_PDEATHSIG, PR_SET_DUMPABLE, PR_SET_CHILD_SUBREAPER, PR_SET_NO_NEW_PRIVS = 1, 4, 36, 38
PR_SET_SECCOMP, SECCOMP_MODE_FILTER = 22, 2
SYS_MOUNT_SETATTR, AT_FDCWD, AT_RECURSIVE, MOUNT_ATTR_RDONLY = 442, -100, 0x8000, 0x1
LINUX_CAPABILITY_VERSION_3 = 0x20080522

SANDBOX_UID_BASE = 61000
SAFE_ENV = {"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8", "PYTHONIOENCODING": "utf-8", "HOME": "/nonexistent"}
BLOCKED_EVENTS = frozenset(
    {
        "socket.__new__",
        "socket.connect",
        "socket.bind",
        "subprocess.Popen",
        "os.system",
        "os.exec",
        "os.posix_spawn",
        "os.spawn",
        "os.fork",
        "os.forkpty",
        "os.kill",
        "os.killpg",
        "pty.spawn",
        "ctypes.dlopen",
        "ctypes.dlsym",
        "ctypes.cdata",
        "os.chown",
        "os.chmod",
        "os.setuid",
        "shutil.rmtree",
        "os.mknod",
        "os.mkfifo",
    }
)
PATH_EVENTS = frozenset(
    {
        "os.remove",
        "os.rename",
        "os.mkdir",
        "os.rmdir",
        "os.symlink",
        "os.link",
        "os.truncate",
        "os.utime",
        "os.chflags",
        "os.lchflags",
    }
)
WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_APPEND | os.O_TRUNC
# Refused outright in the code process (EPERM). Namespaces and the uid already stop most of these;
# the filter is what still holds where they could not be set up.
DENIED_SYSCALLS = (
    "execve",
    "execveat",
    "fork",
    "vfork",
    "ptrace",
    "process_vm_readv",
    "process_vm_writev",
    "process_madvise",
    "kcmp",
    "pidfd_open",
    "pidfd_getfd",
    "pidfd_send_signal",
    "tkill",
    "mknod",
    "mknodat",
    "mount",
    "umount2",
    "pivot_root",
    "chroot",
    "unshare",
    "setns",
    "mount_setattr",
    "open_tree",
    "move_mount",
    "fsopen",
    "fsconfig",
    "fsmount",
    "fspick",
    "setuid",
    "setgid",
    "setreuid",
    "setregid",
    "setresuid",
    "setresgid",
    "setfsuid",
    "setfsgid",
    "setgroups",
    "capset",
    "chown",
    "fchown",
    "lchown",
    "fchownat",
    "socket",
    "keyctl",
    "add_key",
    "request_key",
    "bpf",
    "perf_event_open",
    "userfaultfd",
    "io_uring_setup",
    "io_uring_enter",
    "io_uring_register",
    "open_by_handle_at",
    "name_to_handle_at",
    "init_module",
    "finit_module",
    "delete_module",
    "kexec_load",
    "kexec_file_load",
    "reboot",
    "swapon",
    "swapoff",
    "acct",
    "settimeofday",
    "clock_settime",
    "clock_adjtime",
    "adjtimex",
    "sethostname",
    "setdomainname",
    "syslog",
    "quotactl",
    "iopl",
    "ioperm",
    "personality",
)
# Signals only to the code process itself (arg 0 is the target pid / thread group).
SELF_SIGNAL_SYSCALLS = ("kill", "tgkill", "rt_sigqueueinfo", "rt_tgsigqueueinfo")
# Only refused where no read-only filesystem covers them (timestamps cannot be path-filtered).
UTIME_SYSCALLS = ("utime", "utimes", "utimensat", "futimesat")

libc = ctypes.CDLL(None, use_errno=True)


def _check(rc: int, what: str) -> None:
    if rc != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{what}: {os.strerror(err)}")


def _prctl(option: int, value: int) -> None:
    _check(libc.prctl(option, ctypes.c_ulong(value), 0, 0, 0), f"prctl({option})")


def _mount(source: str | None, target: str, fstype: str | None, flags: int, data: str | None = None) -> None:
    enc = lambda s: None if s is None else s.encode()  # noqa: E731
    _check(libc.mount(enc(source), enc(target), enc(fstype), ctypes.c_ulong(flags), enc(data)), f"mount {target}")


# ---------------------------------------------------------------------------------------------------
# Per-worker set-up
# ---------------------------------------------------------------------------------------------------


def _initial_root() -> bool:
    """Root of the initial user namespace (may switch to any uid)? Root inside a container's user
    namespace is not: it takes the unprivileged path."""
    if os.geteuid() != 0:
        return False
    try:
        with open("/proc/self/uid_map") as f:
            return f.read().split()[:3] == ["0", "0", "4294967295"]
    except OSError:
        return False


def _enter_worker_namespaces(root: bool) -> None:
    flags = CLONE_NEWNS | CLONE_NEWNET | CLONE_NEWIPC | CLONE_NEWUTS
    uid, gid = os.geteuid(), os.getegid()
    # Not root: a user namespace grants the capabilities to build mounts, mapping our own ids only.
    _check(libc.unshare(flags if root else flags | CLONE_NEWUSER), "unshare")
    if not root:
        for name, text in (("setgroups", "deny"), ("uid_map", f"{uid} {uid} 1"), ("gid_map", f"{gid} {gid} 1")):
            with open(f"/proc/self/{name}", "w") as f:
                f.write(text)


def _needed_under(home: str) -> list[str]:
    """The interpreter's directories (stdlib, lib-dynload, site-packages) that lie under `home`."""
    cands = {
        os.path.realpath(p)
        for p in (sys.prefix, sys.base_prefix, sys.exec_prefix, sys.base_exec_prefix, *sys.path)
        if p and os.path.isdir(p)
    }
    inside = [p for p in cands if p.startswith(home + os.sep)]
    return sorted(p for p in inside if not any(p.startswith(q + os.sep) for q in inside))


def _hide_home() -> None:
    """Cover the user's home with an empty tmpfs and bind back only the interpreter's directories:
    the sandbox sees no keys or tokens there, and an unprivileged uid can reach the stdlib even when
    the home is 0700 (Python under /root/.pyenv)."""
    try:
        home = os.path.realpath(pwd.getpwuid(os.geteuid()).pw_dir)
    except KeyError:
        return
    if home == "/" or not os.path.isdir(home):
        return
    keep = _needed_under(home)
    fds = [os.open(p, os.O_PATH | os.O_DIRECTORY) for p in keep]  # reach the originals once covered
    _mount("tmpfs", home, "tmpfs", MS_NOSUID | MS_NODEV, "size=1m,mode=0755")
    for path, fd in zip(keep, fds):
        os.makedirs(path, mode=0o755, exist_ok=True)
        _mount(f"/proc/self/fd/{fd}", path, None, MS_BIND | MS_REC)
        os.close(fd)


class _MountAttr(ctypes.Structure):
    _fields_ = [
        ("attr_set", ctypes.c_uint64),
        ("attr_clr", ctypes.c_uint64),
        ("propagation", ctypes.c_uint64),
        ("userns_fd", ctypes.c_uint64),
    ]


def _all_read_only() -> None:
    attr = _MountAttr(MOUNT_ATTR_RDONLY, 0, 0, 0)
    _check(
        libc.syscall(
            ctypes.c_long(SYS_MOUNT_SETATTR),
            AT_FDCWD,
            b"/",
            AT_RECURSIVE,
            ctypes.byref(attr),
            ctypes.c_size_t(ctypes.sizeof(attr)),
        ),
        "mount_setattr / read-only",
    )


def _build_filesystem(base: str, tmpfs_mb: int) -> None:
    _mount(None, "/", None, MS_REC | MS_PRIVATE)  # nothing mounted here propagates to the host
    _hide_home()
    _all_read_only()
    # The only writable place: call directories, on a tmpfs that caps their total size.
    _mount("tmpfs", base, "tmpfs", MS_NOSUID | MS_NODEV, f"size={tmpfs_mb}m,mode=0711")


def _world_traversable(path: str) -> bool:
    """Can an unprivileged uid read the interpreter's stdlib?"""
    parts = os.path.realpath(path).split(os.sep)
    for i in range(2, len(parts) + 1):
        if not os.stat(os.sep.join(parts[:i]) or os.sep).st_mode & stat.S_IXOTH:
            return False
    return bool(os.stat(path).st_mode & stat.S_IROTH)


def set_up_worker(idx: int, layers: dict, tmpfs_mb: int) -> tuple[str, dict]:
    """Build what every call of this worker shares; return (call base directory, isolation report)."""
    os.umask(0o022)
    _prctl(PR_SET_CHILD_SUBREAPER, 1)  # orphans of every call come back here to be killed
    base = tempfile.mkdtemp(prefix=f"cleaner-sandbox-{idx}-")
    os.chmod(base, 0o711)
    root = _initial_root()
    iso = {
        "pid": os.getpid(),
        "base": base,
        "root": root,
        "namespaces": False,
        "network_isolated": False,
        "readonly_fs": False,
        "pid_namespace": False,
        "uid": None,
        "seccomp": False,
        "audit_hook": bool(layers.get("audit_hook", True)),
        "degraded": [],
    }
    if not layers.get("namespaces", True):
        iso["degraded"].append("no namespaces (switched off): network, filesystem and pids are the host's")
    else:
        try:
            _enter_worker_namespaces(root)
            iso["namespaces"] = iso["network_isolated"] = True
        except OSError as e:
            iso["degraded"].append(f"no namespaces ({e}): network, filesystem and pids are the host's")
            if root and libc.unshare(CLONE_NEWNET) == 0:  # at least keep the network away
                iso["network_isolated"] = True
    if iso["namespaces"]:
        try:
            _build_filesystem(base, tmpfs_mb)
            iso["readonly_fs"] = True
        except OSError as e:
            iso["degraded"].append(f"no read-only filesystem ({e})")
    if not layers.get("separate_uid", True):
        iso["degraded"].append("no separate uid (switched off)")
    elif root and _world_traversable(os.path.dirname(os.__file__)):
        iso["uid"] = SANDBOX_UID_BASE + idx
    elif root:
        iso["degraded"].append("no separate uid: the interpreter is not reachable by another uid")
    else:
        iso["degraded"].append("no separate uid (not root): the code keeps the pipeline's uid, without capabilities")
    if not layers.get("seccomp", True):
        iso["degraded"].append("no seccomp filter (switched off)")
    elif seccomp is None:
        iso["degraded"].append("no seccomp filter: the pyseccomp binding or libseccomp.so.2 is missing")
    else:
        iso["seccomp"] = True
    if iso["namespaces"]:
        _enter_pid_namespace(iso)  # from here on, this process is the namespace's init
    if iso["seccomp"] and iso["pid_namespace"]:
        iso["bpf"] = _compile_seccomp(readonly_fs=iso["readonly_fs"], self_pid=None).hex()
    return base, iso


def _enter_pid_namespace(iso: dict) -> None:
    """Fork this worker's init: pid 1 of a new pid namespace, with a /proc showing that namespace only.
    It serves every call; the original process just waits for it (and takes it down if killed, by
    PDEATHSIG). Between calls, init kills everything else in its namespace: no uid needed for that."""
    if libc.unshare(CLONE_NEWPID) != 0:
        iso["degraded"].append(
            f"no pid namespace ({os.strerror(ctypes.get_errno())}): calls see the host's "
            "processes; leftovers are found as re-parented children"
        )
        return
    init = os.fork()
    if init:
        for fd in (0, 1):  # the pool talks to init alone: its end of the pipes closes when init dies
            os.close(fd)
        _, status = os.waitpid(init, 0)
        os._exit(os.waitstatus_to_exitcode(status) & 0xFF)
    _prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    _prctl(PR_SET_DUMPABLE, 0)  # its memory and /proc entries stay closed to the code
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, signal.SIG_DFL)  # no handler: the kernel drops every signal the code sends init
    iso["pid_namespace"] = True
    try:
        _check(libc.unshare(CLONE_NEWNS), "unshare(mount)")  # this /proc is for the namespace only
        _mount("proc", "/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC | MS_RDONLY)
    except OSError as e:
        iso["degraded"].append(f"no private /proc ({e}): the host's processes are listed, not reachable")


# ---------------------------------------------------------------------------------------------------
# Per-call processes
# ---------------------------------------------------------------------------------------------------


class _CapHeader(ctypes.Structure):
    _fields_ = [("version", ctypes.c_uint32), ("pid", ctypes.c_int)]


class _CapData(ctypes.Structure):
    _fields_ = [("effective", ctypes.c_uint32), ("permitted", ctypes.c_uint32), ("inheritable", ctypes.c_uint32)]


def _drop_capabilities() -> None:
    """No capability in any namespace: matters where the code keeps uid 0 or sits in our user namespace."""
    data = (_CapData * 2)()
    _check(libc.capset(ctypes.byref(_CapHeader(LINUX_CAPABILITY_VERSION_3, 0)), data), "capset")


def _compile_seccomp(readonly_fs: bool, self_pid: int | None) -> bytes:
    """The filter as BPF bytes; compiled once per worker (milliseconds), loaded per call (microseconds).
    `self_pid`: restrict signals to that process (needed only without a pid namespace, where the
    code could otherwise reach the host's processes of its uid)."""
    f = seccomp.SyscallFilter(defaction=seccomp.ALLOW)
    deny = seccomp.ERRNO(errno.EPERM)
    for name in DENIED_SYSCALLS + (() if readonly_fs else UTIME_SYSCALLS):
        try:
            f.add_rule(deny, name)
        except (ValueError, OSError):  # not a syscall on this architecture
            pass
    # glibc creates threads with clone3, whose flags live in memory a filter cannot read: make it
    # report ENOSYS so glibc falls back to clone, where a new process (no CLONE_THREAD) is refused.
    f.add_rule(seccomp.ERRNO(errno.ENOSYS), "clone3")
    f.add_rule(deny, "clone", seccomp.Arg(0, seccomp.MASKED_EQ, CLONE_THREAD, 0))
    if self_pid is not None:
        for name in SELF_SIGNAL_SYSCALLS:
            f.add_rule(deny, name, seccomp.Arg(0, seccomp.NE, self_pid))
    fd = os.memfd_create("seccomp-bpf")
    try:
        with os.fdopen(os.dup(fd), "wb") as tmp:
            f.export_bpf(tmp)
        return os.pread(fd, 1 << 20, 0)
    finally:
        os.close(fd)


class _SockFprog(ctypes.Structure):
    _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.c_void_p)]


def _load_bpf(program: bytes) -> None:
    """Install a compiled filter (no_new_privs must be set): from then on it binds this process."""
    buf = ctypes.create_string_buffer(program, len(program))
    prog = _SockFprog(len(program) // 8, ctypes.addressof(buf))
    _check(libc.prctl(PR_SET_SECCOMP, SECCOMP_MODE_FILTER, ctypes.byref(prog), 0, 0), "seccomp filter")


def _install_guard(workdir: str) -> None:
    """The Python-level second layer: readable refusals. Everything it uses is bound here, so code
    that patches module globals (os.path.realpath, the worker's constants) does not change it."""
    root = os.path.realpath(workdir)
    realpath, fsdecode, readlink, join, devnull = os.path.realpath, os.fsdecode, os.readlink, os.path.join, os.devnull
    blocked, path_events, write_flags, error = BLOCKED_EVENTS, PATH_EVENTS, WRITE_FLAGS, PermissionError

    def inside(path: object, dir_fd: object = None) -> bool:
        if isinstance(path, int):
            return True  # an already-open descriptor
        try:
            p = fsdecode(path)
            if dir_fd is not None and not p.startswith("/"):
                p = join(readlink(f"/proc/self/fd/{int(dir_fd)}"), p)
            p = realpath(p)
        except (TypeError, ValueError, OSError):
            return False
        return p == root or p.startswith(root + "/")

    def hook(event: str, args: tuple) -> None:
        if event in blocked:
            raise error(f"sandbox: {event} is not allowed")
        if event == "open":
            path, mode, flags = args
            writing = (isinstance(mode, str) and any(c in mode for c in "wax+")) or (
                isinstance(flags, int) and flags & write_flags
            )
            if writing and not inside(path) and path != devnull:  # /dev/null discards; a scorer points fd 1 there
                raise error(f"sandbox: writing {path!r} outside the working directory")
        elif event in path_events:
            if event == "os.rename":  # (src, dst, src_dir_fd, dst_dir_fd)
                ok = inside(args[0], args[2]) and inside(args[1], args[3])
            elif event in ("os.symlink", "os.link"):  # (src, dst, [src_dir_fd,] dst_dir_fd): the new name counts
                ok = inside(args[1], args[-1])
            else:  # (path, ..., dir_fd)
                ok = inside(args[0], args[-1] if len(args) > 1 and isinstance(args[-1], int) else None)
            if not ok:
                raise error(f"sandbox: {event} outside the working directory")

    sys.addaudithook(hook)


def _report(fd: int, message: str) -> None:
    os.write(fd, (message.replace("\n", " ")[:2000] + "\n").encode())


def _call_process(workdir: str, req: dict, iso: dict, report_fd: int) -> None:
    """Forked by init (or, degraded, by the worker) for one call: runs the model's code; never returns.
    Every layer goes up before the code is compiled."""
    try:
        os.setsid()  # its own group: killed whole on timeout
        _prctl(PR_SET_PDEATHSIG, signal.SIGKILL)  # a killed worker takes its call with it
        outputs = [os.path.join(workdir, "stdout"), os.path.join(workdir, "stderr")]
        new_file = os.O_WRONLY | os.O_CREAT | os.O_TRUNC
        for path, flags, target in ((outputs[0], new_file, 1), (outputs[1], new_file, 2), (os.devnull, os.O_RDONLY, 0)):
            fd = os.open(path, flags, 0o600)
            os.dup2(fd, target)
            os.close(fd)
        uid = iso["uid"]
        if uid is not None:
            for path in (workdir, *outputs):
                os.chown(path, uid, uid)
        mem = int(req["memory_mb"]) * 2**20
        for res, value in (
            (resource.RLIMIT_AS, mem),
            (resource.RLIMIT_CPU, int(req["timeout_s"]) + 1),
            (resource.RLIMIT_CORE, 0),
            (resource.RLIMIT_FSIZE, int(req["max_file_mb"]) * 2**20),
            (resource.RLIMIT_NOFILE, 64),
            (resource.RLIMIT_NPROC, int(req["max_processes"])),
        ):
            resource.setrlimit(res, (value, value))
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # over-size writes raise OSError instead
        os.chdir(workdir)
        os.environ.clear()
        os.environ.update(SAFE_ENV, TMPDIR=workdir)
        tempfile.tempdir = workdir  # the worker's cached choice (/tmp) is read-only here
        if uid is not None:
            os.setgroups([])
            os.setgid(uid)
            os.setuid(uid)
        _prctl(PR_SET_PDEATHSIG, signal.SIGKILL)  # again: setuid clears it
        _prctl(PR_SET_NO_NEW_PRIVS, 1)
        _drop_capabilities()
        if iso["seccomp"]:
            bpf = iso.get("bpf")
            _load_bpf(bytes.fromhex(bpf) if bpf else _compile_seccomp(iso["readonly_fs"], os.getpid()))
        sys.stdout, sys.stderr = (open(fd, "w", encoding="utf-8", errors="replace", closefd=False) for fd in (1, 2))
        sys.dont_write_bytecode = True
        for name in ("_posixsubprocess", "_ctypes"):  # readable refusals; the filter is the real fence
            sys.modules[name] = None  # type: ignore[assignment]
        _report(report_fd, "ready")
        os.close(report_fd)
        if iso["audit_hook"]:
            _install_guard(workdir)
    except BaseException as e:  # the sandbox could not be built: infrastructure
        try:
            _report(report_fd, f"setup-failed {type(e).__name__}: {e}")
        finally:
            os._exit(121)
    status = 0
    try:
        compiled = compile(req["code"], "<code>", "exec")
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


def _children() -> list[int]:
    me = os.getpid()
    try:
        with open(f"/proc/{me}/task/{me}/children") as f:
            return [int(p) for p in f.read().split()]
    except OSError:  # kernels without CONFIG_PROC_CHILDREN: scan every process
        kids = []
        for name in os.listdir("/proc"):
            try:
                with open(f"/proc/{name}/stat") as f:
                    if int(f.read().rsplit(")", 1)[1].split()[1]) == me:
                        kids.append(int(name))
            except (OSError, ValueError, IndexError):
                pass
        return kids


def kill_leftovers(pid_namespace: bool) -> None:
    """Kill and reap every process the call left behind, whatever its uid and however it detached.
    As pid 1 of the call namespace, kill(-1) reaches exactly the namespace's other processes. Without
    one, the worker is a child subreaper with no children of its own between calls, so whatever is
    still running is a child here (each round's kills re-parent the next generation)."""
    for _ in range(100):
        if pid_namespace:
            with suppress(ProcessLookupError):
                os.kill(-1, signal.SIGKILL)
            kids = []
            with suppress(ChildProcessError):
                while True:
                    kids.append(os.waitpid(-1, 0)[0])
        else:
            kids = _children()
            for pid in kids:
                with suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            for pid in kids:
                with suppress(ChildProcessError):
                    os.waitpid(pid, 0)
        if not kids:
            return


def _read_reports(fd: int) -> list[str]:
    chunks = []
    while select.select([fd], [], [], 2.0)[0]:
        data = os.read(fd, 65536)
        if not data:
            break
        chunks.append(data)
    os.close(fd)
    return b"".join(chunks).decode(errors="replace").splitlines()


def _read_head(path: str, limit: int) -> tuple[str, int]:
    try:
        with open(path, "rb") as f:
            data = f.read(limit * 4 + 4)
        size = os.path.getsize(path)
    except OSError:
        return "", 0
    return data.decode("utf-8", errors="replace")[:limit], size


def _read_ends(path: str, limit: int) -> tuple[str, int]:
    """Standard error's head and tail when it is longer than `limit` characters: an error's last line (what names
    it, and what its label is read from) is at the end of a long traceback, which the head alone cut off."""
    text, size = _read_head(path, limit)
    if size <= len(text.encode()):
        return text, size
    half = limit // 2
    try:
        with open(path, "rb") as f:
            f.seek(max(0, size - (limit - half) * 4 - 4))
            tail = f.read().decode("utf-8", errors="replace")[-(limit - half) :]
    except OSError:
        return text, size
    return text[:half] + "\n[…]\n" + tail, size


def _remove_tree(path: str) -> None:
    """Remove a call directory; the code may have left it unreadable to root-less traversal (chmod 000)."""
    for dirpath, dirnames, _ in os.walk(path):
        for d in dirnames:
            with suppress(OSError):
                os.chmod(os.path.join(dirpath, d), 0o700)
    shutil.rmtree(path, ignore_errors=True)


def run_one(req: dict, base: str, iso: dict) -> dict:
    workdir = tempfile.mkdtemp(dir=base)
    report_r, report_w = os.pipe()
    start = time.monotonic()
    pid = os.fork()
    if pid == 0:
        os.close(report_r)
        _call_process(workdir, req, iso, report_w)
    os.close(report_w)
    deadline = start + float(req["timeout_s"])
    timed_out = False
    while True:
        done, status = os.waitpid(pid, 0 if timed_out else os.WNOHANG)  # blocks once the call is killed
        if done:
            break
        if time.monotonic() >= deadline:
            timed_out = True
            with suppress(ProcessLookupError):
                os.killpg(pid, signal.SIGKILL)
        else:
            time.sleep(0.0005 if time.monotonic() - start < 0.05 else 0.005)
    duration = time.monotonic() - start
    with suppress(ProcessLookupError, PermissionError):
        os.killpg(pid, signal.SIGKILL)  # stragglers the code left in its group
    kill_leftovers(iso["pid_namespace"])
    reports = _read_reports(report_r)
    exit_code = os.waitstatus_to_exitcode(status)
    setup_failed = "ready" not in reports  # the code never ran: not the model's doing, even on timeout
    limit = int(req["output_chars"])
    stdout, out_size = _read_head(os.path.join(workdir, "stdout"), limit)
    stderr, err_size = _read_ends(os.path.join(workdir, "stderr"), limit)
    _remove_tree(workdir)
    reply = {
        "id": req.get("id"),
        "stdout": stdout,
        "stderr": stderr,
        "stdout_bytes": out_size,
        "stderr_bytes": err_size,
        "exit_code": exit_code,
        "timed_out": timed_out,
        "duration_s": duration,
        "setup_failed": setup_failed,
    }
    if setup_failed:
        reply["setup_error"] = next((r for r in reports if r.startswith("setup-failed")), "no report from the call")
    return reply


def main() -> None:
    worker_idx, options = int(sys.argv[1]), json.loads(sys.argv[2])  # as SandboxPool starts it
    base, iso = set_up_worker(worker_idx, options["layers"], int(options["tmpfs_mb"]))
    print(json.dumps({"ready": True, **{k: v for k, v in iso.items() if k != "bpf"}}), flush=True)
    for line in sys.stdin:
        if not line.strip():
            continue
        try:
            reply = run_one(json.loads(line), base, iso)
        except Exception as e:  # the worker's own failure: reported as infra, not the model's
            reply = {"internal_error": f"{type(e).__name__}: {e}"}
        print(json.dumps(reply), flush=True)
    # The pool removes `base` once this process is gone: in our mount namespace it is a mount point.


if __name__ == "__main__":
    main()
