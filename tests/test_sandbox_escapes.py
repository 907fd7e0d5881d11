"""Escapes from the sandbox, tried as root: each class is contained by the kernel, not by Python.

Every attack runs twice: with every layer (what the pipeline uses) and with the audit hook switched
off (`kernel` pools), so the kernel layers are shown to hold on their own. Targets outside the
sandbox are world-writable, so only the sandbox (not the uid alone) can keep them intact.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from pipeline.config import SandboxConfig
import rollout_gen.sandbox as sandbox_module
from rollout_gen.sandbox import Layers, SandboxPool

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="the escapes are tried as root, as CI runs")
REPO = Path(__file__).resolve().parents[1]
CFG = SandboxConfig(workers=1, timeout_s=3.0)
# Gets the process-spawning extension back behind the audit hook's sys.modules block, then spawns.
SPAWN = """
import os, sys
sys.modules.pop('_posixsubprocess', None)
import _posixsubprocess
r, w = os.pipe()
pid = _posixsubprocess.fork_exec([b'/bin/sh', b'-c', CMD.encode(), TAG.encode()], [b'/bin/sh'], True, (w,),
    None, None, -1, -1, -1, -1, -1, -1, r, w, True, True, -1, None, None, None, -1, None, False)
os.close(w)
os.read(r, 64)  # end of file once the child has exec'd (the pipe is close-on-exec)
print('spawned', pid)
"""

DISARM = """
import os, sys
import __main__
__main__.BLOCKED_EVENTS = ()  # the audit hook reads these names at call time...
__main__.PATH_EVENTS = ()
root = os.getcwd()
os.path.realpath = lambda p: root  # ...and decides 'inside' with a function the code can replace
"""


@pytest.fixture(scope="module", params=["all-layers", "kernel-only"])
def pool(request):
    layers = Layers() if request.param == "all-layers" else Layers(audit_hook=False)
    with SandboxPool(CFG, layers) as p:
        yield p


@pytest.fixture
def outside(tmp_path):
    """A world-writable directory outside the sandbox holding a world-writable victim file."""
    tmp_path.chmod(0o777)
    victim = tmp_path / "victim.txt"
    victim.write_text("intact")
    victim.chmod(0o666)
    os.utime(victim, (1_000_000, 1_000_000))
    return tmp_path


def run(pool: SandboxPool, code: str, **names: object):
    """Run `code` with `NAME = value` lines for each keyword in front of it."""
    prelude = "".join(f"{k} = {v!r}\n" for k, v in names.items())
    return pool.run(prelude + code)


def processes_with(tag: str) -> list[int]:
    pids = []
    for name in os.listdir("/proc"):
        try:
            if tag.encode() in Path(f"/proc/{name}/cmdline").read_bytes():
                pids.append(int(name))
        except (OSError, ValueError):
            pass
    return pids


def kill_tagged(tag: str) -> None:
    for pid in processes_with(tag):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def assert_serves(pool: SandboxPool) -> None:
    r = pool.run("print(6 * 7)")
    assert (r.status, r.text) == ("success", "Tool call success\nstdout: 42\n")


def test_dir_fd_writes_deletes_and_renames_stay_inside(pool, outside):
    code = """
import os
fd = os.open(OUT, os.O_RDONLY)
attempts = {
    'create': lambda: os.close(os.open('created.txt', os.O_WRONLY | os.O_CREAT, 0o666, dir_fd=fd)),
    'truncate': lambda: os.close(os.open('victim.txt', os.O_WRONLY | os.O_TRUNC, dir_fd=fd)),
    'delete': lambda: os.unlink('victim.txt', dir_fd=fd),
    'rename': lambda: os.rename('victim.txt', 'renamed.txt', src_dir_fd=fd, dst_dir_fd=fd),
    'mkdir': lambda: os.mkdir('made', dir_fd=fd),
    'symlink': lambda: os.symlink('/etc/passwd', 'link', dir_fd=fd),
}
open('local.txt', 'w').write('planted')
attempts['plant'] = lambda: os.rename('local.txt', 'planted.txt', dst_dir_fd=fd)
for name, attempt in attempts.items():
    try:
        attempt()
        print(name, 'done')
    except OSError as e:
        print(name, 'refused', type(e).__name__)
