"""The GPU check for an air-gapped CUDA machine (scripts/gpu_check.sh; the SGLang path: `--sglang`).

It runs with the machine's own Python, CUDA torch and transformers, no network, the few packages they lack
installed from build/wheelhouse (scripts/build_wheelhouse.sh) by the script. Models are built from config at
Qwen3-0.6B's and Qwen3-4B's shapes with the real tokenizer (policies/qwen3-tokenizer), random weights, nothing
downloaded. Sections, each in a process of its own (an OOM or an error is recorded and the run goes on; once
--budget seconds are spent the remaining ones are skipped):

- rollout: the project's engine (rollout_gen.engines.cpu.CPUEngine) on the device, rows of prompt + generated
  tokens up to --tokens; generated tokens/s and the sampled log-probs;
- recompute: purifier.recompute.CPURecompute over the same rows (every response token recomputed), tokens/s,
  and the gap |sampled − recomputed| per token;
- logprob gap: the update's own forward (trainer.chunked_actor.action_log_probs on OpenRLHF's Actor) over the
  same rows in fp32 and under bf16 autocast, |sampled − trainer| per token;
- updates: trainer.grpo.GRPOUpdate (local) and trainer.deepspeed_update.DeepSpeedGRPOUpdate (ZeRO-2/3, one
  rank: NCCL on a GPU, gloo on the CPU) on rows of --tokens tokens: trained tokens/s, MFU, peak memory beside
  trainer.memory's estimate.

Peak memory: torch.cuda.max_memory_allocated (a fresh process per section) on a GPU; on the CPU the process's
peak resident set (VmHWM, reset through /proc/self/clear_refs) above what it held before the model was built,
with glibc's mmap threshold fixed (MALLOC_MMAP_THRESHOLD_) so that freed tensors leave the resident set.
MFU: trainer.memory.model_flops_per_token (6 × parameters + causal attention; a checkpointed layer's recompute not
counted) × trained tokens/s over the card's dense bf16 peak.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import socket
import subprocess
import sys
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SCHEMA = 1
MMAP_THRESHOLD = "65536"

# Qwen3's published config.json values (the sizes; weights are random)
SHAPES: dict[str, dict] = {
    "qwen3-0.6b": dict(
        vocab_size=151936,
        hidden_size=1024,
        intermediate_size=3072,
        num_hidden_layers=28,
        num_attention_heads=16,
        num_key_value_heads=8,
        head_dim=128,
        tie_word_embeddings=True,
    ),
    "qwen3-4b": dict(
        vocab_size=151936,
        hidden_size=2560,
        intermediate_size=9728,
        num_hidden_layers=36,
        num_attention_heads=32,
        num_key_value_heads=8,
        head_dim=128,
        tie_word_embeddings=True,
    ),
    # the CPU test's: `cleaner init-policy`'s default width with the real vocabulary
    "tiny": dict(
        vocab_size=151936,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        tie_word_embeddings=True,
    ),
}
QWEN3_COMMON = dict(
    model_type="qwen3",
    max_position_embeddings=40960,
    rope_theta=1_000_000.0,
    rms_norm_eps=1e-6,
    bos_token_id=151643,
    eos_token_id=151645,
    pad_token_id=151643,
)
# dense bf16 tensor-core peak, FLOP/s, by the name torch reports (datasheets; sparsity not counted)
PEAK_BF16 = [
    ("H200", 989e12),
    ("H100 PCIe", 756e12),
    ("H100", 989e12),
    ("GH200", 989e12),
    ("A100", 312e12),
    ("L40S", 362e12),
    ("A10G", 70e12),
    ("L4", 121e12),
    ("B200", 2250e12),
]


def log(msg: str) -> None:
    print(f"[gpu-check] {msg}", file=sys.stderr, flush=True)


def config_of(shape: str) -> dict:
    return {**SHAPES[shape], **QWEN3_COMMON}


def peak_bf16(card: str) -> float | None:
    return next((rate for name, rate in PEAK_BF16 if name in card), None)


# ---- memory, measured the same way in every section ------------------------------------------------


class PeakMemory:
    """Peak bytes from `start()`: torch.cuda.max_memory_allocated on CUDA, the resident set's peak on the CPU."""

    def __init__(self, device) -> None:
        self.device = device

    @staticmethod
    def _status(field: str) -> int:
        text = Path("/proc/self/status").read_text()
        return int(re.search(rf"{field}:\s+(\d+) kB", text).group(1)) * 1024

    def start(self) -> None:
        import torch

        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats(self.device)
            self.base = 0  # the section's process allocated nothing on the GPU before
        else:
            Path("/proc/self/clear_refs").write_text("5")  # VmHWM := the current resident set
            self.base = self._status("VmRSS")

    def peak(self) -> int:
        import torch

        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            return int(torch.cuda.max_memory_allocated(self.device))
        return self._status("VmHWM") - self.base

    @property
    def how(self) -> str:
        return (
            "torch.cuda.max_memory_allocated"
            if self.device.type == "cuda"
            else "peak resident set (VmHWM) above the section's start, MALLOC_MMAP_THRESHOLD_=" + MMAP_THRESHOLD
        )


