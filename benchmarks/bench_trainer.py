"""The GRPO update: cleaner's OpenRLHF-based step vs TRL's GRPOTrainer loss + step, same tiny model and
batch, each side in its own process (for a clean peak-memory reading); and vs cleaner's own update as it was
before issue 29 (`before`: whole groups per micro-batch, lm_head at every position in checkpointed
512-position chunks), run in the same invocation, interleaved with `ours`, since this machine's speed varies
by up to 2x between hours. And vs the same update before each stage had a device of its own (`pre_devices`:
the code at commit PRE_DEVICES, extracted with `git archive` into a temporary folder, where this file's worker
runs on that tree's code), the cost of the device plumbing on the CPU."""

from __future__ import annotations

import json
import shutil
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.common import BenchResult, Row, peak_rss_bytes

STEPS = 5
ROUNDS = 2  # ours and before alternate this many times; each side reports its faster round
PRE_DEVICES = "e76a902"  # the last commit whose stages had no device setting


def _before_micro_batches(groups, token_budget: int, pad_id: int, device):
    """trainer.batches.micro_batches before issue 29: whole groups (split only when larger than the budget),
    in width order, so a group's short rows were padded to its longest."""
    from trainer.batches import collate

    def width_of(rows):
        return max(len(r.prompt_ids) + len(r.response_ids) for r in rows)

    packs = []
    for g in sorted(groups, key=width_of):
        if width_of(g) * len(g) <= token_budget:
            packs.append(g)
            continue
        run = []
        for r in sorted(g, key=lambda r: len(r.prompt_ids) + len(r.response_ids)):
            if run and width_of(run + [r]) * (len(run) + 1) > token_budget:
                packs.append(run)
                run = []
            run.append(r)
        packs.append(run)
    out, current, width = [], [], 0
    for pack in packs:
        new_width = max(width, width_of(pack))
        if current and new_width * (len(current) + len(pack)) > token_budget:
            out.append(collate(current, pad_id, device))
            current, new_width = [], width_of(pack)
        current += pack
        width = new_width
    if current:
        out.append(collate(current, pad_id, device))
    return out


def _before_action_log_probs(actor, sequences, action_mask, attention_mask, return_entropy=False):
    """trainer.chunked_actor.action_log_probs before issue 29: lm_head at every position, in checkpointed
    chunks of 512 positions whatever the vocabulary."""
    import torch

    from pipeline.logprobs import DEFAULT_CHUNK, split_causal_lm, token_logprobs

    body, head = split_causal_lm(actor.model)
    position_ids = attention_mask.long().cumsum(-1) - 1
    position_ids.masked_fill_(attention_mask == 0, 1)
    hidden = body(input_ids=sequences, attention_mask=attention_mask, position_ids=position_ids).last_hidden_state
    rolled = torch.roll(sequences, shifts=-1, dims=1)
    log_probs = token_logprobs(hidden, rolled, head, actor.temperature, DEFAULT_CHUNK)[:, :-1]
    return log_probs[:, -action_mask.shape[1] :] * action_mask.float(), None


def _rows(purified_file: Path):
    """The batch, from a plain Parquet file of purified rows, read as this code's purified schema: PRE_DEVICES's
    (purified/2) has today's columns and types, but refuses a committed purified/3 shard."""
    import pyarrow.parquet as pq

    from pipeline.trajectory import purified_from_row
    from storage.schemas import PURIFIED

    table = pq.read_table(purified_file).select(PURIFIED.names).cast(PURIFIED)
    return [purified_from_row(r) for r in table.to_pylist()]


def worker(side: str, purified_file: Path) -> dict:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from pipeline.config import DEFAULT_POLICY, TrainConfig

    torch.set_num_threads(1)
    rows = _rows(purified_file)
    root = purified_file.parent
    tokens = sum(sum(r.loss_mask) for r in rows)
    model = AutoModelForCausalLM.from_pretrained(DEFAULT_POLICY, dtype=torch.float32, attn_implementation="eager")
    cfg = TrainConfig(mini_batches=1, lr=1e-5, warmup_steps=0)  # default micro-batch budget
    base = peak_rss_bytes()
    if side in ("ours", "before"):
        import trainer.grpo
        from trainer.batches import mini_batches
        from trainer.grpo import GRPOUpdate

        if side == "before":
            trainer.grpo.micro_batches, trainer.grpo.action_log_probs = _before_micro_batches, _before_action_log_probs
        upd = GRPOUpdate(model, cfg)
        (groups,) = mini_batches(rows, 1)
        step = lambda: upd.minibatch(groups, 0)  # noqa: E731
    else:
        from datasets import Dataset
        from trl import GRPOConfig, GRPOTrainer

        tok = AutoTokenizer.from_pretrained(DEFAULT_POLICY)
        args = GRPOConfig(
            output_dir=str(root / "trl"),
            loss_type="dapo",
            beta=0.0,
            epsilon=0.2,
            epsilon_high=0.28,
            per_device_train_batch_size=len(rows),
            num_generations=4,
            report_to=[],
            use_cpu=True,
            bf16=False,
            save_strategy="no",
            learning_rate=cfg.lr,
            max_completion_length=512,
        )
        trainer = GRPOTrainer(
            model=model,
            reward_funcs=lambda completions, **kw: [0.0] * len(completions),
            args=args,
            train_dataset=Dataset.from_dict({"prompt": ["x"] * 8}),
            processing_class=tok,
        )
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
    return {
        "tokens_per_s": tokens / dt,
        "peak_rss_mib": peak / 2**20,
        "step_rss_mib": (peak - base) / 2**20,
        "tokens": tokens,
        "rows": len(rows),
    }


