"""train.strategy=deepspeed: the update stage as torchrun ranks.

`launch` (called by the update stage in the flow/CLI process) freezes the config beside the target
checkpoint and starts `torchrun --standalone --nproc_per_node=train.nproc -m trainer.distributed`;
each rank runs `deepspeed_update`. On GPU clusters the same module can be started by any launcher
that sets torchrun's environment (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR/PORT):

    torchrun --nnodes 2 --nproc_per_node 8 ... -m trainer.distributed CONFIG.yaml RUN ITERATION

Checkpoint layout is the local strategy's (HF weights + tokenizer + `_CHECKPOINT.json`), with the
ZeRO optimizer/scheduler state under `deepspeed/` instead of `trainer_state.pt`.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

from pipeline.config import CleanerConfig, dump_config, load_config, train_settings
from pipeline.processes import dies_with
from storage.checkpoints import DONE_MARKER
from storage.errors import CleanerError, first_line
from storage.layout import RunLayout, record_path
from trainer.grpo import UpdateError, UpdateProgress, total_minibatches
from trainer.inputs import (
    DS_STATE,
    dpo_note,
    finish_checkpoint,
    load_policy,
    log_steps,
    staging_dir,
    start_checkpoint,
    update_inputs,
    write_update_metrics,
)
from trainer.resume import partial_dir

LOG_PREFIX = "[update]"


def launch(cfg: CleanerConfig, run_id: str, iteration: int, stop_after: int | None = None, log=print) -> Path:
    target = RunLayout(cfg.storage.root, run_id).checkpoint_dir(iteration + 1)
    frozen = target.with_name(target.name + ".config.yaml")
    frozen.parent.mkdir(parents=True, exist_ok=True)
    frozen.write_text(dump_config(cfg))
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc_per_node={cfg.train.nproc}",
        "-m",
        "trainer.distributed",
        str(frozen),
        run_id,
        str(iteration),
    ]
    if stop_after is not None:
        cmd += ["--stop-after", str(stop_after)]
    env = {**os.environ, "OMP_NUM_THREADS": str(max(1, cfg.rollout.engine_tuning.threads)), "PYTHONUNBUFFERED": "1"}
    env[LOCKED] = "1"  # the update stage in this process holds the checkpoint's lock for the ranks
    t = cfg.train
    log(
        f"[update] strategy=deepspeed: {t.nproc} rank(s), ZeRO-{t.zero_stage}, {t.param_dtype}"
        + (", optimizer offloaded to the CPU" if t.offload_optimizer else "")
        + (", activation checkpointing" if t.gradient_checkpointing else "")
    )
    tail: collections.deque[str] = collections.deque(maxlen=300)
    try:
        # torchrun gets SIGTERM when this process dies however it dies (kill -9 included), and stops its ranks:
        # orphaned ranks would go on holding the GPUs, and a rerun would start a second torchrun beside them
        with subprocess.Popen(
            cmd,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env=env,
            preexec_fn=dies_with(os.getpid(), signal.SIGTERM),
        ) as proc:
            for line in proc.stdout:
                tail.append(line.rstrip())
                if line.startswith(LOG_PREFIX):
                    log(line.rstrip())
    finally:
        frozen.unlink(missing_ok=True)
    if proc.returncode != 0:
        known = [t for t in tail if t.startswith("cleaner: ")]
        if known:  # an UpdateError & co. raised in a rank: its one line
            raise UpdateError(known[-1][len("cleaner: ") :])
        resume = "nothing was committed, and running it again resumes after the last finished mini-batch"
        cause = root_cause(list(tail))
        if cause is not None and cause[1] < 0:  # a rank killed: the others' tracebacks only say they lost it
            rank, code, why = cause
            raise UpdateError(
                f"deepspeed update of iteration {iteration} failed: rank {rank} ended first ({why or f'exit {code}'})"
                f" and the other ranks lost it; {resume}"
            )
        traceback = [t for t in tail if t.startswith("[rank")] or list(tail)  # a rank's own traceback first
        for line in traceback[-25:]:  # for whoever reads the log; the error itself stays one line
            log(line)
        last = next((t for t in reversed(traceback) if t.strip()), "no output")
        first = f"rank {cause[0]} failed first; " if cause is not None else ""
        raise UpdateError(
            f"deepspeed update of iteration {iteration} failed ({first}torchrun exit {proc.returncode}: "
            f"{last.strip()[:300]}); {resume}"
        )
    if stop_after is not None:
        return partial_dir(target)
    if not (target / DONE_MARKER).is_file():
        raise UpdateError(f"{target}: torchrun exited 0 but wrote no checkpoint")
    return target


def root_cause(lines: list[str]) -> tuple[int, int, str] | None:
    """(rank, exit code, its signal or traceback line) of the rank torchrun observed failing first, from the
    "Root Cause (first observed failure)" block of its error summary; None when it printed none."""
    try:
        start = next(i for i, t in enumerate(lines) if "Root Cause" in t)
    except StopIteration:
        return None
    fields: dict[str, str] = {}
    for t in lines[start + 1 :]:
        name, sep, value = t.strip().partition(":")
        if sep and name.strip() in ("rank", "exitcode", "traceback"):
            fields.setdefault(name.strip(), value.strip())
    try:
        rank = int(fields["rank"].split()[0])
        code = int(fields["exitcode"].split()[0])
    except (KeyError, ValueError, IndexError):
        return None
    why = fields.get("traceback", "")
    return rank, code, "" if why.startswith(("To enable traceback", "<N/A>")) else why


def deepspeed_update(cfg: CleanerConfig, run_id: str, iteration: int, stop_after: int | None = None) -> Path:
    """One rank of the update (every rank runs this; rank 0 writes the files everyone shares)."""
    import torch.distributed as dist

    from trainer.deepspeed_update import STATE_TAG, DeepSpeedGRPOUpdate, make_strategy, rank_device

    inputs = update_inputs(cfg, run_id, iteration)
    strategy = make_strategy(cfg.train, rank_device(cfg.train))
    rank = dist.get_rank()
    log = print if rank == 0 else (lambda *_: None)
    model = load_policy(cfg, inputs)
    update = DeepSpeedGRPOUpdate(model, cfg.train, strategy, cfg.rollout.temperature)
    if cfg.train.use_dpo_on_tool_calls:
        update.set_dpo_pairs(inputs.dpo_pairs)
        log(dpo_note(inputs))
    if cfg.train.fresh_optimizer:
        log("[update] optimizer and schedule start fresh (train.fresh_optimizer)")
    elif update.load_state(inputs.src / DS_STATE, STATE_TAG):
        log(f"[update] optimizer and schedule continue from {inputs.src / DS_STATE}")
    key = inputs.key(cfg)
    partial = partial_dir(inputs.target)
    progress = update.resume_progress(partial, key) or UpdateProgress()
    if progress.minibatches_done:
        log(f"[update] resuming after mini-batch {progress.minibatches_done}")
    t0 = time.perf_counter()
    total = total_minibatches(inputs.rows, cfg.train)

    def after_minibatch(p: UpdateProgress) -> None:
        update.save_progress(partial, p, key)
        log_steps(p.metrics[-1:], log)  # as each mini-batch ends: a GPU's can take minutes
        log(f"[update] {p.minibatches_done}/{total} mini-batches")

    update.run(
        inputs.rows, model.config.pad_token_id or 0, progress, stop_after=stop_after, after_minibatch=after_minibatch
    )
    if stop_after is not None:
        return partial
    tmp = staging_dir(inputs.target)
    if rank == 0:
        start_checkpoint(inputs.target)
    dist.barrier()
    update.save_weights(tmp, inputs.src)  # collective under ZeRO-3 (gathers), rank 0 writes
    update.save_state(tmp / DS_STATE, STATE_TAG)  # every rank writes its optimizer partition
    dist.barrier()
    if rank == 0:  # metrics before the checkpoint, whose commit makes a rerun skip the update (trainer/stage._commit)
        write_update_metrics(run_id, iteration, inputs, progress.metrics, key)
        finish_checkpoint(
            tmp,
            inputs.target,
            {
                "train_settings": train_settings(cfg.train),
                "source": record_path(cfg.storage.root, inputs.src),
                "rows": len(inputs.rows),
                "purified": record_path(cfg.storage.root, inputs.part),
                "strategy": "deepspeed",
                "ranks": dist.get_world_size(),
                "zero_stage": cfg.train.zero_stage,
                "wall_s": time.perf_counter() - t0,
            },
        )
        shutil.rmtree(partial, ignore_errors=True)
    dist.barrier()
    return inputs.target


LOCKED = "CLEANER_UPDATE_LOCKED"


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description="one torchrun rank of the deepspeed update stage")
    ap.add_argument("config", type=Path)
    ap.add_argument("run_id")
    ap.add_argument("iteration", type=int)
    ap.add_argument("--stop-after", type=int, default=None, help="stop after this many mini-batches (tests)")
    args = ap.parse_args(argv)
    from torch.distributed import DistError

    try:
        cfg = load_config(args.config)
        with contextlib.ExitStack() as held:
            if os.environ.get("RANK", "0") == "0" and not os.environ.get(LOCKED):
                # started by another launcher: rank 0 holds the checkpoint's lock, as `cleaner update` does (a flock
                # is one node's: another node's command is not kept out)
                from storage.locks import WriterLock

                target = RunLayout(cfg.storage.root, args.run_id).checkpoint_dir(args.iteration + 1)
                held.enter_context(WriterLock.beside(target, f"checkpoint {target}"))
            deepspeed_update(cfg, args.run_id, args.iteration, args.stop_after)
    except (CleanerError, FloatingPointError) as e:
        print(f"cleaner: {e}", flush=True)
        return 1
    except DistError as e:  # NCCL or gloo: a rank, a GPU or the network lost mid-update
        print(
            f"cleaner: the update's ranks lost each other (rank {os.environ.get('RANK', '?')}: {type(e).__name__}: "
            f"{first_line(e)}); nothing was committed, and running it again resumes after the last finished "
            "mini-batch",
            flush=True,
        )
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