# ---- models and rows ------------------------------------------------------------------------------


def build_model(shape: str, device, attn: str = "sdpa", dtype=None):
    """A Qwen3ForCausalLM of the shape with random weights (seeded), made on `device`."""
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(0)
    config = Qwen3Config(**config_of(shape))
    with torch.device(device):
        return Qwen3ForCausalLM._from_config(config, attn_implementation=attn, dtype=dtype or torch.float32)


def write_checkpoint(shape: str, folder: Path) -> Path:
    """A checkpoint folder (bf16 safetensors, the real tokenizer) the engine and the recompute load."""
    import shutil

    import torch

    from pipeline.qwen3_tokenizer import TOKENIZER_DIR

    if folder.is_dir():
        return folder
    tmp = folder.with_name(folder.name + ".tmp")  # whole or absent: a killed run leaves no half checkpoint
    shutil.rmtree(tmp, ignore_errors=True)
    build_model(shape, "cpu", dtype=torch.bfloat16).save_pretrained(tmp, safe_serialization=True)
    for f in TOKENIZER_DIR.iterdir():
        if f.is_file() and f.suffix in (".json", ".jinja"):
            shutil.copy(f, tmp / f.name)
    tmp.rename(folder)
    return folder


def prompt_ids(tokens: int, seed: int) -> list[int]:
    """A prompt of real text through the real tokenizer, cut to `tokens` ids."""
    import random

    from transformers import AutoTokenizer

    from pipeline.qwen3_tokenizer import TOKENIZER_DIR

    tok = AutoTokenizer.from_pretrained(TOKENIZER_DIR)
    words = (ROOT / "README.md").read_text().split()
    rng = random.Random(seed)
    ids: list[int] = []
    while len(ids) < tokens:
        start = rng.randrange(len(words))
        ids += tok.encode(" ".join(words[start : start + 400]), add_special_tokens=False)
    return ids[:tokens]


def training_rows(groups: int, samples: int, tokens: int, prompt: int, vocab: int, seed: int = 0) -> list:
    """GRPO rows of `tokens` tokens each (`prompt` of them prompt), every response token trained, advantages ±1."""
    import random

    from trainer.batches import TrainingRow

    rng = random.Random(seed)
    rows = []
    for g in range(groups):
        p = [rng.randrange(vocab) for _ in range(prompt)]
        for s in range(samples):
            n = tokens - prompt
            rows.append(
                TrainingRow(
                    raw_key=f"r{g}-{s}",
                    prompt_id=f"p{g}",
                    sample_idx=s,
                    prompt_ids=p,
                    response_ids=[rng.randrange(vocab) for _ in range(n)],
                    loss_mask=[1] * n,
                    old_logprobs=[-rng.random() * 3 for _ in range(n)],
                    advantage=1.0 if s % 2 else -1.0,
                )
            )
    return rows


# ---- sections --------------------------------------------------------------------------------------


def _stats(values: list[float]) -> dict:
    import numpy as np

    a = np.asarray(values, dtype=np.float64)
    if not a.size:
        return {"count": 0}
    return {"count": int(a.size), "mean": float(a.mean()), "p99": float(np.percentile(a, 99)), "max": float(a.max())}


def section_rollout(args, device, work: Path) -> dict:
    from pipeline.engines.base import SamplingParams
    from rollout_gen.engines.cpu import CPUEngine

    ckpt = write_checkpoint(args.shape, work / f"ckpt-{args.shape}")
    prompt = prompt_ids(args.tokens - args.generate, seed=1)
    contexts = [prompt] * args.rows
    mem = PeakMemory(device)
    mem.start()  # the stage's whole footprint: its model too
    engine = CPUEngine(ckpt, device=device)
    t0 = time.perf_counter()
    gens = engine.generate(
        contexts,
        SamplingParams(max_new_tokens=args.generate, temperature=1.0),
        seeds=list(range(args.rows)),
        shared_prefix=[len(prompt)] * args.rows,
    )
    wall = time.perf_counter() - t0
    generated = sum(len(g.output_ids) for g in gens)
    (work / f"rollout-{args.shape}.json").write_text(
        json.dumps({"prompt": prompt, "rows": [{"ids": g.output_ids, "logprobs": g.logprobs} for g in gens]})
    )
    return {
        "rows": args.rows,
        "prompt_tokens": len(prompt),
        "generated_tokens": generated,
        "wall_s": wall,
        "tokens_per_s": generated / wall,
        "engine_dtype": str(next(engine.model.parameters()).dtype),
        "peak_bytes": mem.peak(),
        "peak_how": mem.how,
    }


