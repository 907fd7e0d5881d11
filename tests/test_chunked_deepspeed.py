"""train.strategy=deepspeed takes log-probs like the local strategy: lm_head only at the trained positions, in
chunks at a large vocabulary, inside the engine's forward (trainer/chunked_actor.py). Before, the DeepSpeed path
called OpenRLHF's Actor.forward, whose float32 logits cover every position (≈ 18.5 GiB per 8k-token micro-batch
at Qwen3's vocabulary)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("deepspeed")

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.parametrize(("stage", "checkpointing"), [(2, False), (3, True)], ids=["zero2", "zero3-checkpointed"])
def test_chunked_route_through_the_engine_equals_actor_forward_and_its_gradients(stage, checkpointing, tmp_path):
    """Same log-probs, entropy and full gradients (DeepSpeed's safe_get_full_grad, after the engine's own
    backward) as Actor.forward, while no lm_head call sees more positions than a chunk."""
    from tests.deepspeed_chunk_probe import CHUNK

    out = tmp_path / "probe.json"
    done = subprocess.run(
        [sys.executable, "-m", "tests.deepspeed_chunk_probe", str(stage), "1" if checkpointing else "0", str(out)],
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "2"},
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    got = json.loads(out.read_text())
    assert got["widest_plain"] == 2 * 160  # Actor.forward: every position of both rows through lm_head at once
    assert got["widest_chunked"] <= CHUNK < got["trained_positions"]
    assert got["parameters"] > 0 and got["grad_scale"] > 1e-3
    assert got["logp_gap"] < 1e-5 and got["entropy_gap"] < 1e-5
    assert got["grad_gap"] <= 1e-5 * got["grad_scale"]