"""
    r = run(pool, code, OUT=str(outside))
    assert r.error_class != "infra"
    assert sorted(p.name for p in outside.iterdir()) == ["victim.txt"], r.text
    assert (outside / "victim.txt").read_text() == "intact"
    assert_serves(pool)


def test_spawning_through_a_reimported_posixsubprocess_is_refused(pool, outside):
    tag = f"cleaner-escape-{uuid.uuid4().hex}"
    marker = outside / "marker"
    try:
        r = run(pool, SPAWN + "import time\ntime.sleep(1)\n", CMD=f"echo pwned > {marker}; sleep 30; :", TAG=tag)
        assert r.error_class != "infra"
        assert not marker.exists(), "a shell ran"
        assert processes_with(tag) == [], "a daemon was left behind"
    finally:
        kill_tagged(tag)
    assert_serves(pool)


def test_mknod_mkfifo_and_utime_outside_are_refused(pool, outside):
    code = """
import os, stat
for name, attempt in {
    'mkfifo': lambda: os.mkfifo(os.path.join(OUT, 'fifo')),
    'mknod-file': lambda: os.mknod(os.path.join(OUT, 'node'), stat.S_IFREG | 0o666),
    'mknod-device': lambda: os.mknod(os.path.join(OUT, 'null'), stat.S_IFCHR | 0o666, os.makedev(1, 3)),
    'utime': lambda: os.utime(os.path.join(OUT, 'victim.txt'), (2_000_000, 2_000_000)),
    'utime-now': lambda: os.utime(os.path.join(OUT, 'victim.txt')),
}.items():
    try:
        attempt()
        print(name, 'done')
    except OSError as e:
        print(name, 'refused', type(e).__name__)
"""
    r = run(pool, code, OUT=str(outside))
    assert r.error_class != "infra"
    assert sorted(p.name for p in outside.iterdir()) == ["victim.txt"], r.text
    assert (outside / "victim.txt").stat().st_mtime == 1_000_000, r.text


def test_pidfd_signals_cannot_reach_the_worker(pool):
    workers = [(w.proc.pid, w.proc) for w in pool._workers]
    code = """
import os, signal
for target in [os.getppid(), 1, *WORKERS]:
    try:
        signal.pidfd_send_signal(os.pidfd_open(target), signal.SIGKILL)
        print(target, 'signalled')
    except OSError as e:
        print(target, 'refused', type(e).__name__)
"""
    r = run(pool, code, WORKERS=[pid for pid, _ in workers])
    time.sleep(0.2)
    # seccomp refuses pidfd_open itself (EPERM), for the parent, init and every worker alike
    assert r.status == "success", r.text
    lines = r.text.removeprefix("Tool call success\nstdout: ").splitlines()
    assert [line.split(" ", 1)[1] for line in lines] == ["refused PermissionError"] * (2 + len(workers)), r.text
    assert [w.proc.pid for w in pool._workers] == [pid for pid, _ in workers], "a worker was replaced"
    assert all(proc.poll() is None for _, proc in workers), "a worker died"
    assert pool.replaced == 0
    assert_serves(pool)


def test_no_process_outside_the_call_can_even_be_probed(pool):
    """kill(pid, 0) succeeds for any process the code could signal: none but itself may answer."""
    code = (
        DISARM
        + """
me = os.getpid()
reachable = []
for target in [-1, 1, os.getppid(), *WORKERS, PYTEST, *[int(p) for p in os.listdir('/proc') if p.isdigit()]]:
    try:
        os.kill(target, 0)
        reachable.append(target)
    except OSError:
        pass