def _rollout_rows(args, work: Path) -> tuple[list[int], list[dict]]:
    path = work / f"rollout-{args.shape}.json"
    if not path.is_file():
        raise RuntimeError(f"no rollout to score ({path.name}): the rollout section did not run")
    data = json.loads(path.read_text())
    return data["prompt"], data["rows"]


def section_recompute(args, device, work: Path) -> dict:
    from pipeline.trajectory import PurifiedTrajectory
    from purifier.recompute import CPURecompute

    prompt, rows = _rollout_rows(args, work)
    mem = PeakMemory(device)
    mem.start()
    rec = CPURecompute(work / f"ckpt-{args.shape}", device=device, threads=None)
    group = [
        PurifiedTrajectory(
            run_id="gpu-check",
            iteration=0,
            prompt_id="p0",
            sample_idx=i,
            mode="saar",
            gamma=0.5,
            raw_key=f"k{i}",
            prompt_ids=prompt,
            response_ids=r["ids"],
            loss_mask=[1] * len(r["ids"]),
            old_logprobs=[0.0] * len(r["ids"]),
            logprob_valid=[0] * len(r["ids"]),
            reward=0.0,
            advantage=0.0,
            splices=[],
            recompute_from=0,
            tokens_forwarded=0,
            gate=True,
        )
        for i, r in enumerate(rows)
    ]
    t0 = time.perf_counter()
    out = rec.group(group)
    wall = time.perf_counter() - t0
    gap = [abs(a - b) for r, o in zip(rows, out) for a, b in zip(r["logprobs"], o.old_logprobs)]
    tokens = sum(len(r["ids"]) for r in rows)
    return {
        "scored_tokens": tokens,
        "wall_s": wall,
        "tokens_per_s": tokens / wall,
        "gap_vs_sampled": _stats(gap),
        "peak_bytes": mem.peak(),
        "peak_how": mem.how,
    }


def section_gap(args, device, work: Path) -> dict:
    """|sampled − the update's forward| per generated token, the trainer in fp32 and under bf16 autocast."""
    import torch

    from pipeline.config import TrainConfig
    from pipeline.policy_model import load_causal_lm
    from trainer.batches import TrainingRow, collate
    from trainer.chunked_actor import action_log_probs
    from trainer.grpo import make_actor

    prompt, rows = _rollout_rows(args, work)
    mem = PeakMemory(device)
    mem.start()
    model = load_causal_lm(work / f"ckpt-{args.shape}", attn_implementation="sdpa", device=device).eval()
    actor = make_actor(model, TrainConfig(), 1.0)
    out = {}
    for dtype in ("fp32", "bf16"):
        gap = []
        for i, r in enumerate(rows):
            n = len(r["ids"])
            m = collate(
                [
                    TrainingRow(
                        raw_key=f"k{i}",
                        prompt_id="p0",
                        sample_idx=i,
                        prompt_ids=prompt,
                        response_ids=r["ids"],
                        loss_mask=[1] * n,
                        old_logprobs=[0.0] * n,
                        advantage=0.0,
                    )
                ],
                0,
                device,
            )
            with torch.no_grad(), torch.autocast(device.type, dtype=torch.bfloat16, enabled=dtype == "bf16"):
                logp, _ = action_log_probs(actor, m.sequences, m.action_mask, m.attention_mask)
            got = logp[0, len(prompt) - 1 : len(prompt) - 1 + n].float().tolist()
            gap += [abs(a - b) for a, b in zip(r["logprobs"], got)]
        out[dtype] = _stats(gap)
    return {
        "trainer_vs_sampled": out,
        "peak_bytes": mem.peak(),
        "peak_how": mem.how,
        "what": "|log-prob the engine sampled with − the update's forward| per generated token, nats; the engine "
        "computes in the checkpoint's weights upcast to fp32",
    }


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def section_update(args, device, work: Path) -> dict:
    """One update of 2 mini-batches (the second with AdamW's state present, each of 2 micro-batches) on rows of
    --tokens tokens: trained tokens/s of the second, the peak, and trainer.memory's estimate beside it."""
    settings = dict(
        strategy=args.strategy,
        zero_stage=args.zero_stage,
        param_dtype=args.dtype,
        gradient_checkpointing=args.checkpointing,
        offload_optimizer=args.offload,
    )
    return measure_update(config_of(args.shape), args.shape, settings, args.tokens, device)


