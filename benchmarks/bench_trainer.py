"""The GRPO update: cleaner's OpenRLHF-based step vs TRL's GRPOTrainer loss + step, same tiny model and
batch, each side in its own process (for a clean peak-memory reading)."""
from __future__ import annotations

import json
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.common import BenchResult, Row, peak_rss_bytes

STEPS = 5


def _rows(root: Path):
    from pipeline.trajectory import purified_from_row
    from storage.layout import RunLayout
    from storage.schemas import PURIFIED
    from storage.shards import read_shard

    d = RunLayout(root, "bench").purified_dir(0, "saar", 0.5)
    return [purified_from_row(r) for r in read_shard(d, PURIFIED).to_pylist()]


def worker(side: str, root: Path) -> dict:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from pipeline.config import DEFAULT_POLICY, TrainConfig

    torch.set_num_threads(1)
    rows = _rows(root)
    tokens = sum(sum(r.loss_mask) for r in rows)
    model = AutoModelForCausalLM.from_pretrained(DEFAULT_POLICY, dtype=torch.float32, attn_implementation="eager")
    cfg = TrainConfig(mini_batches=1, lr=1e-5, warmup_steps=0)  # default micro-batch budget
    base = peak_rss_bytes()
    if side == "ours":
        from trainer.batches import mini_batches
        from trainer.grpo import GRPOUpdate

        upd = GRPOUpdate(model, cfg)
        (groups,) = mini_batches(rows, 1)
        step = lambda: upd.minibatch(groups, 0)  # noqa: E731
    else:
        from datasets import Dataset
        from trl import GRPOConfig, GRPOTrainer

        tok = AutoTokenizer.from_pretrained(DEFAULT_POLICY)
        args = GRPOConfig(output_dir=str(root / "trl"), loss_type="dapo", beta=0.0, epsilon=0.2, epsilon_high=0.28,
                          per_device_train_batch_size=len(rows), num_generations=4, report_to=[], use_cpu=True,
                          bf16=False, save_strategy="no", learning_rate=cfg.lr, max_completion_length=512)
        trainer = GRPOTrainer(model=model, reward_funcs=lambda completions, **kw: [0.0] * len(completions), args=args,
                              train_dataset=Dataset.from_dict({"prompt": ["x"] * 8}), processing_class=tok)
        P = max(len(r.prompt_ids) for r in rows)
        C = max(len(r.response_ids) for r in rows)
        pad = tok.pad_token_id
        inputs = {
            "prompt_ids": torch.tensor([[pad] * (P - len(r.prompt_ids)) + r.prompt_ids for r in rows]),
            "prompt_mask": torch.tensor([[0] * (P - len(r.prompt_ids)) + [1] * len(r.prompt_ids) for r in rows]),
            "completion_ids": torch.tensor([r.response_ids + [pad] * (C - len(r.response_ids)) for r in rows]),
            "completion_mask": torch.tensor([r.loss_mask + [0] * (C - len(r.response_ids)) for r in rows]),
            "advantages": torch.tensor([r.advantage for r in rows], dtype=torch.float),
            "old_per_token_logps": torch.tensor([r.old_logprobs + [0.0] * (C - len(r.response_ids)) for r in rows]),
            "num_items_in_batch": torch.tensor(float(tokens)),
        }
        opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr)
        trainer.current_gradient_accumulation_steps = 1  # set by Trainer.train(); we drive single steps

        def step():
            model.train()
            opt.zero_grad()
            loss = trainer.compute_loss(model, inputs)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
    step()  # warm-up
    t0 = time.perf_counter()
    for _ in range(STEPS):
        step()
    dt = (time.perf_counter() - t0) / STEPS
    peak = peak_rss_bytes()
    return {"tokens_per_s": tokens / dt, "peak_rss_mib": peak / 2**20, "step_rss_mib": (peak - base) / 2**20,
            "tokens": tokens, "rows": len(rows)}


def run() -> BenchResult:
    from pipeline.config import load_config
    from purifier.stage import run_purify_stage
    from rollout_gen.stage import run_rollout_stage
    from pipeline.config import DEFAULT_POLICY

    tmp = Path(tempfile.mkdtemp(prefix="bench-trainer-"))
    try:
        cfg = load_config(None, [f"storage.root={tmp}", "rollout.tasks_per_iteration=16", "rollout.samples_per_prompt=4",
                                 "purify.modes=[saar]", "purify.gammas=[0.5]"])
        run_rollout_stage(cfg, "bench", 0, DEFAULT_POLICY, show_progress=False)
        run_purify_stage(cfg, "bench", 0)
        res = {}
        for side in ("ours", "trl"):
            out = subprocess.run([sys.executable, "-m", "benchmarks.bench_trainer", side, str(tmp)], capture_output=True,
                                 text=True, check=True, cwd=Path(__file__).resolve().parent.parent)
            res[side] = json.loads(out.stdout.strip().splitlines()[-1])
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    o, t = res["ours"], res["trl"]
    return BenchResult("trainer", "One GRPO/DAPO optimizer step (clip 0.2/0.28, token-mean) on a purified batch of the "
                       "tiny policy: cleaner (OpenRLHF Actor + PolicyLoss) vs TRL GRPOTrainer.compute_loss + AdamW step.",
                       [Row("update throughput", o["tokens_per_s"], t["tokens_per_s"], "trained tokens/s",
                            target=">= 1.0× TRL", passed=o["tokens_per_s"] >= t["tokens_per_s"]),
                        Row("peak RSS of the process", o["peak_rss_mib"], t["peak_rss_mib"], "MiB",
                            higher_is_better=False)],
                       [f"batch: {o['rows']} purified trajectories, {o['tokens']} trained tokens; mean of {STEPS} steps "
                        "after one warm-up, one torch thread. cleaner packs whole groups into length-sorted micro-batches "
                        f"(train.micro_batch_tokens, default 8192) with exact token-mean accumulation; TRL's step is "
                        "one padded batch"])


if __name__ == "__main__":
    print(json.dumps(worker(sys.argv[1], Path(sys.argv[2]))))
