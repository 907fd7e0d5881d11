"""The real sandbox pool: hostile programs are contained, labelled and classed, and the pool goes on."""

from __future__ import annotations

import os
import signal
import time

import pytest

from pipeline.config import SandboxConfig
from rollout_gen.sandbox import Execution, SandboxPool, classify, error_label


@pytest.fixture(scope="module")
def pool():
    with SandboxPool(SandboxConfig(workers=2, timeout_s=2.0)) as p:
        yield p


def assert_pool_serves(pool: SandboxPool) -> None:
    r = pool.run("print(6 * 7)")
    assert r.status == "success" and "stdout: 42" in r.text


def test_success_and_model_errors(pool):
    ok = pool.run("x = 12\nprint(x * 3)")
    assert (ok.status, ok.error_label, ok.error_class) == ("success", None, None)
    assert ok.text == "Tool call success\nstdout: 36\n"
    name = pool.run("prnt(1)")
    assert (name.status, name.error_label, name.error_class) == ("failure", "NameError", "model")
    assert name.text.startswith("Tool call failure\nreason: NameError: name 'prnt' is not defined")
    syntax = pool.run("print((1 + 2)")
    assert (syntax.error_label, syntax.error_class) == ("SyntaxError", "model")
    attr = pool.run("x = 5\nprint(x.cube())")
    assert (attr.error_label, attr.error_class) == ("unknown_error", "model")
    assert "AttributeError" in attr.text
    assert pool.run("print(1 // 0)").error_label == "ZeroDivisionError"


def test_infinite_loop_times_out(pool):
    r = pool.run("while True:\n    pass")
    assert (r.status, r.error_label, r.error_class, r.timed_out) == ("failure", "worker_timeout", "model", True)
    assert r.duration_s >= pool.cfg.timeout_s  # it ran its whole allowance, then was stopped (the call returned)
    assert_pool_serves(pool)


def test_fork_bomb_is_contained(pool):
    r = pool.run("import os\nwhile True:\n    os.fork()")
    assert r.status == "failure" and r.error_class == "model"
    r = pool.run("import subprocess\nsubprocess.run(['sleep', '100'])")
    assert r.status == "failure" and r.error_class == "model"
    r = pool.run("import multiprocessing\nmultiprocessing.Process(target=print).start()")
    assert r.status == "failure" and r.error_class == "model"
    assert_pool_serves(pool)


def test_huge_allocation_is_refused(pool):
    r = pool.run("x = bytearray(10 * 2**30)\nprint(len(x))")
    assert (r.status, r.error_class) == ("failure", "model") and "MemoryError" in r.text
    assert_pool_serves(pool)


def test_writing_outside_the_temp_dir_is_refused(pool, tmp_path):
    target = tmp_path / "escaped.txt"
    r = pool.run(f"open({str(target)!r}, 'w').write('owned')")
    assert (r.status, r.error_class) == ("failure", "model") and not target.exists()
    r = pool.run(f"import os\nos.remove({str(tmp_path)!r})")
    assert r.status == "failure" and tmp_path.exists()
    inside = pool.run("open('notes.txt', 'w').write('ok')\nprint(open('notes.txt').read())")
    assert inside.status == "success" and "stdout: ok" in inside.text
    # each call gets a fresh directory: the file is gone on the next call
    assert pool.run("import os\nprint(os.listdir('.'))").text.count("notes.txt") == 0


def test_sockets_are_refused(pool):
    r = pool.run("import socket\ns = socket.create_connection(('127.0.0.1', 22), timeout=1)")
    assert (r.status, r.error_class) == ("failure", "model")
    assert_pool_serves(pool)


def test_printing_100mb_is_capped(pool):
    r = pool.run("print('x' * 100_000_000)")
    # the file-size rlimit on the call's captured stdout stops the write: the model's own error, reported
    assert (r.status, r.error_label, r.error_class, r.timed_out) == ("failure", "unknown_error", "model", False)
    assert r.text.startswith("Tool call failure\nreason: OSError: [Errno 27] File too large\nstdout: xxx")
    assert len(r.text) <= SandboxConfig().response_chars + len("...(truncated)...")
    assert_pool_serves(pool)