def measure_update(config: dict, name: str, settings: dict, tokens: int, device) -> dict:
    """The update (local or DeepSpeed on one rank) of a model built from `config` (a config.json's fields) with
    train.* `settings`, on 2 groups × 2 rows of `tokens` tokens: measured beside trainer.memory's estimate."""
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from pipeline.config import CleanerConfig, TrainConfig
    from trainer.devices import check_device
    from trainer.grpo import UpdateProgress
    from trainer.memory import ModelShape, Plan, estimate, model_flops_per_token

    fields = TrainConfig.model_fields
    cfg = TrainConfig(
        **{
            k: v
            for k, v in {
                **settings,
                "micro_batch_tokens": tokens,
                "mini_batches": 2,
                "device": str(device),
                "lr": 1e-5,
            }.items()
            if k in fields
        }
    )
    check_device(CleanerConfig(train=cfg))  # the update stage's own preflight: its refusals are findings too
    shape = ModelShape.from_config(config, name)
    plan = Plan.from_train(cfg, tokens, ranks=1, device=device.type)
    # a short prompt, as in agentic rows (a few hundred tokens of 8k): the estimate assumes every position trained
    rows = training_rows(groups=2, samples=2, tokens=tokens, prompt=min(256, tokens // 8), vocab=shape.vocab)
    mem = PeakMemory(device)
    full = {**QWEN3_COMMON, **config}
    if full["pad_token_id"] >= shape.vocab:  # a test's small vocabulary
        full.update(pad_token_id=0, bos_token_id=0, eos_token_id=1)

    def model_on(where):
        torch.manual_seed(0)
        with torch.device(where):
            return Qwen3ForCausalLM._from_config(
                Qwen3Config(**full), attn_implementation=cfg.attn_implementation, dtype=torch.float32
            )

    widest: list[int] = []  # positions per lm_head call: the log-prob head's chunking, seen from the model

    def watched(model):
        model.get_output_embeddings().register_forward_hook(
            lambda _m, args, _o: widest.append(args[0].numel() // args[0].shape[-1])
        )
        return model

    if cfg.strategy == "deepspeed":
        from trainer.deepspeed_update import DeepSpeedGRPOUpdate, make_strategy

        os.environ.update(
            RANK="0",
            WORLD_SIZE="1",
            LOCAL_RANK="0",
            LOCAL_WORLD_SIZE="1",
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(_free_port()),
        )
        strategy = make_strategy(cfg, device)
        mem.start()
        # DeepSpeed moves the model to the rank's device
        update = DeepSpeedGRPOUpdate(watched(model_on("cpu")), cfg, strategy, 1.0)
    else:
        from trainer.grpo import GRPOUpdate

        mem.start()
        update = GRPOUpdate(watched(model_on(device)), cfg, 1.0, device)
    progress = update.run(rows, full["pad_token_id"], UpdateProgress())
    last = progress.metrics[-1]
    peak = mem.peak()
    del update
    est = estimate(shape, plan)
    tokens_per_s = last.tokens / last.seconds
    out = {
        "strategy": cfg.strategy,
        "zero_stage": cfg.zero_stage if cfg.strategy == "deepspeed" else None,
        "param_dtype": cfg.param_dtype,
        "gradient_checkpointing": plan.gradient_checkpointing,
        "offload_optimizer": plan.offload_optimizer,
        "row_tokens": tokens,
        "parameters": shape.parameters,
        "steps": len(progress.metrics),
        "trained_tokens": last.tokens,
        "step_s": last.seconds,
        "tokens_per_s": tokens_per_s,
        "loss_finite": all(m.loss == m.loss for m in progress.metrics),
        "widest_head_call": max(widest, default=0),
        "peak_bytes": peak,
        "peak_how": mem.how,
        "estimate_bytes": est.peak,
        "estimate_ratio": est.peak / peak if peak > 0 else None,
        "estimate_terms": dict(est.terms),
        "offloaded_bytes": est.cpu_bytes,
    }
    flops = model_flops_per_token(shape, tokens) * tokens_per_s
    rate = peak_bf16(torch.cuda.get_device_name(device)) if device.type == "cuda" else None
    out["model_flops_per_s"] = flops
    out["mfu"] = flops / rate if rate else None
    return out


def measure_cpu(specs_path: Path, result_path: Path) -> int:
    """`--measure-cpu SPECS RESULT`: measure_update on the CPU for each {config, settings, tokens} of SPECS, one
    after another in this process (the resident set's peak is reset before each), results as JSON."""
    import gc

    import torch

    out = []
    for spec in json.loads(specs_path.read_text()):
        out.append(
            measure_update(
                spec["config"], spec.get("name", "custom"), spec["settings"], spec["tokens"], torch.device("cpu")
            )
        )
        gc.collect()
    result_path.write_text(json.dumps(out))
    return 0


SECTIONS = {"rollout": section_rollout, "recompute": section_recompute, "gap": section_gap, "update": section_update}


def run_section(argv: list[str]) -> int:
    """`--section NAME ...`: one section in this process; its result (or its error) as JSON in --result."""
    ap = argparse.ArgumentParser()
    ap.add_argument("--section", required=True, choices=sorted(SECTIONS))
    ap.add_argument("--shape", required=True, choices=sorted(SHAPES))
    ap.add_argument("--device", required=True)
    ap.add_argument("--work", type=Path, required=True)
    ap.add_argument("--result", type=Path, required=True)
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--generate", type=int, default=256)
    ap.add_argument("--rows", type=int, default=4)
    ap.add_argument("--strategy", default="local")
    ap.add_argument("--zero-stage", type=int, default=2)
    ap.add_argument("--dtype", default="bf16")
    ap.add_argument("--checkpointing", action="store_true")
    ap.add_argument("--offload", action="store_true")
    args = ap.parse_args(argv)
    import torch

    from pipeline.devices import resolve_device

    device = resolve_device(args.device, "--device")
    try:
        result = {"ok": True, **SECTIONS[args.section](args, device, args.work)}
    except torch.cuda.OutOfMemoryError as e:
        result = {
            "ok": False,
            "error": f"out of memory: {str(e).splitlines()[0][:300]}",
            "peak_bytes": torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None,
        }
    except Exception as e:  # noqa: BLE001 - a section's failure is a finding, recorded, and the run goes on
        result = {
            "ok": False,
            "error": f"{type(e).__name__}: {str(e).splitlines()[0][:300] if str(e) else ''}",
            "traceback": traceback.format_exc()[-3000:],
        }
    args.result.write_text(json.dumps(result))
    return 0


# ---- the plan and the driver ---------------------------------------------------------------------


def plan_sections(shapes: list[str], strategies: list[str], ds_dtype: str) -> list[dict]:
    """In order of what matters most (a spent budget skips the tail): the smaller shape's rollout, recompute,
    gap and updates, then the larger's updates (the larger's rollout last: it saves a checkpoint first)."""
    out = []
    for shape in shapes:
        big = shape == "qwen3-4b"
        if not big:
            out += [
                dict(section="rollout", shape=shape),
                dict(section="recompute", shape=shape),
                dict(section="gap", shape=shape),
            ]
        if "local" in strategies:
            out.append(dict(section="update", shape=shape, strategy="local", dtype="bf16", checkpointing=big))
        if "deepspeed" in strategies:
            for stage in (2, 3):
                out.append(
                    dict(
                        section="update",
                        shape=shape,
                        strategy="deepspeed",
                        zero_stage=stage,
                        dtype=ds_dtype,
                        checkpointing=big,
                        offload=big and stage == 3,
                    )
                )
    return out


def section_name(s: dict) -> str:
    if s["section"] != "update":
        return f"{s['section']} {s['shape']}"
    how = "local" if s["strategy"] == "local" else f"deepspeed ZeRO-{s['zero_stage']}"
    extra = "".join([" +ckpt" if s.get("checkpointing") else "", " +offload" if s.get("offload") else ""])
    return f"update {how} {s['dtype']}{extra} {s['shape']}"


def versions() -> dict:
    import importlib.metadata as md

    out = {"python": platform.python_version()}
    for name in (
        "torch",
        "transformers",
        "tokenizers",
        "numpy",
        "pyarrow",
        "protobuf",
        "typing_extensions",
        "pydantic",
        "rapidfuzz",
        "deepspeed",
        "openrlhf",
        "flash_attn",
        "peft",
        "accelerate",
    ):
        try:
            out[name] = md.version(name)
        except md.PackageNotFoundError:
            out[name] = None
    return out


def card(device: str) -> dict:
    import torch

    if not device.startswith("cuda"):
        return {"name": "cpu", "memory_bytes": None, "cuda": None}
    props = torch.cuda.get_device_properties(torch.device(device))
    return {
        "name": props.name,
        "memory_bytes": props.total_memory,
        "cuda": torch.version.cuda,
        "peak_bf16_flops": peak_bf16(props.name),
    }


def drive(args) -> dict:
    from benchmarks.common import machine_info

    args.out.mkdir(parents=True, exist_ok=True)
    work = args.out / "work"
    work.mkdir(exist_ok=True)
    for stale in [*work.glob("result-*.json"), *work.glob("rollout-*.json")]:  # a previous run's (checkpoints stay)
        stale.unlink()
    t_start = time.monotonic()
    report = {
        "schema": SCHEMA,
        "when": time.strftime("%Y-%m-%d %H:%M:%S"),
        "device": args.device,
        "card": card(args.device),
        "machine": machine_info(),  # the host the card sits in, for RESULTS.md wherever the report is recorded
        "versions": versions(),
        "tokens": args.tokens,
        "budget_s": args.budget,
        "sections": [],
    }
    env = {
        **os.environ,
        "MALLOC_MMAP_THRESHOLD_": MMAP_THRESHOLD,
        "PYTHONUNBUFFERED": "1",
        "TOKENIZERS_PARALLELISM": "false",
    }
    for s in plan_sections(args.shapes, args.strategies, args.ds_dtype):
        name = section_name(s)
        if args.only and not any(word in name for word in args.only):
            continue
        left = args.budget - (time.monotonic() - t_start)
        entry = {"name": name, **s}
        if left < 5:
            entry.update(ok=False, skipped=True, error="skipped: the time budget (--budget) was spent")
            report["sections"].append(entry)
            continue
        result = work / f"result-{len(report['sections'])}.json"
        cmd = [
            sys.executable,
            "-m",
            "benchmarks.gpu_check",
            "--section",
            s["section"],
            "--shape",
            s["shape"],
            "--device",
            args.device,
            "--work",
            str(work),
            "--result",
            str(result),
            "--tokens",
            str(args.tokens),
            "--generate",
            str(args.generate),
            "--rows",
            str(args.rows),
        ]
        if s["section"] == "update":
            cmd += ["--strategy", s["strategy"], "--zero-stage", str(s.get("zero_stage", 2)), "--dtype", s["dtype"]]
            cmd += ["--checkpointing"] * bool(s.get("checkpointing")) + ["--offload"] * bool(s.get("offload"))
        log(f"{name} (budget left {left:.0f} s)")
        t0 = time.perf_counter()
        try:
            done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=left)
            if result.is_file():
                entry.update(json.loads(result.read_text()))
            else:
                tail = [ln for ln in (done.stderr or "").splitlines() if ln.strip()][-1:] or ["no output"]
                entry.update(ok=False, error=f"the section's process exited {done.returncode}: {tail[0][:300]}")
        except subprocess.TimeoutExpired:
            entry.update(ok=False, error=f"stopped: the time budget ran out after {time.perf_counter() - t0:.0f} s")
        entry["wall_s"] = time.perf_counter() - t0
        log(f"  {'ok' if entry.get('ok') else entry.get('error')} ({entry['wall_s']:.1f} s)")
        report["sections"].append(entry)
    report["wall_s"] = time.monotonic() - t_start
    (args.out / "report.json").write_text(json.dumps(report, indent=1))
    (args.out / "report.md").write_text(render_markdown(report))
    return report


def _gib(x) -> str:
    return "—" if x is None else f"{x / 2**30:.2f}"


def render_markdown(r: dict) -> str:
    """The gpu section of benchmarks/RESULTS.md from a report."""
    c = r["card"]
    lines = [
        f"GPU check (`scripts/gpu_check.sh`), {r['when']}, on {c['name']}"
        + (f" ({_gib(c['memory_bytes'])} GiB, CUDA {c['cuda']})" if c.get("memory_bytes") else ""),
        f"{r['tokens']}-token trajectories, random weights at Qwen3 shapes with the real tokenizer; versions: "
        + ", ".join(f"{k} {v}" for k, v in r["versions"].items() if v),
        "",
        "| section | result | tokens/s | MFU | peak GiB | estimate GiB | estimate / peak | widest lm_head call |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for s in r["sections"]:
        if not s.get("ok"):
            lines.append(f"| {s['name']} | {s.get('error', '?')} | | | {_gib(s.get('peak_bytes'))} | | | |")
            continue
        mfu = f"{s['mfu']:.1%}" if s.get("mfu") else "—"
        ratio = f"{s['estimate_ratio']:.2f}" if s.get("estimate_ratio") else "—"
        rate = f"{s['tokens_per_s']:.0f}" if s.get("tokens_per_s") else "—"
        lines.append(
            f"| {s['name']} | ok | {rate} | {mfu} | {_gib(s.get('peak_bytes'))} | "
            f"{_gib(s.get('estimate_bytes'))} | {ratio} | {s.get('widest_head_call') or '—'} |"
        )
    gaps = [s for s in r["sections"] if s.get("ok") and ("trainer_vs_sampled" in s or "gap_vs_sampled" in s)]
    if gaps:
        lines += ["", "| log-prob gap vs sampled (nats/token) | mean | p99 | max |", "|---|---|---|---|"]
        for s in gaps:
            pairs = (
                [(f"recompute ({s['shape']})", s["gap_vs_sampled"])]
                if "gap_vs_sampled" in s
                else [(f"update forward {k} ({s['shape']})", v) for k, v in s["trainer_vs_sampled"].items()]
            )
            for label, st in pairs:
                if st.get("count"):
                    lines.append(f"| {label} | {st['mean']:.2e} | {st['p99']:.2e} | {st['max']:.2e} |")
    lines += [
        "",
        "Peak: " + next((s["peak_how"] for s in r["sections"] if s.get("peak_how")), "—") + "; estimate: "
        "trainer/memory.py (`cleaner fit`). MFU: (6 × parameters + causal attention) FLOPs per trained token × "
        "tokens/s over the card's dense bf16 peak; recomputed (checkpointed) forwards not counted. Widest lm_head "
        "call: the most positions one call of the update's log-prob head took (chunks of 512 at Qwen3's vocabulary).",
        "",
    ]
    return "\n".join(lines)


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):  # one line, like the check's other refusals
        print(f"gpu_check: {message} (scripts/gpu_check.sh --help)", file=sys.stderr)
        sys.exit(2)


def record_results(r: dict) -> None:
    """The gpu section of benchmarks/RESULTS.md from a GPU run's report (benchmarks.common.record): per section
    its tokens/s, MFU and peak with the estimate as the peak's baseline, and the log-prob gaps."""
    from benchmarks.common import BenchResult, Row, record

    rows = []
    for s in r["sections"]:
        if not s.get("ok"):
            continue
        if s.get("tokens_per_s"):
            rows.append(Row(f"{s['name']} tokens/s", s["tokens_per_s"], unit="tokens/s"))
        if s.get("mfu"):
            rows.append(Row(f"{s['name']} MFU", s["mfu"], target=">= 0.35" if "0.6b" in s["name"] else ""))
        if s.get("peak_bytes"):
            rows.append(
                Row(
                    f"{s['name']} peak",
                    s["peak_bytes"] / 2**30,
                    baseline=(s.get("estimate_bytes") or 0) / 2**30 or None,
                    unit="GiB; baseline: estimate",
                    higher_is_better=False,
                )
            )
        gaps = s.get("trainer_vs_sampled") or ({"recompute": s["gap_vs_sampled"]} if "gap_vs_sampled" in s else {})
        for kind, st in gaps.items():
            if st.get("count"):
                rows.append(
                    Row(
                        f"{s['name']} gap sampled vs {kind}, mean",
                        st["mean"],
                        unit="nats/token",
                        higher_is_better=False,
                    )
                )
    failed = [f"{s['name']}: {s.get('error')}" for s in r["sections"] if not s.get("ok")]
    c = r["card"]
    record(
        BenchResult(
            "gpu",
            f"`scripts/gpu_check.sh` on {c['name']} (CUDA {c.get('cuda')}), {r['tokens']}-token "
            "trajectories at Qwen3-0.6B and Qwen3-4B shapes (random weights, the real tokenizer)",
            rows,
            notes=[ln for ln in render_markdown(r).splitlines() if ln.startswith("Peak:")] + failed,
            # the machine and time of the run, not of the checkout that records it (`--record-from`)
            machine=r.get("machine") or {k: r["versions"].get(k) for k in ("python", "torch")},
            when=r["when"],
        )
    )


def _refuse(message: str) -> int:
    print(f"gpu_check: {message}", file=sys.stderr)
    return 2


def record_from(path: Path) -> int:
    """`--record-from`: a GPU machine's report.json into RESULTS.md here; one line and exit 2 for a file that is not
    one (missing, not JSON, without its card or sections, or a CPU run's, which has no GPU figures)."""
    try:
        report = json.loads(path.read_text())
        name, sections = report["card"]["name"], report["sections"]
    except KeyError as e:
        return _refuse(f"--record-from {path}: not a GPU check's report.json (no field {e})")
    except (OSError, ValueError, TypeError) as e:
        return _refuse(f"--record-from {path}: not a GPU check's report.json ({e})")
    if name == "cpu":
        return _refuse(f"--record-from {path}: a --device cpu run's report has no GPU figures")
    record_results(report)
    ok = sum(bool(s.get("ok")) for s in sections)
    log(f"wrote the gpu section of benchmarks/RESULTS.md from {path} ({name}, {ok}/{len(sections)} sections ok)")
    return 0


def parse(argv: list[str]) -> argparse.Namespace:
    ap = _Parser(
        prog="scripts/gpu_check.sh",
        description=(
            "The GPU check for an air-gapped CUDA machine: rollout, recompute, log-prob gap, local and DeepSpeed "
            "updates at Qwen3-0.6B and Qwen3-4B shapes; report.json + report.md (RESULTS.md's gpu section) "
            "under --out. "
            "`scripts/gpu_check.sh --sglang --help`: the SGLang path for connected machines."
        ),
    )
    ap.add_argument("--device", default="cuda", help="cuda, cuda:N, or cpu (the same logic on the CPU, tiny shapes)")
    ap.add_argument(
        "--shapes",
        nargs="+",
        default=None,
        choices=sorted(SHAPES),
        help="default: qwen3-0.6b qwen3-4b on a GPU, tiny on the CPU",
    )
    ap.add_argument("--strategies", nargs="+", default=["local", "deepspeed"], choices=["local", "deepspeed"])
    ap.add_argument("--tokens", type=int, default=8192, help="trajectory tokens (default 8192)")
    ap.add_argument("--generate", type=int, default=256, help="tokens the rollout generates per row")
    ap.add_argument("--rows", type=int, default=4, help="rows the rollout generates")
    ap.add_argument("--ds-dtype", default="bf16", choices=["fp32", "bf16", "fp16"])
    ap.add_argument(
        "--only",
        nargs="+",
        metavar="WORD",
        help="only the sections whose name holds one of these words "
        "(e.g. --only update 'rollout qwen3-0.6b'); a rerun of what failed",
    )
    ap.add_argument("--budget", type=float, default=330.0, help="seconds; sections after it are skipped (default 330)")
    ap.add_argument("--out", type=Path, default=ROOT / "workspace" / "gpu-check")
    ap.add_argument("--record", action="store_true", help="write the report into benchmarks/RESULTS.md (gpu section)")
    ap.add_argument(
        "--record-from",
        type=Path,
        metavar="REPORT_JSON",
        help="write a report.json that a GPU machine wrote into this checkout's benchmarks/RESULTS.md (gpu section) "
        "and run nothing: for a check run elsewhere whose report came back as a file",
    )
    args = ap.parse_args(argv)
    if args.record and args.device == "cpu":
        ap.error("--record writes GPU figures into benchmarks/RESULTS.md; a --device cpu run has none")
    if args.shapes is None:
        args.shapes = ["tiny"] if args.device == "cpu" else ["qwen3-0.6b", "qwen3-4b"]
    if args.generate >= args.tokens:
        ap.error(f"--generate {args.generate} must be below --tokens {args.tokens}")
    return args


def main(argv: list[str]) -> int:
    if "--section" in argv:
        return run_section(argv)
    if argv[:1] == ["--measure-cpu"]:
        return measure_cpu(Path(argv[1]), Path(argv[2]))
    args = parse(argv)
    if args.record_from:
        return record_from(args.record_from)
    import torch

    if args.device.startswith("cuda") and not torch.cuda.is_available():
        print(
            f"gpu_check: --device {args.device}: no CUDA device here (torch {torch.__version__}); "
            "--device cpu runs the same logic on the CPU",
            file=sys.stderr,
        )
        return 2
    report = drive(args)
    if args.record:
        record_results(report)
        log("wrote the gpu section of benchmarks/RESULTS.md")
    failed = [s["name"] for s in report["sections"] if not s.get("ok")]
    log(
        f"report: {args.out / 'report.json'}, {args.out / 'report.md'}; "
        + (f"{len(failed)} section(s) did not finish: {', '.join(failed)}" if failed else "every section ok")
    )
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