print(sorted(set(reachable) - {me}))
"""
    )
    r = run(pool, code, WORKERS=[w.proc.pid for w in pool._workers], PYTEST=os.getpid())
    assert (r.status, r.text) == ("success", "Tool call success\nstdout: []\n"), r.text


PIPELINE = """
import json, os, sys
from pipeline.config import SandboxConfig
from rollout_gen.sandbox import Layers, SandboxPool
with SandboxPool(SandboxConfig(workers=1, timeout_s=3.0), Layers(audit_hook=sys.argv[1] == 'on')) as pool:
    r = pool.run('PIPELINE = %d\\n' % os.getpid() + sys.argv[2])
print(json.dumps({'status': r.status, 'class': r.error_class, 'text': r.text}))
"""


def run_in_pipeline(code: str, audit_hook: bool, secret: str = "") -> subprocess.CompletedProcess:
    """A separate pipeline process (so an escape can kill it, not pytest) that holds `secret` in the
    environment it started with, runs one call, and prints the result."""
    code_under_test = Path(sandbox_module.__file__).resolve().parents[1]
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(code_under_test), str(REPO)]),
        "CLEANER_PIPELINE_SECRET": secret,
    }
    return subprocess.run(
        [sys.executable, "-c", PIPELINE, "on" if audit_hook else "off", code],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )


@pytest.mark.parametrize("audit_hook", [True, False], ids=["all-layers", "kernel-only"])
def test_pidfd_signal_cannot_kill_the_pipeline(audit_hook):
    code = "import os, signal\nsignal.pidfd_send_signal(os.pidfd_open(PIPELINE), signal.SIGKILL)\n"
    done = run_in_pipeline(code, audit_hook)
    assert done.returncode == 0, f"the pipeline process ended with {done.returncode}"
    result = json.loads(done.stdout.splitlines()[-1])
    assert (result["status"], result["class"]) == ("failure", "model"), result


@pytest.mark.parametrize("audit_hook", [True, False], ids=["all-layers", "kernel-only"])
def test_ancestors_environment_is_not_readable(audit_hook):
    secret = f"hunter2-{uuid.uuid4().hex}"
    code = """
import os
seen = []
for pid in {PIPELINE, os.getppid(), 1, *[int(p) for p in os.listdir('/proc') if p.isdigit()]}:
    try:
        env = open(f'/proc/{pid}/environ', 'rb').read().decode(errors='replace').split('\\0')
        seen += [v for v in env if v.startswith('CLEANER_PIPELINE_SECRET=')]  # the answer is cut at 256 chars
    except OSError:
        pass
print(seen)
"""
    done = run_in_pipeline(code, audit_hook, secret)
    assert done.returncode == 0, done.stderr[-2000:]
    result = json.loads(done.stdout.splitlines()[-1])
    assert result["class"] != "infra"
    assert secret not in done.stdout


def test_model_code_cannot_pass_itself_off_as_an_infra_failure(pool):
    """Exiting with the worker's "could not build the sandbox" status is the model's own failure."""
    r = pool.run("import os\nos._exit(121)")
    assert (r.status, r.error_class) == ("failure", "model")


def test_a_disarmed_audit_hook_leaves_the_kernel_layers(pool, outside):
    code = (
        DISARM
        + """
for name, attempt in {
    'write': lambda: open(os.path.join(OUT, 'victim.txt'), 'w').write('owned'),
    'create': lambda: open(os.path.join(OUT, 'created.txt'), 'w').write('owned'),
    'proc': lambda: open('/proc/self/oom_score_adj', 'w').write('-1000'),
    'proc-comm': lambda: open('/proc/self/comm', 'w').write('owned'),
}.items():
    try:
        attempt()
        print(name, 'done')
    except OSError as e:
        print(name, 'refused', type(e).__name__)
