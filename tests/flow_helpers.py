"""Running cleaner commands as a user does, in their own process (shared by the flow, gc and schedule tests)."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TINY = """\
storage: {{root: {root}}}
flow: {{run_id: tiny, iterations: 2, tensorboard: true}}
rollout: {{tasks_per_iteration: 4, samples_per_prompt: 4}}
purify: {{modes: [saar, raw], gammas: [0.5]}}
train: {{mini_batches: 2, lr: 1.0e-4}}
"""


def cleaner(args: list[str], root: Path, **kw) -> subprocess.Popen:
    env = {**os.environ, "PREFECT_HOME": str(root / ".prefect"), "PYTHONPATH": str(ROOT)}
    return subprocess.Popen([sys.executable, "-m", "flows.cli", *args], cwd=ROOT, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True, **kw)


def train(root: Path, timeout: float = 600) -> str:
    cfg = root / "tiny.yaml"
    cfg.write_text(TINY.format(root=root))
    p = cleaner(["train", "-c", str(cfg)], root)
    out, _ = p.communicate(timeout=timeout)
    assert p.returncode == 0, out[-3000:]
    return out


def on_terminal(args: list[str], root: Path, columns: int = 100, timeout: float = 300) -> str:
    """`cleaner ARGS` on a pseudo-terminal `columns` wide, as a user sees it: its output, colours removed."""
    import fcntl
    import pty
    import re
    import struct
    import termios
    import time

    master, slave = pty.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 50, columns, 0, 0))
    env = {**os.environ, "PREFECT_HOME": str(root / ".prefect"), "PYTHONPATH": str(ROOT), "COLUMNS": str(columns),
           "TERM": "xterm"}
    p = subprocess.Popen([sys.executable, "-m", "flows.cli", *args], cwd=ROOT, env=env, stdin=subprocess.DEVNULL,
                         stdout=slave, stderr=slave, start_new_session=True)
    os.close(slave)
    chunks, deadline = [], time.time() + timeout
    try:
        while time.time() < deadline:
            try:
                data = os.read(master, 65536)
            except OSError:  # EIO: the command closed the terminal
                break
            if not data:
                break
            chunks.append(data)
    finally:
        os.close(master)
        p.wait(timeout=30)
    assert p.returncode == 0, b"".join(chunks).decode(errors="replace")[-3000:]
    text = b"".join(chunks).decode(errors="replace").replace("\r\n", "\n")
    return re.sub(r"\x1b\[[0-9;?]*[A-Za-z]", "", text)


def rollout_copy(world_rollout, tmp_path_factory, name: str):
    """The session's world rollout copied into a fresh root of its own (a module purifies or trains there
    without touching the shared one): its config, pointed at the copy."""
    import shutil

    root = tmp_path_factory.mktemp(name)
    shutil.copytree(world_rollout.storage.root / "runs", root / "runs")
    cfg = world_rollout.model_copy(deep=True)
    cfg.storage.root = root
    return cfg