def test_killing_its_parent_is_contained(pool):
    pids = [w.proc.pid for w in pool._workers]
    r = pool.run("import os, signal\nos.kill(os.getppid(), signal.SIGKILL)")
    assert (r.status, r.error_class) == ("failure", "model")
    assert [w.proc.pid for w in pool._workers] == pids, "no worker died"
    assert_pool_serves(pool)


def test_environment_secrets_do_not_leak(pool, monkeypatch):
    monkeypatch.setenv("CLEANER_TEST_SECRET", "hunter2")
    r = pool.run("import os\nprint(sorted(os.environ))\nprint(open('/proc/self/environ').read())")
    assert "hunter2" not in r.text and "CLEANER_TEST_SECRET" not in r.text


def test_non_utf8_output_is_replaced(pool):
    r = pool.run("import sys\nsys.stdout.buffer.write(b'\\xff\\xfe ok\\n')")
    assert r.status == "success" and "ok" in r.text


def test_crashed_worker_is_replaced_and_the_call_retried():
    with SandboxPool(SandboxConfig(workers=1, timeout_s=2.0)) as pool:
        victim = pool._workers[0].proc.pid
        os.kill(victim, signal.SIGKILL)
        time.sleep(0.1)
        r = pool.run("print('after crash')")
        assert r.status == "success" and "after crash" in r.text
        assert pool.replaced == 1 and pool._workers[0].proc.pid != victim


def test_infra_failure_is_classed_infra_never_model():
    r = classify(Execution(infra_error="worker died"), SandboxConfig())
    assert (r.status, r.error_class, r.error_label) == ("failure", "infra", "sandbox_error")
    assert "NameError" not in r.text


def test_error_labels_follow_the_reference_order():
    assert error_label("ModuleNotFoundError: No module named 'x'") == "ModuleNotFoundError"
    assert error_label("IndentationError: unexpected indent") == "IndentationError"
    assert error_label("KeyError: 3") == "unknown_error"


def test_calls_run_in_parallel_across_workers(pool):
    codes = [f"print({i} * 2)" for i in range(40)]
    results = pool.run_many(codes)
    assert [r.text for r in results] == [f"Tool call success\nstdout: {i * 2}\n" for i in range(40)]
    # concurrency itself: each call sleeps and reports when it started and ended (wall clock, shared by
    # the processes); with 2 workers, at most 2 and at least 2 calls are ever running at once
    n, nap = 6, 0.6
    spans = [
        tuple(map(float, r.text.split("stdout: ", 1)[1].split()))
        for r in pool.run_many(["import time\nt = time.time()\ntime.sleep(%s)\nprint(t, time.time())" % nap] * n)
    ]
    assert len(spans) == n and all(end - start >= nap for start, end in spans)
    running = [sum(s <= t < e for s, e in spans) for t, _ in spans]  # calls running as each one starts
    assert max(running) == 2
    # no call ran alone: each overlapped another (serially, none would)
    assert all(
        any(s2 < e1 and s1 < e2 for j, (s2, e2) in enumerate(spans) if j != i) for i, (s1, e1) in enumerate(spans)
    )


def test_a_long_traceback_keeps_its_last_line(pool):
    """Standard error was kept from its start up to output_chars: a traceback through 30 calls lost its last line,
    so the failure was labelled unknown_error and its reason was `File "<code>",` (a user found it). Now the head
    and the tail are kept."""
    chain = "".join(f"def f{i}():\n    return f{i + 1}()\n" for i in range(30)) + "def f30():\n    return undefined\n"
    r = pool.run(chain + "f0()")
    assert (r.status, r.error_label) == ("failure", "NameError"), r.text[:300]
    assert r.text.startswith("Tool call failure\nreason: NameError: name 'undefined' is not defined"), r.text[:300]
