"""`cleaner fit`: before a run, whether the update of a model at a trajectory length fits the GPUs' memory with
the config's train.* settings, term by term, and if not, which settings would (trainer/memory.py; docs/gpu.md).

Exit 0 when it fits, 1 when it does not (so a job script can stop before it starts), 2 on bad input.
"""

from __future__ import annotations

import argparse
import math
from pathlib import Path

from flows.command import command_parser, config_of
from storage.errors import CleanerError

EXAMPLE = """Examples:
  cleaner fit -c configs/demo.yaml
  cleaner fit -c my.yaml --model /models/Qwen3-4B --tokens 8192 --gpus 1 --gpu-memory 79.2   # an H100 80GB
  cleaner fit -c my.yaml train.strategy=deepspeed train.zero_stage=3 train.nproc=4 train.param_dtype=bf16"""


class FitError(CleanerError, ValueError):
    exit_code = 2


def detected_gpu_memory() -> tuple[float | None, str]:
    """(bytes of the smallest visible GPU, its name) or (None, why)."""
    try:
        import torch
    except ImportError:
        return None, "no torch"
    if not torch.cuda.is_available():
        return None, "no CUDA device here"
    props = [torch.cuda.get_device_properties(i) for i in range(torch.cuda.device_count())]
    small = min(props, key=lambda p: p.total_memory)
    return float(small.total_memory), f"{small.name} × {len(props)}"


def run_fit(args: argparse.Namespace) -> int:
    from trainer.memory import (
        GiB,
        HEADROOM,
        ModelShape,
        Plan,
        describe,
        estimate,
        longest_fitting_tokens,
        suggestions,
        this_host_memory,
    )

    cfg = config_of(args)
    model = args.model or cfg.rollout.policy
    shape = ModelShape.from_path(Path(model))
    tokens = args.tokens if args.tokens is not None else cfg.rollout.max_prompt_tokens + cfg.rollout.max_response_tokens
    if tokens < 1:
        raise FitError(f"--tokens {tokens}: a trajectory has at least one token")
    if args.gpu_memory is not None:
        if not math.isfinite(args.gpu_memory) or args.gpu_memory <= 0:
            raise FitError(f"--gpu-memory {args.gpu_memory}: GiB per GPU, a number above 0")
        gpu_bytes, card = args.gpu_memory * GiB, f"{args.gpu_memory:g} GiB per GPU (--gpu-memory)"
    else:
        gpu_bytes, card = detected_gpu_memory()
        if gpu_bytes is None:
            raise FitError(
                f"{card}: say the GPUs' memory with --gpu-memory GIB, as torch reports it (an H100 80GB: 79.2)"
            )
    if args.host_memory is not None:
        if not math.isfinite(args.host_memory) or args.host_memory <= 0:
            raise FitError(f"--host-memory {args.host_memory}: GiB of the node's memory, a number above 0")
        host_bytes, host = args.host_memory * GiB, f"{args.host_memory:g} GiB (--host-memory)"
    elif args.gpu_memory is None:  # the GPUs are this machine's: so is the host offload fills
        host_bytes = this_host_memory()
        host = f"{host_bytes / GiB:.0f} GiB (this machine)"
    else:
        host_bytes, host = None, None
    deepspeed = cfg.train.strategy == "deepspeed"
    gpus = args.gpus if args.gpus is not None else (cfg.train.nproc if deepspeed else 1)
    if gpus < 1:
        raise FitError(f"--gpus {gpus}: at least 1")
    # a train.nproc the config gives is what a run would start; without one, --gpus ranks
    ranks = (cfg.train.nproc if "nproc" in cfg.train.model_fields_set else gpus) if deepspeed else 1
    if ranks > gpus:
        raise FitError(f"train.nproc={ranks} ranks for {gpus} GPU(s) (--gpus): one rank per GPU")
    plan = Plan.from_train(cfg.train, tokens, ranks=ranks)
    est = estimate(shape, plan)
    usable = gpu_bytes * (1 - HEADROOM)
    print(
        f"model {shape.name}: {_count(shape.parameters)} parameters ({shape.layers} layers, hidden "
        f"{shape.hidden}, vocabulary {shape.vocab}); trajectories of {tokens} tokens; {card}"
    )
    limit = _max_positions(Path(model))
    if limit and tokens > limit:
        print(
            f"note: {tokens} tokens is past the model's max_position_embeddings ({limit}): positions it was never "
            "trained at; sized all the same"
        )
    print(f"settings: {describe(plan)}")
    print("\n".join("  " + line for line in est.lines()))
    fits, on_card = est.fits(gpu_bytes, host_bytes), est.fits(gpu_bytes)
    print(
        f"{'fits' if fits else 'does not fit'}: {est.peak / GiB:.1f} GiB of {usable / GiB:.1f} GiB usable per GPU "
        f"({HEADROOM:.0%} of {gpu_bytes / GiB:.0f} GiB left for the CUDA context and fragmentation)"
        + ("; the host's memory does not hold offload's share" if on_card and not fits else "")
    )
    if est.cpu_bytes:
        if host_bytes is None:
            print(
                f"  offload: {est.host_bytes / GiB:.1f} GiB of host memory for {plan.ranks} rank(s), not checked "
                "(--host-memory GIB: the node's memory)"
            )
        else:
            room = host_bytes * (1 - HEADROOM)
            print(
                f"  offload: {est.host_bytes / GiB:.1f} GiB of host memory for {plan.ranks} rank(s) of "
                f"{room / GiB:.1f} GiB usable of {host}" + ("" if est.host_bytes <= room else ": does not fit")
            )
    if fits:
        return 0
    found = suggestions(shape, plan, gpus, gpu_bytes, host_bytes=host_bytes)
    if found:
        print(f"would fit on {gpus} GPU(s), fastest first:")
        for e in found:
            print(
                f"  {describe(e.plan)}   ({e.peak / GiB:.1f} GiB per GPU"
                + (f", {e.host_bytes / GiB:.0f} GiB of host memory for offload" if e.cpu_bytes else "")
                + ")"
            )
    else:
        print(
            f"no settings fit {gpus} GPU(s) of {gpu_bytes / GiB:.0f} GiB at {tokens} tokens"
            + (f" with {host_bytes / GiB:.0f} GiB of host memory" if host_bytes else "")
            + "; more GPUs (--gpus)"
            + (", more host memory" if host_bytes else "")
            + " or shorter trajectories"
        )
        room = None if host_bytes is None else host_bytes * (1 - HEADROOM)
        held = [e for e in (estimate(shape, c) for c in _all(plan, gpus)) if room is None or e.host_bytes <= room]
        best = min(held or [est], key=lambda e: e.peak)
        longest = longest_fitting_tokens(shape, best.plan, gpu_bytes, host_bytes)
        if longest:
            print(f"  {describe(best.plan)} fits trajectories up to about {longest} tokens")
    return 1


