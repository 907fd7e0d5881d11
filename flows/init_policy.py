"""`cleaner init-policy`: a small-width Qwen3ForCausalLM with the real Qwen3 tokenizer and vocabulary.

It has exactly the layout of a user's Qwen3 checkpoint (vocab 151,936, `<tool_call>` = 151657,
`<think>` blocks, Qwen3's chat template), so every stage runs the same code on it as on theirs.

Why briefly trained rather than random: with random weights a 151,936-way softmax puts ~1/151,936
on `<tool_call>`, so no trajectory would ever call the tool and nothing of SAAR (calls, failures,
retries, splices) would run. A short SFT on the tool-use world's transcripts (real sandbox outputs,
a third of first calls buggy, near-copy fixes and rewrites — rollout_gen/world/corpus.py) re-laid
in Qwen3's format with `<think>` blocks makes it emit calls, fail and retry. `--steps 0` gives
random weights.

The SFT is exact and cheap: the embedding rows of tokens the corpus never uses are zero, so their
logits are exactly 0 and the full softmax's normaliser is Σ_used exp(z) + (V − |used|)·e⁰ — the
loss is the true 151,936-way cross-entropy computed over a few hundred columns. Those rows stay
zero (never an input, never a target).
"""

from __future__ import annotations

import json
import math
import os
import random
import shutil
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from transformers import AutoTokenizer, GenerationConfig, Qwen3Config, Qwen3ForCausalLM

from pipeline.chat import CALL_OPEN, ChatFormat
from pipeline.config import SandboxConfig, WorldConfig
from pipeline.qwen3_tokenizer import MODEL_VOCAB, TOKENIZER_DIR, chat_template
from storage.checkpoints import files_as_umask_says
from storage.errors import CheckpointError, CleanerError

COMPACT_DIR = TOKENIZER_DIR.parent / "qwen3-tiny-calls"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")
FINAL_THINKING = "<think>\nThe tool printed the result.\n</think>\n\n"


@dataclass
class InitPolicyConfig:
    hidden_size: int = 64
    layers: int = 2
    heads: int = 4
    kv_heads: int = 2  # grouped-query attention, as in Qwen3
    head_dim: int = 16
    ffn: int = 128
    max_positions: int = 32_768
    transcripts: int = 96
    steps: int = 120  # 0: random weights
    batch_size: int = 8
    lr: float = 1e-2
    seed: int = 0
    threads: int = 2


def qwen3_config(cfg: InitPolicyConfig) -> Qwen3Config:
    return Qwen3Config(
        vocab_size=MODEL_VOCAB,
        hidden_size=cfg.hidden_size,
        intermediate_size=cfg.ffn,
        num_hidden_layers=cfg.layers,
        num_attention_heads=cfg.heads,
        num_key_value_heads=cfg.kv_heads,
        head_dim=cfg.head_dim,
        max_position_embeddings=cfg.max_positions,
        tie_word_embeddings=True,
        rope_theta=1_000_000.0,
        rms_norm_eps=1e-6,
        bos_token_id=151643,
        eos_token_id=151645,
        pad_token_id=151643,
    )


def qwen3_format(segments: list[tuple[str, bool]]) -> list[tuple[str, bool]]:
    """The world transcript's assistant turns with their reasoning in a `<think>` block, as Qwen3 writes."""
    out = []
    for text, trained in segments:
        if trained and CALL_OPEN in text:
            reasoning, call = text.split(CALL_OPEN, 1)
            text = f"<think>\n{reasoning.strip()}\n</think>\n\n{CALL_OPEN}{call}"
        elif trained:
            text = FINAL_THINKING + text
        out.append((text, trained))
    return out


def corpus(cfg: InitPolicyConfig, chat: ChatFormat) -> list[tuple[list[int], list[int]]]:
    from rollout_gen.sandbox import SandboxPool
    from rollout_gen.world.corpus import build_transcripts, tokenize_transcript
    from rollout_gen.world.tasks import training_tasks

    tasks = training_tasks(WorldConfig(), cfg.transcripts, seed=cfg.seed + 20_000)
    with SandboxPool(SandboxConfig(workers=2)) as pool:
        transcripts = build_transcripts(tasks, pool, cfg.seed)
    for t in transcripts:
        t.segments = qwen3_format(t.segments)
    return [tokenize_transcript(t, chat) for t in transcripts]


