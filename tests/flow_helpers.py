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