def run() -> BenchResult:
    import pyarrow.parquet as pq

    from benchmarks.common import archived_tree, tree_worker, vs_earlier
    from pipeline.config import load_config
    from purifier.stage import run_purify_stage
    from rollout_gen.stage import run_rollout_stage
    from pipeline.config import DEFAULT_POLICY
    from storage.layout import RunLayout
    from storage.schemas import PURIFIED
    from storage.shards import read_shard

    tmp = Path(tempfile.mkdtemp(prefix="bench-trainer-"))
    try:
        cfg = load_config(
            None,
            [
                f"storage.root={tmp}",
                "rollout.tasks_per_iteration=16",
                "rollout.samples_per_prompt=4",
                "purify.modes=[saar]",
                "purify.gammas=[0.5]",
            ],
        )
        run_rollout_stage(cfg, "bench", 0, DEFAULT_POLICY, show_progress=False)
        run_purify_stage(cfg, "bench", 0)
        batch = tmp / "purified.parquet"  # plain Parquet: each tree reads it as its own purified schema
        pq.write_table(read_shard(RunLayout(tmp, "bench").purified_dir(0, "saar", 0.5), PURIFIED), batch)
        res: dict[str, dict] = {}
        here, pre = Path(__file__).resolve().parent.parent, archived_tree(PRE_DEVICES, tmp)
        for side in ["ours", "before", "pre_devices"] * ROUNDS + ["trl"]:
            # pre_devices: this file's `ours`, on the code of PRE_DEVICES's tree
            tree, arg = (pre, "ours") if side == "pre_devices" else (here, side)
            got = tree_worker(tree, Path(__file__).resolve(), arg, str(batch))
            if side not in res or got["tokens_per_s"] > res[side]["tokens_per_s"]:
                res[side] = got
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    o, t, b, p = res["ours"], res["trl"], res["before"], res["pre_devices"]
    return BenchResult(
        "trainer",
        "One GRPO/DAPO optimizer step (clip 0.2/0.28, token-mean) on a purified batch of the "
        "tiny policy: cleaner (OpenRLHF Actor + PolicyLoss) vs TRL GRPOTrainer.compute_loss + AdamW step.",
        [
            Row(
                "update throughput",
                o["tokens_per_s"],
                t["tokens_per_s"],
                "trained tokens/s",
                target=">= 1.0× TRL",
                passed=o["tokens_per_s"] >= t["tokens_per_s"],
            ),
            Row("peak RSS of the process", o["peak_rss_mib"], t["peak_rss_mib"], "MiB", higher_is_better=False),
            Row(
                "update throughput vs cleaner before issue 29 (same run)",
                o["tokens_per_s"],
                b["tokens_per_s"],
                "trained tokens/s",
                target=">= 2,000 trained tokens/s",
                passed=o["tokens_per_s"] >= 2000,
            ),
            Row(
                "peak RSS vs cleaner before issue 29",
                o["peak_rss_mib"],
                b["peak_rss_mib"],
                "MiB",
                higher_is_better=False,
            ),
            vs_earlier(
                f"update throughput on the CPU vs cleaner before a device per stage ({PRE_DEVICES}, same run)",
                o["tokens_per_s"],
                p["tokens_per_s"],
                "trained tokens/s",
            ),
        ],
        [
            f"batch: {o['rows']} purified trajectories, {o['tokens']} trained tokens; mean of {STEPS} steps "
            "after one warm-up, one torch thread. cleaner packs the mini-batch's rows by length into micro-batches "
            f"(train.micro_batch_tokens, default 8192) with exact token-mean accumulation; TRL's step is "
            "one padded batch. Before issue 29 (baseline of the middle two rows): whole groups per micro-batch, "
            "so a group's longest row set the width its short rows were padded to, and lm_head at every position in "
            f"checkpointed 512-position chunks. ours and before alternate {ROUNDS} times; each reports its "
            "faster run",
            f"the last row: this file's worker on the code of commit {PRE_DEVICES} (git archive), before the "
            "stages had rollout/purify/train.device: micro-batches built row by row on the CPU; now "
            "built from host lists in one copy per tensor on train.device (the CPU here), with the "
            "update's model and optimizer at the fp32 default; alternated with ours",
        ],
    )


if __name__ == "__main__":
    print(json.dumps(worker(sys.argv[1], Path(sys.argv[2]))))
