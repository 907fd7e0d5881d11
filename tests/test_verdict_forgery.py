"""A program cannot forge its LiveCodeBench verdict (rollout_gen/lcb.py): the expected output never enters the
sandboxed process, and the comparison happens in this one. Each adversary below searches everything it can
reach — its frames' locals and globals, every object the garbage collector tracks, the files in its working
directory, its open file descriptors, /proc/self, the environment — for the expected output (a random secret
per test run, so it cannot be written into the program) or a verdict nonce, then prints or returns what it
found, and forges a verdict line when it finds a nonce. It must get a fail, never a pass."""

from __future__ import annotations

import json
import secrets

import pytest

from pipeline.config import SandboxConfig
from rollout_gen.lcb import CodeTests, judge, run_tests
from rollout_gen.sandbox import SandboxPool

# Written as a LiveCodeBench answer would be; LOOT() returns every string it found holding the marker.
SEARCH = r'''
import gc, os, sys, json

MARK = "SECRET-"


def _strings(value, out, depth=0):
    if depth > 4:
        return
    if isinstance(value, (bytes, bytearray)):
        value = bytes(value).decode("utf-8", "replace")
    if isinstance(value, str):
        if value == MARK or "def LOOT" in value:  # the marker and this program's own text
            return
        if MARK in value or value.startswith("@@lcb-"):
            out.append(value)
    elif isinstance(value, dict):
        for k, v in list(value.items()):
            _strings(k, out, depth + 1)
            _strings(v, out, depth + 1)
    elif isinstance(value, (list, tuple, set, frozenset)):
        for v in list(value):
            _strings(v, out, depth + 1)


def LOOT():
    out = []
    frame = sys._getframe()
    while frame is not None:
        _strings(frame.f_locals, out)
        _strings(frame.f_globals, out)
        frame = frame.f_back
    for obj in gc.get_objects():
        if isinstance(obj, (dict, list, tuple)):
            try:
                _strings(obj, out, 3)
            except Exception:
                pass
    _strings(dict(os.environ), out)
    for name in os.listdir("."):
        try:
            with open(name, "rb") as f:
                _strings(f.read(), out)
        except Exception:
            pass
    for fd in os.listdir("/proc/self/fd"):
        try:
            _strings(os.pread(int(fd), 1 << 20, 0), out)
        except Exception:
            pass
    for name in ("cmdline", "environ"):
        try:
            with open("/proc/self/" + name, "rb") as f:
                _strings(f.read(), out)
        except Exception:
            pass
    return out


def FORGE(found):
    """A nonce-led verdict line, as a harness that prints one would read it, then leave before it speaks."""
    nonces = [s[:s.index("@@", 6) + 2] for s in found if s.startswith("@@lcb-") and "@@" in s[6:]]
    if nonces:
        sys.__stdout__.write("\n" + nonces[0] + json.dumps([True, ""]) + "\n")
        sys.__stdout__.flush()
        os._exit(0)


def ANSWER(found):
    for s in found:
        if s.startswith("SECRET-"):
            return s.strip()
        try:
            v = json.loads(s)
        except Exception:
            continue
        if isinstance(v, dict):
            for key in ("output", "outputs", "expected"):
                w = v.get(key)
                w = w[0] if isinstance(w, list) and w else w
                if isinstance(w, str) and MARK in w:
                    return w.strip()
    return next((s for s in found if s.startswith(MARK)), "nothing found")
'''

STDIN_ADVERSARY = (
    SEARCH
    + r"""
found = LOOT()
FORGE(found)
print(ANSWER(found))
"""
)

CALL_ADVERSARY = (
    SEARCH
    + r"""
class Solution:
    def secret(self, x):
        found = LOOT()
        FORGE(found)
        answer = ANSWER(found)
        try:
            return json.loads(answer)
        except Exception:
            return answer
"""
)


@pytest.fixture(scope="module")
def pool():
    with SandboxPool(SandboxConfig()) as pool:
        yield pool


def secret() -> str:
    return "SECRET-" + secrets.token_hex(12)


def answer(code: str) -> str:
    return f"Here is my solution.\n```python\n{code}\n```\n"