"""
    )
    r = run(pool, code, OUT=str(outside))
    assert r.error_class != "infra"
    assert sorted(p.name for p in outside.iterdir()) == ["victim.txt"], r.text
    assert (outside / "victim.txt").read_text() == "intact"
    assert "done" not in r.text, r.text


def test_raw_syscalls_through_ctypes_gain_nothing(pool):
    """With ctypes back (sys.modules entry removed, hook disarmed), privileged calls still fail."""
    code = (
        DISARM
        + """
sys.modules.pop('_ctypes', None)
import ctypes
libc = ctypes.CDLL(None, use_errno=True)
results = {
    'setuid0': libc.setuid(0), 'ptrace-parent': libc.ptrace(16, os.getppid(), 0, 0),
    'mount': libc.mount(b'none', b'/tmp', b'tmpfs', 0, None), 'unshare-user': libc.unshare(0x10000000),
    'chroot': libc.chroot(b'/'), 'uid': os.getuid(), 'euid': os.geteuid(),
}
print(results)
"""
    )
    r = pool.run(code)
    if pool.layers.audit_hook:  # the hook's names are bound at install: disarming does not work
        assert r.status == "failure" and "is not allowed" in r.text, r.text
        return
    assert r.status == "success", r.text
    results = eval(r.text.split("stdout: ", 1)[1])  # noqa: S307 (our own printed dict)
    assert all(results[k] == -1 for k in ("setuid0", "ptrace-parent", "mount", "unshare-user", "chroot")), results
    assert results["uid"] != 0 and results["euid"] != 0, results


def test_files_only_root_may_read_stay_unreadable(pool, tmp_path):
    secret_dir = tmp_path / "private"
    secret_dir.mkdir(mode=0o700)
    (secret_dir / "key").write_text("top-secret")
    (secret_dir / "key").chmod(0o600)
    code = (
        "for p in PATHS:\n    try:\n        print(open(p).read())\n"
        "    except OSError as e:\n        print(type(e).__name__)\n"
    )
    home_file = Path.home() / ".bashrc"
    r = run(pool, code, PATHS=[str(secret_dir / "key"), "/etc/shadow", str(home_file)])
    assert "top-secret" not in r.text and "root:" not in r.text
    if home_file.exists():
        assert home_file.read_text()[:40] not in r.text or not home_file.read_text().strip()


def test_unix_sockets_on_the_host_are_out_of_reach(pool, tmp_path):
    import socket

    tmp_path.chmod(0o777)
    path = tmp_path / "host.sock"
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server.bind(str(path))
    path.chmod(0o777)
    server.listen(1)
    server.settimeout(0.5)
    code = DISARM + "import socket\ns = socket.socket(socket.AF_UNIX)\ns.connect(SOCK)\ns.sendall(b'hello')\n"
    r = run(pool, code, SOCK=str(path))
    with pytest.raises(TimeoutError):
        server.accept()
    server.close()
    assert (r.status, r.error_class) == ("failure", "model"), r.text


@pytest.mark.parametrize("namespaces", [True, False], ids=["pid-namespace", "no-namespaces"])
def test_leftovers_are_killed_without_a_separate_uid(namespaces):
    """With no uid of its own and nothing refusing fork/exec, what the code leaves running still dies."""
    tag = f"cleaner-leftover-{uuid.uuid4().hex}"
    layers = Layers(namespaces=namespaces, separate_uid=False, seccomp=False, audit_hook=False)
    try:
        with SandboxPool(CFG, layers) as pool:
            assert pool.isolation["uid"] is None
            code = SPAWN + "import time\ntime.sleep(0.3)\n"  # the daemon is running when the code ends
            r = run(pool, code, CMD="sleep 30; :", TAG=tag)
            assert r.status == "success" and "spawned" in r.text, r.text
            time.sleep(0.2)
            assert processes_with(tag) == [], "the daemon survived the call"
            assert_serves(pool)
    finally:
        kill_tagged(tag)


UNPRIVILEGED = """
import json, os
from pipeline.config import SandboxConfig
from rollout_gen.sandbox import SandboxPool
with SandboxPool(SandboxConfig(workers=1, timeout_s=3.0)) as pool:
    code = "import os\\nfd = os.open(%r, os.O_RDONLY)\\n\
os.close(os.open('x', os.O_CREAT | os.O_WRONLY, 0o666, dir_fd=fd))"
    r = pool.run(code % os.environ['OUT'])
    print(json.dumps({'iso': pool.isolation, 'status': r.status, 'class': r.error_class, 'text': r.text}))
