"""Running cleaner commands as a user does, in their own process (shared by the flow, gc and schedule tests)."""

from __future__ import annotations

import os
import subprocess
import sys
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

ROOT = Path(__file__).resolve().parent.parent
TINY = """\
storage: {{root: {root}}}
flow: {{run_id: tiny, iterations: 2, tensorboard: true}}
rollout: {{tasks_per_iteration: 4, samples_per_prompt: 4}}
purify: {{modes: [saar, raw], gammas: [0.5]}}
train: {{mini_batches: 2, lr: 1.0e-4}}
"""


def tiny_config(root: Path, name: str = "tiny.yaml", **sections: dict) -> Path:
    """root/NAME: the tiny run's config (TINY, storage under root), each section given updated with its settings,
    e.g. tiny_config(root, flow={"run_id": "quiet", "iterations": 1})."""
    import yaml

    cfg = yaml.safe_load(TINY.format(root=root))
    for section, settings in sections.items():
        cfg.setdefault(section, {}).update(settings)
    path = root / name
    path.write_text(yaml.safe_dump(cfg))
    return path


def command_env(root: Path | None = None, **extra: str) -> dict[str, str]:
    """The environment a user's `cleaner` runs with: this checkout on PYTHONPATH, and with a root, the
    Prefect home under it."""
    return {
        **os.environ,
        "PYTHONPATH": str(ROOT),
        **({"PREFECT_HOME": str(root / ".prefect")} if root else {}),
        **extra,
    }


def cleaner(
    args: list[str], root: Path, env: dict[str, str] | None = None, cwd: Path = ROOT, stdout=subprocess.PIPE, **kw
) -> subprocess.Popen:
    """`cleaner ARGS` started in its own session (the test can signal its group), output merged on `stdout`."""
    return subprocess.Popen(
        [sys.executable, "-m", "flows.cli", *args],
        cwd=cwd,
        env=env or command_env(root),
        stdout=stdout,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
        **kw,
    )


def run_cleaner(
    args: list[str], root: Path | None = None, cwd: Path = ROOT, env: dict[str, str] | None = None, timeout: float = 600
) -> subprocess.CompletedProcess:
    """`cleaner ARGS` run to its end as a user runs it, stdout and stderr apart."""
    return subprocess.run(
        [sys.executable, "-m", "flows.cli", *args],
        cwd=cwd,
        env=env or command_env(root),
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def train(root: Path, *overrides: str, timeout: float = 600) -> str:
    p = cleaner(["train", "-c", str(tiny_config(root)), *overrides], root)
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
    env = {
        **os.environ,
        "PREFECT_HOME": str(root / ".prefect"),
        "PYTHONPATH": str(ROOT),
        "COLUMNS": str(columns),
        "TERM": "xterm",
    }
    p = subprocess.Popen(
        [sys.executable, "-m", "flows.cli", *args],
        cwd=ROOT,
        env=env,
        stdin=subprocess.DEVNULL,
        stdout=slave,
        stderr=slave,
        start_new_session=True,
    )
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


def copy_runs(source: Path, root: Path) -> Path:
    """The runs of storage root `source` copied under `root` (a test writes beside them without touching the
    shared ones); returns root."""
    import shutil

    shutil.copytree(source / "runs", root / "runs")
    return root


def rollout_copy(world_rollout, tmp_path_factory, name: str):
    """The session's world rollout copied into a fresh root of its own (a module purifies or trains there
    without touching the shared one): its config, pointed at the copy."""
    cfg = world_rollout.model_copy(deep=True)
    cfg.storage.root = copy_runs(world_rollout.storage.root, tmp_path_factory.mktemp(name))
    return cfg


def prefect_api(url: str, path: str, body: dict) -> list[dict]:
    """POST BODY to the Prefect server's API at url (…/api) + path, e.g. ("/flow_runs/filter", {}): its JSON."""
    import json
    import urllib.request

    req = urllib.request.Request(
        f"{url}{path}", data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(req, timeout=10) as r:
        return json.loads(r.read())


def temporary_server_env(root: Path | None = None, **extra: str) -> dict[str, str]:
    """command_env without PREFECT_API_URL: the command starts Prefect's temporary server of its own even where
    the tester's shell points at a real one."""
    return {k: v for k, v in command_env(root, **extra).items() if k != "PREFECT_API_URL"}


@contextmanager
def project_server(root: Path, *args: str) -> Iterator[str]:
    """`cleaner server start --no-ui ARGS` (the project's real Prefect server, home under root) for the block,
    stopped after it: its API URL, for PREFECT_API_URL and prefect_api."""
    import re

    started = run_cleaner(["server", "start", "--no-ui", *args], root)
    assert started.returncode == 0, started.stderr[-3000:]
    try:
        yield re.search(r"PREFECT_API_URL=(\S+)", started.stdout).group(1)
    finally:
        run_cleaner(["server", "stop", *args], root)


def refused(argv: list[str], capsys, code: int, *words: str) -> str:
    """`cleaner ARGV` in this process ends with `code` and one line on stderr holding every word (nothing on stdout)."""
    from flows.cli import main

    assert main(argv) == code
    captured = capsys.readouterr()
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1 and not captured.out, captured.err
    for w in words:
        assert w in lines[0], lines[0]
    return lines[0]


def interrupted_after(monkeypatch, owner: object, name: str) -> None:
    """`owner.name` does its work and then raises KeyboardInterrupt: what a Ctrl-C (or a kill, for what was written
    before it) just past that step leaves."""
    done = getattr(owner, name)

    def then_interrupted(*args, **kwargs):
        done(*args, **kwargs)
        raise KeyboardInterrupt

    monkeypatch.setattr(owner, name, then_interrupted)
