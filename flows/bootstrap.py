"""`cleaner bootstrap`: build the world's corpus and tokenizer, train the tiny policy, save it.

The committed policy under policies/tiny-tool-policy was produced by this recipe; its
PROVENANCE.json records the exact settings, sizes and wall times.
"""

from __future__ import annotations

import json
import platform
import random
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from transformers import GenerationConfig, Qwen3Config, Qwen3ForCausalLM

from pipeline.chat import IM_END, ChatFormat
from pipeline.config import SandboxConfig, WorldConfig
from rollout_gen.sandbox import SandboxPool
from rollout_gen.world.corpus import build_transcripts, tokenize_transcript
from rollout_gen.world.tasks import training_tasks
from rollout_gen.world.tokenizer import train_tokenizer
from trainer.sft import SFTConfig, train_sft


@dataclass
class BootstrapConfig:
    corpus_size: int = 12_000
    bug_rate: float = 1 / 3
    vocab_size: int = 1024
    hidden_size: int = 128
    layers: int = 4
    heads: int = 4
    ffn: int = 512
    max_positions: int = 1024
    seed: int = 0
    sft: SFTConfig = field(default_factory=SFTConfig)
    world: WorldConfig = field(default_factory=lambda: WorldConfig(digits_max=4))


def model_config(cfg: BootstrapConfig, tokenizer) -> Qwen3Config:
    return Qwen3Config(
        vocab_size=len(tokenizer),
        hidden_size=cfg.hidden_size,
        intermediate_size=cfg.ffn,
        num_hidden_layers=cfg.layers,
        num_attention_heads=cfg.heads,
        num_key_value_heads=cfg.heads,
        head_dim=cfg.hidden_size // cfg.heads,
        max_position_embeddings=cfg.max_positions,
        tie_word_embeddings=True,
        rope_theta=10000.0,
        bos_token_id=tokenizer.convert_tokens_to_ids(IM_END),
        eos_token_id=tokenizer.convert_tokens_to_ids(IM_END),
        pad_token_id=tokenizer.pad_token_id,
    )


def bootstrap(out_dir: Path, cfg: BootstrapConfig, log=print) -> dict:
    t_start = time.perf_counter()
    random.seed(cfg.seed)
    tasks = training_tasks(cfg.world, cfg.corpus_size, seed=cfg.seed + 10_000)
    log(f"[bootstrap] corpus: {len(tasks)} transcripts, tool outputs from the real sandbox ...")
    with SandboxPool(SandboxConfig(workers=2)) as pool:
        transcripts = build_transcripts(tasks, pool, cfg.seed, cfg.bug_rate)
    t_corpus = time.perf_counter() - t_start

    # The tokenizer learns from rendered transcripts, system prompt and tool list included. The chat
    # template needs some tokenizer to render with, hence a throwaway one; the text is the prompt up to
    # the question (the committed policy's tokenizer was trained on exactly these texts).
    probe_tok = train_tokenizer(["x"], vocab_size=300)
    prompt_text = ChatFormat(probe_tok).decode(ChatFormat(probe_tok).prompt_ids("Q"))[
        : -len("Q<|im_end|>\n<|im_start|>assistant\n")
    ]
    texts = [prompt_text + t.task.question + "".join(s for s, _ in t.segments) for t in transcripts]
    tokenizer = train_tokenizer(texts, vocab_size=cfg.vocab_size)
    chat = ChatFormat(tokenizer)
    data = [tokenize_transcript(t, chat) for t in transcripts]
    too_long = sum(len(ids) > cfg.max_positions for ids, _ in data)
    data = [d for d in data if len(d[0]) <= cfg.max_positions]
    n_tokens = sum(len(ids) for ids, _ in data)
    log(
        f"[bootstrap] tokenizer: vocab {len(tokenizer)}; corpus {n_tokens:,} tokens, "
        f"mean {n_tokens / len(data):.0f} per transcript ({too_long} over {cfg.max_positions} dropped)"
    )

    torch.manual_seed(cfg.seed)
    # eager attention is the faster kernel for this size on CPU (measured: ~15% over sdpa)
    model = Qwen3ForCausalLM._from_config(model_config(cfg, tokenizer), attn_implementation="eager").float()
    params = sum(p.numel() for p in model.parameters())
    log(f"[bootstrap] model: Qwen3ForCausalLM, {params / 1e6:.2f}M parameters; SFT {cfg.sft.steps} steps ...")
    t_train = time.perf_counter()
    result = train_sft(
        model,
        data,
        tokenizer.pad_token_id,
        cfg.sft,
        progress=lambda s, loss: log(
            f"[bootstrap]   step {s:5d}  loss {loss:.4f}  ({time.perf_counter() - t_train:.0f} s)"
        ),
    )
    out_dir.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out_dir, safe_serialization=True)
    tokenizer.save_pretrained(out_dir)
    GenerationConfig(
        eos_token_id=list(chat.stop_ids), pad_token_id=tokenizer.pad_token_id, do_sample=True, temperature=1.0
    ).save_pretrained(out_dir)
    provenance = {
        "command": "cleaner bootstrap " + " ".join(sys.argv[2:]),
        "config": {**asdict(cfg), "world": cfg.world.model_dump()},
        "parameters": params,
        "corpus": {
            "transcripts": len(data),
            "tokens": n_tokens,
            "first_call_failed": sum(t.first_call_failed for t in transcripts) / len(transcripts),
            "retries": sum(t.retries for t in transcripts),
            "deep_retries": sum(t.deep_retries for t in transcripts),
        },
        "losses": result.losses,
        "wall_s": {
            "corpus": round(t_corpus, 1),
            "train": round(result.wall_s, 1),
            "total": round(time.perf_counter() - t_start, 1),
        },
        "train_tokens_per_s": round(result.tokens_per_s, 1),
        "machine": {"python": platform.python_version(), "torch": torch.__version__, "threads": cfg.sft.threads},
    }
    (out_dir / "PROVENANCE.json").write_text(json.dumps(provenance, indent=1))
    log(f"[bootstrap] saved {out_dir} in {provenance['wall_s']['total']:.0f} s")
    return provenance
