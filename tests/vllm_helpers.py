"""Shared by the tests against the real vLLM CPU server (tests/test_vllm_*.py).

One server of the tiny policy serves every test in a pytest process: `shared_url()` starts it through
cleaner's own server manager, whose per-process registry hands the same server to every later caller, so
the vLLM tests pay one start-up (about 35–50 s here) however many modules use it."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from pipeline.config import DEFAULT_POLICY, DEFAULT_VLLM_VENV

ROOT = Path(__file__).resolve().parent.parent
MAX_MODEL_LEN = 1024  # the tiny policy's max_position_embeddings
SERVER_ARGS = ["--enforce-eager"]

requires_vllm = pytest.mark.skipif(
    not (DEFAULT_VLLM_VENV / "bin" / "python").exists(),
    reason=f"{DEFAULT_VLLM_VENV} is absent: build it with scripts/setup_vllm.sh (vLLM's CPU build, about 4 minutes)",
)


def shared_url() -> str:
    from pipeline.engines.vllm_server import managed_urls

    (url,) = managed_urls(
        DEFAULT_POLICY,
        1,
        DEFAULT_VLLM_VENV,
        "float32",
        MAX_MODEL_LEN,
        SERVER_ARGS,
        600.0,
        log=lambda line: print(line, file=sys.stderr, flush=True),
    )
    return url


def overrides(root: Path, urls: list[str], *extra: str) -> list[str]:
    """A small world rollout through the given vLLM servers: 8 tasks × 4 samples, contexts within 1024 tokens."""
    return [
        f"storage.root={root}",
        "rollout.engine=vllm",
        f"rollout.vllm_urls=[{','.join(urls)}]",
        "rollout.tasks_per_iteration=8",
        "rollout.samples_per_prompt=4",
        "rollout.max_response_tokens=512",
        "rollout.max_prompt_tokens=256",
        *extra,
    ]


SERVER_CHILD = """
import sys, time
from pathlib import Path
from pipeline.engines.vllm_server import start_servers
(s,) = start_servers(Path(sys.argv[1]), 1, Path(sys.argv[2]), "float32", int(sys.argv[3]), sys.argv[4:], 600.0,
                     log=lambda line: print(line, file=sys.stderr, flush=True))
print(s.url, s.pid, flush=True)
while True:
    time.sleep(60)
"""


class ServerInAnotherCommand:
    """A vLLM server started by cleaner's server manager in a child process (another `cleaner` command):
    killing that process with SIGKILL must take the whole server with it."""

    def __init__(self, checkpoint: Path = DEFAULT_POLICY) -> None:
        env = {**os.environ, "PYTHONPATH": str(ROOT)}
        self.proc = subprocess.Popen(
            [
                sys.executable,
                "-c",
                SERVER_CHILD,
                str(checkpoint),
                str(DEFAULT_VLLM_VENV),
                str(MAX_MODEL_LEN),
                *SERVER_ARGS,
            ],
            cwd=ROOT,
            env=env,
            stdout=subprocess.PIPE,
            text=True,
        )
        self.url = ""
        self.guard_pid = 0

    def wait(self) -> str:
        if not self.url:
            line = self.proc.stdout.readline().split()
            assert line, f"the server child exited with {self.proc.wait()}"
            self.url, self.guard_pid = line[0], int(line[1])
        return self.url

    def kill_command(self) -> None:
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait()

    def group_alive(self) -> bool:
        try:
            os.killpg(self.guard_pid, 0)
            return True
        except ProcessLookupError:
            return False


class CuttableProxy:
    """A TCP relay in front of a server, cut on demand: to the client, the server stops answering mid-run
    (the real server keeps running for the other tests)."""

    def __init__(self, target_url: str) -> None:
        host, port = target_url.rsplit("//", 1)[1].split(":")
        self.target = (host, int(port))
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.listener.getsockname()[1]}"
        self.connections = 0
        self._open: list[socket.socket] = []
        self._lock = threading.Lock()
        threading.Thread(target=self._accept, daemon=True).start()

    def cut(self) -> None:
        with self._lock:
            self.listener.close()
            for s in self._open:
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass
                s.close()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self.listener.accept()
            except OSError:
                return
            with self._lock:
                self.connections += 1
                upstream = socket.create_connection(self.target)
                self._open += [client, upstream]
            for a, b in ((client, upstream), (upstream, client)):
                threading.Thread(target=self._pipe, args=(a, b), daemon=True).start()

    @staticmethod
    def _pipe(src: socket.socket, dst: socket.socket) -> None:
        try:
            while data := src.recv(65536):
                dst.sendall(data)
        except OSError:
            pass
        finally:
            try:
                dst.shutdown(socket.SHUT_WR)
            except OSError:
                pass


def perturbed_copy(policy: Path, dst: Path, scale: float) -> Path:
    """A copy of `policy` whose weights are moved by `scale` × N(0, 1) noise (seeded): a checkpoint the server
    must be seen to load, whose log-probs differ from the original's."""
    import shutil

    import torch
    from safetensors.torch import load_file, save_file

    shutil.copytree(policy, dst)
    weights = load_file(dst / "model.safetensors")
    g = torch.Generator().manual_seed(0)
    save_file(
        {k: v + scale * torch.randn(v.shape, generator=g) for k, v in weights.items()},
        dst / "model.safetensors",
        metadata={"format": "pt"},
    )
    return dst
