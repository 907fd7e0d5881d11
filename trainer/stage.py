"""Phase 3 as a stage: iteration I's purified partition + checkpoint I → checkpoint I+1.

Checkpoint I is the policy that sampled iteration I (for I = 0, rollout.policy when the run has no
copy of its own). The new checkpoint is written to a temporary folder and renamed into place: it
appears whole or not at all, and an existing one is never overwritten.
"""
from __future__ import annotations

import shutil
import sys
import time
from pathlib import Path
from typing import Callable

import pyarrow as pa
import torch

from pipeline.config import CleanerConfig
from pipeline.devices import prepare_device, resolve_device
from pipeline.progress import StageProgress
from pipeline.config import train_settings
from storage.checkpoints import DONE_MARKER, committed_update
from storage.errors import CheckpointError, check_writable_root
from storage.layout import RunLayout, record_path
from storage.schemas import METRICS
from storage.shards import is_committed, write_shard
from trainer.devices import check_train_device
from trainer.distributed import launch
from trainer.grpo import GRPOUpdate, UpdateError, UpdateProgress, total_minibatches
from trainer.inputs import (TRAINER_STATE, copy_tokenizer_files, dpo_note, finish_checkpoint, load_policy, log_steps,
                            start_checkpoint, update_inputs, write_update_metrics)
from trainer.resume import load_local, partial_dir, save_local


def _write_checkpoint(target: Path, src: Path, model: torch.nn.Module | None, state: dict) -> None:
    tmp = start_checkpoint(target)
    try:
        if model is None:
            shutil.rmtree(tmp)
            shutil.copytree(src, tmp, ignore=shutil.ignore_patterns(DONE_MARKER, TRAINER_STATE))
        else:
            model.save_pretrained(tmp, safe_serialization=True)
            copy_tokenizer_files(src, tmp)
        with open(tmp / TRAINER_STATE, "wb") as f:  # a file object: a full disk is an OSError, not a RuntimeError
            torch.save(state["trainer"], f)
        finish_checkpoint(tmp, target, {k: v for k, v in state.items() if k != "trainer"})
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)  # a failed write (full disk) leaves no half checkpoint
        raise


def _trainer_state(cfg: CleanerConfig, src: Path) -> dict | None:
    """The optimizer and schedule state to continue from: none for the initial policy; for a checkpoint the
    run wrote itself, its trainer_state.pt — whose absence is refused, since training on would silently
    restart AdamW's moments and the LR warm-up in the middle of a run."""
    path = src / TRAINER_STATE
    if not path.is_file():
        if (src / DONE_MARKER).is_file() and cfg.train.strategy == "local":
            raise CheckpointError(f"{path}: missing, so this update would restart the optimizer (AdamW moments, LR "
                                  f"schedule) mid-run; restore the file, or start a new run from these weights "
                                  f"(flow.run_id=NEW rollout.policy={src})")
        return None
    try:
        return torch.load(path, weights_only=False, map_location="cpu")  # the optimizer moves it to its weights
    except Exception as e:  # noqa: BLE001 - torch raises several types for a damaged file
        raise CheckpointError(f"{path}: unreadable optimizer state ({type(e).__name__}); restore the file") from None


# Outside a terminal (a flow's log, a pipe), a progress line at most this often, at the end of a micro-batch
PROGRESS_EVERY_S = 3.0


def _stderr(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def run_update_stage(cfg: CleanerConfig, run_id: str, iteration: int, stop_after: int | None = None,
                     log: Callable[[str], None] | None = None) -> Path:
    """`log`: where its lines and progress go (a flow's run logger); None: stderr, with a bar on a terminal."""
    layout = RunLayout(cfg.storage.root, run_id)
    target = layout.checkpoint_dir(iteration + 1)
    if committed_update(target, train_settings(cfg.train)):
        return target  # done before; never overwritten
    progress_log, log = log, log or _stderr
    check_train_device(cfg.train)
    check_writable_root(cfg.storage.root, create=False)  # before training, not at the first checkpoint write
    inputs = update_inputs(cfg, run_id, iteration)
    src, part, manifest = inputs.src, inputs.part, inputs.manifest
    prev_state = _trainer_state(cfg, src)
    if not inputs.rows:
        if manifest.extra.get("filtered_groups", 0) > 0:
            # documented skip: every group had one reward, so GRPO has no signal; the policy carries over
            log(f"[update] {part}: all {manifest.extra['filtered_groups']} groups were filtered; policy carried over")
            _write_checkpoint(target, src, None, {"skipped": "all groups filtered", "train_settings": train_settings(cfg.train), "source": record_path(cfg.storage.root, src),
                                                  "trainer": prev_state})
            if not is_committed(inputs.metrics_dir):
                write_shard(inputs.metrics_dir, pa.Table.from_pylist([{"run_id": run_id, "iteration": iteration, "stage": "update",
                            "step": 0, "name": "skipped", "value": 1.0}], schema=METRICS), METRICS, "skip")
            return target
        raise UpdateError(f"{part}: the purified shard has no rows; nothing to train on")
    if cfg.train.strategy == "deepspeed":
        return launch(cfg, run_id, iteration, stop_after, log)
    device = resolve_device(cfg.train.device, "train.device")
    prepare_device(device)
    model = load_policy(cfg, inputs, device)
    update = GRPOUpdate(model, cfg.train, cfg.rollout.temperature, device)
    if cfg.train.use_dpo_on_tool_calls:
        update.set_dpo_pairs(inputs.dpo_pairs)
        log(dpo_note(inputs))
    if prev_state is not None:
        update.load_state_dict(prev_state)  # AdamW moments and the schedule continue across iterations
    key = inputs.key(cfg)
    partial = partial_dir(target)
    progress = load_local(partial, model, update, key) or UpdateProgress()
    if progress.minibatches_done:
        log(f"[update] resuming after mini-batch {progress.minibatches_done}")
        log_steps(progress.metrics, log)
    pad = model.config.pad_token_id or 0
    t0 = time.perf_counter()
    total, resumed = total_minibatches(inputs.rows, cfg.train), progress.minibatches_done
    with StageProgress(f"update it {iteration}", "mini-batches", total - resumed, log=progress_log,
                       every_s=PROGRESS_EVERY_S) as bar:
        def micro_batch_done(done: int, of: int) -> None:
            bar.update(progress.minibatches_done - resumed,
                       note=f"mini-batch {progress.minibatches_done + 1}/{total}: micro-batch {done}/{of}")

        def minibatch_done(p: UpdateProgress) -> None:
            save_local(partial, model, update, p, key)
            log_steps(p.metrics[-1:], log)  # each step's line when it is taken, not all at the end
            bar.update(p.minibatches_done - resumed)

        update.on_micro_batch = micro_batch_done
        update.run(inputs.rows, pad, progress, after_minibatch=minibatch_done, stop_after=stop_after)
    if stop_after is not None:
        return partial  # interrupted on purpose (tests): resume by calling again
    _write_checkpoint(target, src, model, {"train_settings": train_settings(cfg.train), "source": record_path(cfg.storage.root, src), "rows": len(inputs.rows), "purified": record_path(cfg.storage.root, part),
                                           "wall_s": time.perf_counter() - t0, "trainer": update.state_dict()})
    write_update_metrics(run_id, iteration, inputs, progress.metrics, key)
    shutil.rmtree(partial, ignore_errors=True)
    return target