def train_compact(
    data: list[tuple[list[int], list[int]]], cfg: InitPolicyConfig, pad_id: int, vocab: int = MODEL_VOCAB
) -> tuple[Qwen3ForCausalLM, list[int], list[float]]:
    """SFT with the exact full-vocabulary loss, on a compact copy whose vocabulary is the used tokens
    (plus one constant logit standing for the V − |used| zero logits; module docstring)."""
    used = sorted({i for ids, _ in data for i in ids} | {pad_id})
    compact_id = {t: k for k, t in enumerate(used)}
    small_cfg = qwen3_config(cfg)
    small_cfg.vocab_size, small_cfg.pad_token_id = len(used), compact_id[pad_id]
    small = Qwen3ForCausalLM(small_cfg).float()
    unused_mass = math.log(vocab - len(used))  # logsumexp of the zero logits
    opt = torch.optim.AdamW(small.parameters(), lr=cfg.lr, weight_decay=0.0)
    rng = random.Random(cfg.seed)
    losses = []
    small.train()
    for _ in range(cfg.steps):
        batch = rng.sample(data, min(cfg.batch_size, len(data)))
        width = max(len(ids) for ids, _ in batch)
        ids = torch.full((len(batch), width), compact_id[pad_id])
        mask = torch.zeros((len(batch), width), dtype=torch.long)
        loss_mask = torch.zeros((len(batch), width), dtype=torch.bool)
        for r, (x, m) in enumerate(batch):
            ids[r, : len(x)], mask[r, : len(x)] = torch.tensor([compact_id[t] for t in x]), 1
            loss_mask[r, : len(x)] = torch.tensor(m, dtype=torch.bool)
        hidden = small.base_model(input_ids=ids, attention_mask=mask).last_hidden_state
        sel = loss_mask[:, 1:]  # position t predicts token t+1
        logits = small.lm_head(hidden[:, :-1][sel])
        logits = torch.cat([logits, torch.full((len(logits), 1), unused_mass)], dim=1)
        loss = torch.nn.functional.cross_entropy(logits, ids[:, 1:][sel])
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(small.parameters(), 1.0)
        opt.step()
        losses.append(loss.item())
    return small.eval(), used, losses


def expand(small: Qwen3ForCausalLM, used: list[int], cfg: InitPolicyConfig) -> Qwen3ForCausalLM:
    """The full-vocabulary model computing the same function: used rows at their real ids, the rest zero."""
    model = Qwen3ForCausalLM(qwen3_config(cfg)).float()
    with torch.no_grad():
        state = {k: v for k, v in small.state_dict().items() if "embed_tokens" not in k and "lm_head" not in k}
        model.load_state_dict(state, strict=False)
        emb = model.get_input_embeddings().weight
        emb.zero_()
        emb[torch.tensor(used)] = small.get_input_embeddings().weight
    return model.eval()


def save_compact(
    small: Qwen3ForCausalLM, used: list[int], losses: list[float], cfg: InitPolicyConfig, directory: Path
) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    save_file(
        {k: v.contiguous() for k, v in small.state_dict().items() if k != "lm_head.weight"},
        directory / "compact.safetensors",
    )
    (directory / "compact.json").write_text(
        json.dumps(
            {
                "used_token_ids": used,
                "settings": asdict(cfg),
                "sft_loss_first_last": [losses[0], losses[-1]],
                "recipe": "python -m flows.init_policy --retrain (flows/init_policy.py)",
            }
        )
        + "\n"
    )


def load_compact(directory: Path, cfg: InitPolicyConfig) -> tuple[Qwen3ForCausalLM, list[int], list[float]]:
    """What train_compact returned when save_compact wrote `directory` (its first and last loss only)."""
    meta = json.loads((directory / "compact.json").read_text())
    if meta["settings"] != asdict(cfg):
        raise CleanerError(f"{directory} holds weights trained with {meta['settings']}; pass retrain=True")
    small_cfg = qwen3_config(cfg)
    small_cfg.vocab_size, small_cfg.pad_token_id = len(meta["used_token_ids"]), 0
    small = Qwen3ForCausalLM(small_cfg).float()
    small.load_state_dict(load_file(directory / "compact.safetensors"), strict=False)
    small.tie_weights()
    return small.eval(), meta["used_token_ids"], meta["sft_loss_first_last"]