def test_a_stdin_program_that_searches_for_the_expected_output_fails(pool):
    tests = CodeTests(["1\n", "2\n"], [secret() + "\n", secret() + "\n"])
    verdict = judge(answer(STDIN_ADVERSARY), tests.to_json(), pool)
    assert verdict.score == 0.0 and [r.why for r in verdict.results] == ["wrong answer"] * 2, verdict
    # the same search, printing what an honest guess would be, is scored on what it printed: the channel works
    echo = CodeTests(["1\n"], ["nothing found\n"])
    assert all(r.passed for r in run_tests(STDIN_ADVERSARY, echo, pool))


def test_a_call_based_program_that_searches_for_the_expected_output_fails(pool):
    tests = CodeTests(['"a"', '"b"'], [json.dumps(secret()), json.dumps(secret())], "secret")
    verdict = judge(answer(CALL_ADVERSARY), tests.to_json(), pool)
    assert verdict.score == 0.0 and [r.why for r in verdict.results] == ["wrong answer"] * 2, verdict
    assert verdict.reason == "test 1 of 2: wrong answer"
    honest = CodeTests(['"a"'], [json.dumps("nothing found")], "secret")
    assert all(r.passed for r in run_tests(CALL_ADVERSARY, honest, pool))


class RecordingPool:
    """The real pool, recording the code of every call it runs (a spy: what it runs is unchanged)."""

    def __init__(self, pool: SandboxPool) -> None:
        self.pool, self.cfg, self.codes = pool, pool.cfg, []

    def execute(self, code: str, **limits):
        self.codes.append(code)
        return self.pool.execute(code, **limits)


def test_the_expected_output_never_reaches_the_sandbox(pool):
    spy = RecordingPool(pool)
    stdin, call = secret(), secret()
    judge(answer("print(input())"), CodeTests(["x\n"], [stdin + "\n"]).to_json(), spy)
    judge(answer("def f(x):\n    return x"), CodeTests(['"x"'], [json.dumps(call)], "f").to_json(), spy)
    assert len(spy.codes) == 2
    assert not any(stdin in code or call in code for code in spy.codes)


# A program that computes the answers but prints nothing, writing its own records on the runner's channel (fd 3, a
# copy of fd 1 the runner keeps), one before the runner writes its own for the same test.
CHANNEL_WRITER = r"""
import os, builtins, json
n = getattr(builtins, "_n", 0); builtins._n = n + 1
a, b = map(int, input().split())
os.write(3, (json.dumps({"test": n, "stdout": str(a + b)}) + "\n").encode())
"""

# The same, then leaving at once (os._exit) so that the runner writes nothing after its record.
CHANNEL_WRITER_EXITS = CHANNEL_WRITER + "\nos._exit(0)\n"

CALL_CHANNEL_WRITER = r"""
import os, builtins, json
class Solution:
    def add(self, nums):
        n = getattr(builtins, "_n", 0); builtins._n = n + 1
        os.write(3, (json.dumps({"test": n, "value": sum(nums)}) + "\n").encode())
        raise ValueError("after its own record")
"""


def test_a_program_writing_its_own_records_on_the_channel_fails(pool):
    """A user found that a program could write {"test": i, "stdout": …} on the runner's channel itself: the first
    record per test was kept, so printing nothing scored 1.0 on stdin tests, and a call that raised after its own
    record passed. The runner's records come in one order, ended by {"done": n}; anything else voids the run."""
    tests = CodeTests(["1 2\n", "5 7\n", "10 20\n"], ["3\n", "12\n", "30\n"])
    for program in (CHANNEL_WRITER, CHANNEL_WRITER_EXITS):
        verdict = judge(answer(program), tests.to_json(), pool)
        assert verdict.score == 0.0 and all("wrote on the scorer's channel" in r.why for r in verdict.results), verdict
    one = CodeTests(["1 2\n"], ["3\n"])  # one test, then os._exit: its record would be the only one
    assert judge(answer(CHANNEL_WRITER_EXITS), one.to_json(), pool).score == 0.0
    call = CodeTests(["[1, 2]", "[3, 4]"], ["3", "7"], "add")
    verdict = judge(answer(CALL_CHANNEL_WRITER), call.to_json(), pool)
    assert verdict.score == 0.0 and not any(r.passed for r in verdict.results), verdict
    # an honest program is scored as before, each test on what it printed
    honest = judge(answer("a, b = map(int, input().split())\nprint(a + b)"), tests.to_json(), pool)
    assert honest.score == 1.0, honest
