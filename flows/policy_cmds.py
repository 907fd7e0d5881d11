"""`cleaner bootstrap` and `cleaner init-policy`: a policy to start from (torch loads inside the commands)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Callable

from flows.command import command_parser, config_of
from pipeline.qwen3_tokenizer import TEMPLATE_FAMILIES


SFT_BATCH = 8  # trainer.sft.SFTConfig.batch_size: a corpus smaller than one batch cannot train


def at_least(minimum: int) -> Callable[[str], int]:
    """An argparse type: an integer ≥ minimum (0 SFT steps saved an untrained policy; a corpus of 0 was a
    ZeroDivisionError after the sandbox had run)."""

    def parse(value: str) -> int:
        try:
            n = int(value)
        except ValueError:
            n = minimum - 1
        if n < minimum:
            raise argparse.ArgumentTypeError(f"{value!r}: give a whole number ≥ {minimum}")
        return n

    return parse


def out_problem(out: Path, force: bool) -> str | None:
    """Why bootstrap cannot write its policy to `out`, checked before minutes of corpus and training: a file in
    the way, a folder of other things (`--out ''` wrote a policy into the working directory), a policy without
    --force."""
    if out.exists() and not out.is_dir():
        return f"--out {out} is a file, not a folder"
    if any(out.glob("*.safetensors")) or (out / "config.json").is_file():  # a policy, or one a Ctrl-C cut short
        return None if force else f"{out} already holds a policy; pass --force to rebuild it"
    if out.is_dir() and any(out.iterdir()):
        return f"--out {out} holds other files: give a new or empty folder"
    return None


def run_bootstrap(args: argparse.Namespace) -> int:
    from flows.bootstrap import BootstrapConfig, bootstrap
    from trainer.sft import SFTConfig

    cfg = config_of(args)
    out = args.out or cfg.rollout.policy
    problem = out_problem(out, args.force)
    if problem:
        print(f"cleaner bootstrap: {problem}", file=sys.stderr)
        return 2
    boot = BootstrapConfig(
        corpus_size=args.corpus_size,
        seed=args.seed,
        world=cfg.world,
        sft=SFTConfig(steps=args.steps, seed=args.seed, threads=args.threads),
    )
    bootstrap(out, boot)
    print(f"next: cleaner eval --world rollout.policy={out}")
    return 0


def run_init_policy(args: argparse.Namespace) -> int:
    from flows.init_policy import InitPolicyConfig, init_policy

    if args.random and args.retrain:  # --retrain was ignored: random weights are never trained
        print(
            "cleaner init-policy: --random writes untrained weights, --retrain reruns the SFT: give one",
            file=sys.stderr,
        )
        return 2

    init_policy(
        args.out,
        InitPolicyConfig(steps=0) if args.random else InitPolicyConfig(),
        retrain=args.retrain,
        template=args.template,
    )
    print(f"next: cleaner rollout rollout.policy={args.out} rollout.max_prompt_tokens=512")
    return 0


def add_parser(sub) -> None:
    p = command_parser(
        sub,
        "bootstrap",
        "build the tool-use world's tokenizer, SFT corpus and tiny policy",
        "Example:\n  cleaner bootstrap --out /tmp/policy --steps 200 --corpus-size 500   # a quick one",
        "Generate the SFT corpus (tool outputs from the real sandbox), train the byte-level BPE tokenizer and a "
        "tiny Qwen3 policy from scratch on CPU, and save it in HF format with PROVENANCE.json.",
        func=run_bootstrap,
    )
    p.add_argument("--out", type=Path, help="output folder (default: rollout.policy)")
    p.add_argument("--steps", type=at_least(1), default=3500, help=f"SFT optimizer steps (batch {SFT_BATCH})")
    p.add_argument(
        "--corpus-size", type=at_least(SFT_BATCH), default=12_000, help=f"number of transcripts (≥ {SFT_BATCH})"
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=at_least(1), default=1, help="torch threads (1 is fastest on a shared 2-core box)")
    p.add_argument("--force", action="store_true", help="overwrite an existing policy")

    p = command_parser(
        sub,
        "init-policy",
        "write a small Qwen3ForCausalLM with the real Qwen3 tokenizer (vocab 151,936)",
        "Example:\n  cleaner init-policy --out /tmp/qwen3-tiny && cleaner rollout rollout.policy=/tmp/qwen3-tiny",
        "A Qwen3-layout checkpoint (real tokenizer, <tool_call>=151657, <think> blocks, Qwen3's chat template) of "
        "small width, briefly SFT'd to emit tool calls; it runs through exactly the code a real Qwen3 checkpoint "
        "does (flows/init_policy.py).",
        config=False,
        func=run_init_policy,
    )
    p.add_argument("--out", type=Path, required=True, help="output folder (an HF checkpoint directory)")
    p.add_argument("--random", action="store_true", help="random weights (never emits a tool call)")
    p.add_argument("--retrain", action="store_true", help="rerun the SFT (minutes) instead of the committed weights")
    p.add_argument(
        "--template",
        choices=TEMPLATE_FAMILIES,
        default="qwen3",
        help="chat template family: qwen3 (Qwen3-4B, Instruct-2507's generation prompt) or thinking-2507 "
        "(opens every assistant turn with <think>, as Qwen3-4B-Thinking-2507)",
    )