def init_policy(
    out: Path, cfg: InitPolicyConfig | None = None, retrain: bool = False, log=print, template: str = "qwen3"
) -> dict:
    """Write the policy to `out` (an HF directory: config, safetensors, tokenizer, chat template).

    The briefly trained weights are committed in compact form (the used vocabulary rows only,
    policies/qwen3-tiny-calls/, < 1 MB): expanding them takes a second, so tests and users do not
    pay for the SFT (minutes on 2 cores). `retrain` runs it again and rewrites the compact weights.
    `template` picks the chat template family written beside the weights (pipeline/qwen3_tokenizer.py):
    the same weights serve both, since a Thinking-2507 generation prompt ends with the `<think>\n` this
    policy writes itself after Qwen3's."""
    cfg = cfg or InitPolicyConfig()
    template_text = chat_template(template)  # an unknown family fails before anything is written
    out = Path(out)
    if out.exists() and not (out.is_dir() and not any(out.iterdir())):  # never over a model (policies/tiny-tool-policy)
        raise CheckpointError(
            f"--out {out} already exists{' and holds files' if out.is_dir() else ''}: init-policy "
            "writes a new folder; choose another, or remove it first"
        )
    t0 = time.perf_counter()
    torch.manual_seed(cfg.seed)
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    losses: list[float] = []
    if cfg.steps == 0:
        model = Qwen3ForCausalLM(qwen3_config(cfg)).float()
    elif retrain or not (COMPACT_DIR / "compact.json").is_file():
        tokenizer = AutoTokenizer.from_pretrained(TOKENIZER_DIR)
        data = corpus(cfg, ChatFormat(tokenizer))
        log(f"[init-policy] {len(data)} transcripts, {sum(len(x) for x, _ in data)} tokens; {cfg.steps} SFT steps")
        small, used, losses = train_compact(data, cfg, tokenizer.pad_token_id)
        save_compact(small, used, losses, cfg, COMPACT_DIR)
        model = expand(small, used, cfg)
    else:
        small, used, losses = load_compact(COMPACT_DIR, cfg)
        model = expand(small, used, cfg)
    # written beside `out`, then renamed into place: a folder that appears whole or not at all
    out.parent.mkdir(parents=True, exist_ok=True)
    staging = out.parent / f".{out.name}.{os.getpid()}.tmp"
    shutil.rmtree(staging, ignore_errors=True)
    try:
        model.save_pretrained(staging, safe_serialization=True)
        GenerationConfig(bos_token_id=151643, eos_token_id=[151645, 151643], pad_token_id=151643).save_pretrained(
            staging
        )
        for name in TOKENIZER_FILES:
            shutil.copyfile(TOKENIZER_DIR / name, staging / name)
        (staging / "chat_template.jinja").write_text(template_text, encoding="utf-8")
        provenance = {
            "recipe": "cleaner init-policy (flows/init_policy.py)",
            "settings": asdict(cfg),
            "weights": "random" if cfg.steps == 0 else f"SFT, compact weights from {COMPACT_DIR.name}/",
            "parameters": sum(p.numel() for p in model.parameters()),
            "sft_loss_first_last": [losses[0], losses[-1]] if losses else None,
            "tokenizer": "policies/qwen3-tokenizer (see its PROVENANCE.md)",
            "chat_template": template,
            "wall_s": round(time.perf_counter() - t0, 1),
        }
        (staging / "PROVENANCE.json").write_text(json.dumps(provenance, indent=1) + "\n")
        files_as_umask_says(staging)
        if out.is_dir():
            out.rmdir()  # empty (checked above); a file written into it since makes this fail, and nothing is lost
        staging.rename(out)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    log(f"[init-policy] wrote {out} ({provenance['parameters']:,} parameters, {provenance['wall_s']} s)")
    return provenance


if __name__ == "__main__":
    import sys

    init_policy(Path(sys.argv[1]), retrain="--retrain" in sys.argv)