def _max_positions(model: Path) -> int:
    from pipeline.engines.vllm_server import model_max_len

    return model_max_len(model.parent if model.name == "config.json" else model)


def _count(parameters: int) -> str:
    return f"{parameters / 1e9:.2f}B" if parameters >= 1e9 else f"{parameters / 1e6:.1f}M"


def _all(plan, gpus):
    from trainer.memory import candidate_plans

    return candidate_plans(plan, gpus)


def add_parser(sub) -> None:
    p = command_parser(
        sub,
        "fit",
        "whether the update fits the GPUs' memory, and which settings would",
        EXAMPLE,
        description=__doc__,
        func=run_fit,
    )
    p.add_argument("--model", type=Path, help="checkpoint folder (or config.json) to size (default: rollout.policy)")
    p.add_argument(
        "--tokens",
        type=int,
        help="trajectory tokens (default: rollout.max_prompt_tokens + rollout.max_response_tokens)",
    )
    p.add_argument(
        "--gpus",
        type=int,
        help="GPUs the update may use (default: train.nproc under deepspeed, else 1); a train.nproc the config "
        "gives is sized, else --gpus ranks",
    )
    p.add_argument(
        "--gpu-memory",
        type=float,
        metavar="GIB",
        help="memory per GPU in GiB as torch reports it (an H100 80GB: 79.2; default: this machine's smallest GPU)",
    )
    p.add_argument(
        "--host-memory",
        type=float,
        metavar="GIB",
        help="the node's memory in GiB, which optimizer offload fills (default: this machine's when its GPUs are "
        "sized, else offload's host share is shown but not checked)",
    )
