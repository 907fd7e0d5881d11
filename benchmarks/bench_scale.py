"""Peak RSS and wall time at real lengths on the Qwen3-shaped policy (vocabulary 151,936).

Recompute (8 rows sharing a prompt, every response token recomputed) and one update step (one group
of 8) at 1k/2k/4k/8k-token trajectories, each in its own child process so peak RSS is that of the
measured work alone (VmHWM). The unchunked baseline (today's code before issue 16: one forward
with full-vocabulary float32 logits, then log_softmax) is measured on one row at 1k where it fits
beside other work on this 24 GiB machine, and extrapolated (marked) elsewhere.
`python -m benchmarks.bench_scale` or `python -m benchmarks.run scale`.
"""

from __future__ import annotations

import json
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.common import BenchResult, Row, peak_rss_bytes

LENGTHS = (1024, 2048, 4096, 8192)
ROWS = 8
PROMPT = 200
GIB = 1024**3


def _rows(length: int, vocab: int = 151_643):
    from pipeline.trajectory import PurifiedTrajectory

    rng = random.Random(length)
    prompt = [rng.randrange(vocab) for _ in range(PROMPT)]
    out = []
    for i in range(ROWS):
        resp = [rng.randrange(vocab) for _ in range(length - PROMPT)]
        out.append(
            PurifiedTrajectory(
                run_id="b",
                iteration=0,
                prompt_id="p",
                sample_idx=i,
                mode="saar",
                gamma=0.5,
                raw_key=f"k{i}",
                prompt_ids=prompt,
                response_ids=resp,
                loss_mask=[1] * len(resp),
                old_logprobs=[-1.0] * len(resp),
                logprob_valid=[0] * len(resp),
                reward=1.0,
                advantage=(-1) ** i * 0.7,
                splices=[],
                recompute_from=0,
                tokens_forwarded=0,
                gate=True,
            )
        )
    return out


def child(kind: str, length: int, policy: str) -> dict:
    import torch

    torch.set_num_threads(2)
    rows = _rows(length)
    t0 = time.perf_counter()
    if kind == "recompute":
        from purifier.recompute import CPURecompute

        CPURecompute(Path(policy), threads=2).group(rows)
    elif kind == "update":
        from transformers import AutoModelForCausalLM

        from pipeline.config import TrainConfig
        from trainer.grpo import GRPOUpdate
        from trainer.inputs import UPDATE_ATTENTION

        model = AutoModelForCausalLM.from_pretrained(policy, dtype=torch.float32, attn_implementation=UPDATE_ATTENTION)
        GRPOUpdate(model, TrainConfig(mini_batches=1, warmup_steps=0)).minibatch([rows], model.config.pad_token_id)
    elif kind == "unchunked_recompute_1row":  # the pre-issue-16 recompute: full logits, log_softmax
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(policy, dtype=torch.float32, attn_implementation="eager").eval()
        with torch.inference_mode():
            logits = model(torch.tensor([rows[0].prompt_ids + rows[0].response_ids])).logits
            torch.log_softmax(logits.float(), dim=-1)
    wall = time.perf_counter() - t0
    return {"peak_rss_gib": peak_rss_bytes() / GIB, "wall_s": wall}


def _measure(kind: str, length: int, policy: Path) -> dict:
    out = subprocess.run(
        [sys.executable, "-m", "benchmarks.bench_scale", "--child", kind, str(length), str(policy)],
        capture_output=True,
        text=True,
        check=True,
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


def run(lengths: tuple[int, ...] = LENGTHS) -> BenchResult:
    from flows.init_policy import init_policy

    rows, notes = [], []
    with tempfile.TemporaryDirectory() as tmp:
        policy = Path(tmp) / "policy"
        init_policy(policy, log=lambda *_: None)
        base = _measure("unchunked_recompute_1row", 1024, policy)
        for kind in ("recompute", "update"):
            for n in lengths:
                m = _measure(kind, n, policy)
                rows.append(
                    Row(
                        f"{kind} {n} tokens peak RSS",
                        m["peak_rss_gib"],
                        unit="GiB",
                        higher_is_better=False,
                        target="<= 4 GiB" if n == 8192 else "",
                        passed=m["peak_rss_gib"] <= 4 if n == 8192 else None,
                    )
                )
                rows.append(Row(f"{kind} {n} tokens wall", m["wall_s"], unit="s", higher_is_better=False))
        logits_gib = 151_936 * 4 / GIB  # one position's float32 logits
        for n in lengths:
            est = ROWS * n * logits_gib * 2  # logits + log_softmax output, 8 rows (attention not counted)
            rows.append(Row(f"unchunked recompute {n} tokens (extrapolated)", est, unit="GiB", higher_is_better=False))
        rows.append(
            Row(
                "unchunked recompute 1 row × 1024 tokens (measured)",
                base["peak_rss_gib"],
                unit="GiB",
                higher_is_better=False,
            )
        )
    notes.append(
        "Policy: cleaner init-policy (Qwen3ForCausalLM, hidden 64, 2 layers, vocabulary 151,936); prompt 200 "
        "tokens + random response ids; every response token recomputed / trained; 2 torch threads."
    )
    notes.append(
        "Unchunked figures marked (extrapolated) are 8 rows × length × 151,936 × 4 B × 2 (logits and "
        "log_softmax), a lower bound that leaves out eager attention's length² scores; the 1-row 1k "
        "figure is measured."
    )
    return BenchResult(
        "scale",
        "Bounded memory at real lengths (issue 16): recompute and update on the "
        "Qwen3-shaped policy, peak RSS per child process.",
        rows,
        notes,
    )


if __name__ == "__main__":
    if sys.argv[1:2] == ["--child"]:
        print(json.dumps(child(sys.argv[2], int(sys.argv[3]), sys.argv[4])))
    else:
        from benchmarks.common import record

        record(run())