"""


def test_a_pipeline_that_is_not_root_gets_a_user_namespace(outside):
    """Root only inside a user namespace (as in rootless containers) takes the unprivileged path."""
    env = {**os.environ, "PYTHONPATH": str(Path(sandbox_module.__file__).resolve().parents[1]), "OUT": str(outside)}
    done = subprocess.run(
        ["unshare", "--user", "--map-root-user", sys.executable, "-c", UNPRIVILEGED],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    if done.returncode != 0 and "unshare failed" in done.stderr:
        pytest.skip("this kernel refuses user namespaces")
    assert done.returncode == 0, done.stderr[-2000:]
    out = json.loads(done.stdout.splitlines()[-1])
    iso = out["iso"]
    assert (iso["root"], iso["namespaces"], iso["readonly_fs"], iso["pid_namespace"], iso["seccomp"]) == (
        False,
        True,
        True,
        True,
        True,
    ), iso
    assert any("not root" in d for d in iso["degraded"])
    assert (out["status"], out["class"]) == ("failure", "model") and not (outside / "x").exists(), out


def test_pool_close_leaves_no_directories_behind():
    pool = SandboxPool(SandboxConfig(workers=2, timeout_s=2.0))
    bases = [Path(w.info["base"]) for w in pool._workers]
    assert len(set(bases)) == 2 and all(b.is_dir() and b.name.startswith("cleaner-sandbox-") for b in bases)
    assert pool.run("open('f.txt', 'w').write('x' * 1000)").status == "success"
    victim = pool._workers[0]
    os.kill(victim.proc.pid, signal.SIGKILL)  # a crashed worker's directory goes too
    time.sleep(0.1)
    assert [r.status for r in pool.run_many(["print(1)"] * 4)] == ["success"] * 4 and pool.replaced == 1
    bases.append(Path(pool._workers[0].info["base"]))
    pool.close()
    assert [b for b in bases if b.exists()] == []


def test_degraded_sandbox_says_so_and_still_refuses_what_it_can(caplog):
    """No namespaces (as where the kernel forbids them): a warning, and seccomp + rlimits + cleanup."""
    with caplog.at_level("WARNING", logger="rollout_gen.sandbox"):
        pool = SandboxPool(CFG, Layers(namespaces=False, audit_hook=False))
    with pool:
        assert any("sandbox degraded: no namespaces" in m for m in caplog.messages), caplog.messages
        iso = pool.isolation
        assert (iso["namespaces"], iso["readonly_fs"], iso["pid_namespace"], iso["seccomp"]) == (
            False,
            False,
            False,
            True,
        )
        assert_serves(pool)
        tag = f"cleaner-degraded-{uuid.uuid4().hex}"
        try:
            r = run(pool, SPAWN, CMD="sleep 30; :", TAG=tag)
            assert (r.status, r.error_class) == ("failure", "model") and "PermissionError" in r.text, r.text
            assert processes_with(tag) == []
        finally:
            kill_tagged(tag)
        r = pool.run(f"import os, signal\nsignal.pidfd_send_signal(os.pidfd_open({os.getpid()}), signal.SIGKILL)")
        assert (r.status, r.error_class) == ("failure", "model"), r.text
        r = pool.run("import os, stat\nos.mknod('/tmp/cleaner-degraded-node', stat.S_IFCHR | 0o666, os.makedev(1, 3))")
        assert r.status == "failure" and not os.path.exists("/tmp/cleaner-degraded-node")
        r = pool.run("while True:\n    pass")
        assert (r.error_label, r.error_class) == ("worker_timeout", "model")
