"""The Python tool: a pool of warm sandbox workers, and the classification of what a call did.

Model-written code never runs in this process: each call is forked from a warm worker process
(`sandbox_worker.py`) inside its own limits. Failures are classified as the model's (its code
raised or ran out of time) or as infrastructure (a worker died, hung, or could not build the
sandbox); infrastructure failures are retried here and never blamed on the model.
"""

from __future__ import annotations

import json
import logging
import queue
import select
import shutil
import subprocess
import sys
import tempfile
import threading
from concurrent.futures import ThreadPoolExecutor
from contextlib import suppress
from dataclasses import asdict, dataclass
from pathlib import Path

from pipeline.chat import format_tool_response
from pipeline.config import SandboxConfig
from pipeline.trajectory import ToolResult

WORKER = Path(__file__).resolve().parent / "sandbox_worker.py"
ERROR_LABELS = (  # the spec (SAAR.md): the first that occurs in the error text names the failure, for statistics
    "ImportError",
    "ModuleNotFoundError",
    "SyntaxError",
    "IndexError",
    "IndentationError",
    "NameError",
    "TypeError",
    "worker_timeout",
    "NotImplementedError",
    "ValueError",
    "ZeroDivisionError",
)
INFRA_LABEL = "sandbox_error"
SCORING_TMPFS_MB = 128
log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Layers:
    """Which isolation layers the workers put up, each where the kernel allows it (README "The
    sandbox"). The pipeline always uses all of them; tests switch some off to prove that each of the
    others holds on its own, and to exercise the degraded paths."""

    namespaces: bool = True  # private mount/net/ipc/uts (+ user) per worker, pid + mount per call
    separate_uid: bool = True  # an unprivileged uid per worker when running as root
    seccomp: bool = True
    audit_hook: bool = True


@dataclass
class Execution:
    stdout: str = ""
    stderr: str = ""
    exit_code: int | None = None
    timed_out: bool = False
    duration_s: float = 0.0
    infra_error: str | None = None
    stdout_bytes: int = 0  # how much the code wrote to stdout, before `stdout` was cut to the call's output_chars


def error_label(text: str) -> str:
    return next((label for label in ERROR_LABELS if label in text), "unknown_error")


def classify(ex: Execution, cfg: SandboxConfig) -> ToolResult:
    """What the model is shown, and how the failure is counted (docs/saar.md)."""
    limit = cfg.response_chars
    if ex.infra_error is not None:
        text = format_tool_response(False, reason="the sandbox could not run the code (internal error)", limit=limit)
        return ToolResult(
            status="failure",
            text=text,
            error_label=INFRA_LABEL,
            error_class="infra",
            exit_code=ex.exit_code,
            duration_s=ex.duration_s,
        )
    if ex.timed_out:
        text = format_tool_response(
            False,
            ex.stdout,
            ex.stderr,
            reason=f"worker_timeout: the code ran longer than {cfg.timeout_s:g} s",
            limit=limit,
        )
        return ToolResult(
            status="failure",
            text=text,
            error_label="worker_timeout",
            error_class="model",
            exit_code=ex.exit_code,
            duration_s=ex.duration_s,
            timed_out=True,
        )
    if ex.exit_code == 0:
        return ToolResult(
            status="success",
            text=format_tool_response(True, ex.stdout, ex.stderr, limit=limit),
            exit_code=0,
            duration_s=ex.duration_s,
        )
    reason = next(
        (ln.strip() for ln in reversed(ex.stderr.splitlines()) if ln.strip()),  # the error's last line
        f"the process ended with exit code {ex.exit_code}",
    )
    text = format_tool_response(False, ex.stdout, ex.stderr, reason=reason, limit=limit)
    return ToolResult(
        status="failure",
        text=text,
        error_label=error_label(ex.stderr),
        error_class="model",
        exit_code=ex.exit_code,
        duration_s=ex.duration_s,
    )


