"""Math-answer equivalence by math-verify (latex2sympy + sympy), in a child process with a hard time limit.

sympy can spend unbounded time or memory on a short answer (`\\boxed{9^{9^{9^{9}}}}`), and math-verify's
own timeouts use SIGALRM, which works only in a process's main thread (a Prefect task runs in a worker
thread) and cannot interrupt a long C-level computation. So the comparison runs here, in a child that
is the main thread of its own process (math-verify's timeouts work) under an address-space limit, and the
parent waits at most `timeout_s` for each answer, killing and later restarting the child on expiry.
Every failure (timeout, crash, unparsable answer) is `None` for the caller: never a hang, never a raise.

Protocol, one JSON object a line: the child writes {"ready": true} once imported; then for each
{"gold": str, "answer": str} it writes {"equal": bool} or {"error": str}.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import logging
import os
import select
import subprocess
import sys
import threading
import time
from pathlib import Path

log = logging.getLogger("cleaner.rewards")

CHILD_MEMORY = 2 << 30  # bytes of address space for the child: a runaway sympy result is a MemoryError there
PARSE_TIMEOUT_S = 2  # math-verify's own (SIGALRM) limits inside the child, per parse and per comparison
VERIFY_TIMEOUT_S = 2


class MathVerifier:
    """A lazily started child process answering `equal(gold, answer)`; thread-safe, one call at a time."""

    def __init__(
        self, timeout_s: float = 3 * (PARSE_TIMEOUT_S + VERIFY_TIMEOUT_S), start_timeout_s: float = 120.0
    ) -> None:
        self.timeout_s, self.start_timeout_s = timeout_s, start_timeout_s
        self._proc: subprocess.Popen | None = None
        self._lock = threading.Lock()
        self.failures = 0  # answers that got no verdict (each scored as not equal)
        atexit.register(self.close)

    def equal(self, gold: str, answer: str) -> bool | None:
        """True/False, or None when math-verify gave no verdict in time (logged, counted)."""
        with self._lock:
            try:
                proc = self._sent(json.dumps({"gold": gold, "answer": answer}) + "\n")
                reply = self._read(proc, self.timeout_s)
            except (OSError, ValueError, TimeoutError, EOFError) as e:  # child gone, hung or garbled
                self._kill()
                reply = {"error": f"{type(e).__name__}: {e}"}
        if "equal" in reply:
            return bool(reply["equal"])
        self.failures += 1
        log.warning(
            "math-verify gave no verdict on %r vs %r (%s); scored as not equal",
            answer[:80],
            gold[:80],
            reply["error"][:200],
        )
        return None

    def _sent(self, line: str) -> subprocess.Popen:
        """The child, `line` written to it. A child that died since the last answer (killed, out of memory on an
        earlier one) is not this answer's doing: it is replaced once, where a broken pipe scored a correct
        answer as not equal."""
        for fresh in (False, True):
            if self._proc is not None and self._proc.poll() is not None:
                self._kill()
            proc = self._proc or self._start()
            try:
                proc.stdin.write(line)
                proc.stdin.flush()
                return proc
            except BrokenPipeError:
                self._kill()
                if fresh:
                    raise
        raise AssertionError("unreachable")

    def _start(self) -> subprocess.Popen:
        env = dict(
            os.environ,
            PYTHONPATH=os.pathsep.join(
                filter(None, [str(Path(__file__).resolve().parents[1]), os.environ.get("PYTHONPATH")])
            ),
        )
        self._proc = subprocess.Popen(
            [sys.executable, "-m", "rollout_gen.math_verify_worker"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            text=True,
            bufsize=1,
            env=env,
        )
        if not self._read(self._proc, self.start_timeout_s).get("ready"):
            raise ValueError("math-verify worker did not start")
        return self._proc

    @staticmethod
    def _read(proc: subprocess.Popen, timeout_s: float) -> dict:
        deadline = time.monotonic() + timeout_s
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"no answer from math-verify within {timeout_s:.0f}s")
            ready, _, _ = select.select([proc.stdout], [], [], left)
            if ready:
                line = proc.stdout.readline()
                if not line:
                    raise EOFError(f"math-verify worker exited (code {proc.poll()})")
                return json.loads(line)

    def _kill(self) -> None:
        proc, self._proc = self._proc, None
        if proc is not None:
            proc.kill()
            proc.wait()
            for f in (proc.stdin, proc.stdout):
                with contextlib.suppress(OSError):
                    f.close()

    def close(self) -> None:
        with self._lock:
            self._kill()


def _serve() -> None:
    import resource

    resource.setrlimit(resource.RLIMIT_AS, (CHILD_MEMORY, CHILD_MEMORY))
    logging.disable(logging.CRITICAL)  # math-verify logs every unparsable answer; verdicts go back as JSON
    from math_verify import parse, verify
    from math_verify.errors import TimeoutException

    def expr(text: str):
        return parse(f"${text}$", parsing_timeout=PARSE_TIMEOUT_S, raise_on_error=True)

    print(json.dumps({"ready": True}), flush=True)
    for line in sys.stdin:
        try:
            q = json.loads(line)
            gold, answer = expr(q["gold"]), expr(q["answer"])
            reply = {
                "equal": bool(
                    gold and answer and verify(gold, answer, timeout_seconds=VERIFY_TIMEOUT_S, raise_on_error=True)
                )
            }
        except (TimeoutException, MemoryError, RecursionError) as e:  # no verdict: the parent logs and counts it
            reply = {"error": f"{type(e).__name__}: {str(e)[:200]}"}
        except Exception:  # noqa: BLE001 - latex2sympy/sympy refused the answer: it is not the gold
            reply = {"equal": False}
        print(json.dumps(reply), flush=True)


if __name__ == "__main__":
    _serve()