class _Worker:
    def __init__(self, idx: int, cfg: SandboxConfig, layers: Layers) -> None:
        self.idx = idx
        env = {"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8"}  # no secrets of ours reach the worker
        # Call directories share one tmpfs per worker: room for a few files at the size limit each, and for
        # a benchmark scoring call's larger output (SCORING_TMPFS_MB; a tmpfs takes memory only as it fills).
        options = {"layers": asdict(layers), "tmpfs_mb": max(SCORING_TMPFS_MB, 4 * cfg.max_file_mb)}
        self.proc = subprocess.Popen(
            [sys.executable, "-I", str(WORKER), str(idx), json.dumps(options)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            env=env,
            text=True,
            bufsize=1,
            start_new_session=True,
        )
        hello = self._readline(60.0)
        if hello is None:
            self.kill()
            raise RuntimeError(f"sandbox worker {idx} did not start")
        self.info = json.loads(hello)

    def _readline(self, timeout: float) -> str | None:
        if not select.select([self.proc.stdout], [], [], timeout)[0]:
            return None
        return self.proc.stdout.readline() or None

    def call(self, request: dict, timeout: float) -> dict | None:
        try:
            self.proc.stdin.write(json.dumps(request) + "\n")
            self.proc.stdin.flush()
        except (BrokenPipeError, OSError):
            return None
        line = self._readline(timeout)
        return json.loads(line) if line else None

    def alive(self) -> bool:
        return self.proc.poll() is None

    def kill(self, grace_s: float = 0.0) -> None:
        """Stop the worker (end of input first, so it finishes the call it is in), then remove its call
        directory from here: inside its own mount namespace that directory is a mount point."""
        with suppress(OSError):
            self.proc.stdin.close()
        with suppress(subprocess.TimeoutExpired):
            self.proc.wait(timeout=grace_s)
        with suppress(OSError, subprocess.TimeoutExpired):
            self.proc.kill()
            self.proc.wait(timeout=5)
        if self.proc.stdout is not None:
            self.proc.stdout.close()
        base = getattr(self, "info", {}).get("base")
        if base and Path(base).parent == Path(tempfile.gettempdir()) and Path(base).name.startswith("cleaner-sandbox-"):
            shutil.rmtree(base, ignore_errors=True)


class SandboxPool:
    """A fixed number of warm workers; `run_many` spreads calls over them in parallel."""

    def __init__(self, cfg: SandboxConfig | None = None, layers: Layers = Layers()) -> None:
        self.cfg = cfg or SandboxConfig()
        self.layers = layers
        self._idle: queue.Queue[_Worker] = queue.Queue()
        self._lock = threading.Lock()
        self._workers = [_Worker(i, self.cfg, layers) for i in range(self.cfg.workers)]
        self.replaced = 0
        for w in self._workers:
            self._idle.put(w)
        for problem in self._workers[0].info.get("degraded", []):
            log.warning("sandbox degraded: %s", problem)
        self._threads = ThreadPoolExecutor(max_workers=self.cfg.workers, thread_name_prefix="sandbox")

    @property
    def isolation(self) -> dict:
        return dict(self._workers[0].info) if self._workers else {}

    def _replace(self, dead: _Worker) -> _Worker:
        dead.kill()
        fresh = _Worker(dead.idx, self.cfg, self.layers)
        with self._lock:
            self._workers[self._workers.index(dead)] = fresh
            self.replaced += 1
        return fresh

    def execute(
        self,
        code: str,
        *,
        timeout_s: float | None = None,
        memory_mb: int | None = None,
        max_file_mb: int | None = None,
        output_chars: int | None = None,
    ) -> Execution:
        """One call, retried on a fresh worker when the infrastructure fails. The limits default to the
        tool's (`rollout.sandbox`); scoring a benchmark passes the benchmark's own (rollout_gen/lcb.py)."""
        request = {
            "code": code,
            "timeout_s": timeout_s or self.cfg.timeout_s,
            "memory_mb": memory_mb or self.cfg.memory_mb,
            "max_processes": self.cfg.max_processes,
            "max_file_mb": max_file_mb or self.cfg.max_file_mb,
            "output_chars": output_chars or self.cfg.output_chars,
        }
        problem = "no attempt made"
        for _ in range(self.cfg.infra_retries + 1):
            worker = self._idle.get()
            try:
                reply = worker.call(request, timeout=request["timeout_s"] + 30)
                if reply is None or not worker.alive():
                    problem = f"worker {worker.idx} died or hung during the call"
                    worker = self._replace(worker)
                    continue
                if "internal_error" in reply or reply.get("setup_failed"):
                    problem = (
                        reply.get("internal_error") or reply.get("setup_error") or "the sandbox could not be set up"
                    )
                    continue
                return Execution(
                    reply["stdout"],
                    reply["stderr"],
                    reply["exit_code"],
                    reply["timed_out"],
                    reply["duration_s"],
                    stdout_bytes=reply.get("stdout_bytes", 0),
                )
            finally:
                self._idle.put(worker)
        return Execution(infra_error=problem)

    def run(self, code: str) -> ToolResult:
        return classify(self.execute(code), self.cfg)

    def run_many(self, codes: list[str]) -> list[ToolResult]:
        return list(self._threads.map(self.run, codes))

    def close(self) -> None:
        self._threads.shutdown(wait=True)
        for w in self._workers:
            w.kill(grace_s=5.0)

    def __enter__(self) -> "SandboxPool":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
