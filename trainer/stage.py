"""Phase 3 as a stage: iteration I's purified partition + checkpoint I → checkpoint I+1.

Checkpoint I is the policy that sampled iteration I (for I = 0, rollout.policy when the run has no
copy of its own). The new checkpoint is written to a temporary folder and renamed into place: it
appears whole or not at all, and an existing one is never overwritten.
"""
from __future__ import annotations

import hashlib
import json
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

import pyarrow as pa
import torch

from pipeline.config import CleanerConfig
from pipeline.errors import CheckpointError, check_writable_root
from pipeline.trajectory import purified_from_row
from purifier.saar import live_measure, partition_gamma, partition_measure
from rollout_gen.stage import policy_version
from storage.checkpoints import check_checkpoint
from storage.layout import RunLayout
from storage.schemas import METRICS, PURIFIED
from storage.shards import ShardMissing, is_committed, read_manifest, read_shard, write_shard
from trainer.grpo import GRPOUpdate, UpdateError, UpdateProgress, load_partial, save_partial

TRAINER_STATE = "trainer_state.pt"
DONE_MARKER = "_CHECKPOINT.json"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "special_tokens_map.json",
                   "generation_config.json")


def checkpoint_for(cfg: CleanerConfig, run_id: str, iteration: int) -> Path:
    ckpt = RunLayout(cfg.storage.root, run_id).checkpoint_dir(iteration)
    if (ckpt / DONE_MARKER).is_file():
        return ckpt
    if iteration == 0:
        return Path(cfg.rollout.policy)
    raise FileNotFoundError(f"{ckpt}: no checkpoint for iteration {iteration} (run the update of iteration {iteration - 1})")


def _load_rows(cfg: CleanerConfig, run_id: str, iteration: int):
    layout = RunLayout(cfg.storage.root, run_id)
    measure = live_measure(cfg.rollout.saar)  # a run trains on its own measure; purify.similarity only replays
    part = layout.purified_dir(iteration, cfg.train.mode, partition_gamma(cfg.train.mode, cfg.train.gamma),
                               partition_measure(cfg.train.mode, measure))
    manifest = read_manifest(part)
    if manifest is None:
        raise ShardMissing(f"{part}: no purified shard for train.mode={cfg.train.mode} train.gamma={cfg.train.gamma} "
                           f"(run `cleaner purify --iteration {iteration}` first)")
    rows = [purified_from_row(r) for r in read_shard(part, PURIFIED).to_pylist()]
    return part, manifest, rows


def _check_compatible(checkpoint: Path, model: torch.nn.Module, rows, raw_manifest) -> None:
    vocab = model.get_input_embeddings().weight.shape[0]
    top = max((max(r.prompt_ids + r.response_ids) for r in rows), default=0)
    if top >= vocab:
        raise UpdateError(f"{checkpoint}: token id {top} in the purified shard is outside the model's vocabulary "
                          f"({vocab}); the shard was tokenized for another tokenizer")
    sampled_by = (raw_manifest.extra or {}).get("policy_version") if raw_manifest else None
    if sampled_by and sampled_by != policy_version(checkpoint):
        raise UpdateError(f"{checkpoint}: weights {policy_version(checkpoint)} are not the policy that sampled this "
                          f"iteration ({sampled_by}); GRPO's old log-probs would not match")


def _write_checkpoint(target: Path, src: Path, model: torch.nn.Module | None, state: dict) -> None:
    tmp = target.with_name(target.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        if model is None:
            shutil.copytree(src, tmp, ignore=shutil.ignore_patterns(DONE_MARKER, TRAINER_STATE))
        else:
            model.save_pretrained(tmp, safe_serialization=True)
            for name in TOKENIZER_FILES:
                if (src / name).is_file():
                    shutil.copy2(src / name, tmp / name)
        with open(tmp / TRAINER_STATE, "wb") as f:  # a file object: a full disk is an OSError, not a RuntimeError
            torch.save(state["trainer"], f)
        (tmp / DONE_MARKER).write_text(json.dumps({k: v for k, v in state.items() if k != "trainer"}, indent=1))
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)  # a failed write (full disk) leaves no half checkpoint
        raise
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp.rename(target)  # atomic: the checkpoint appears whole


@dataclass
class UpdateInputs:
    """What an update of one iteration reads; the same for every strategy."""

    target: Path
    src: Path
    part: Path
    manifest: object
    rows: list
    raw_manifest: object
    metrics_dir: Path

    def key(self, cfg: CleanerConfig) -> str:
        """Identifies a partial update: resumable only with the same inputs and settings."""
        return hashlib.blake2b(json.dumps([self.manifest.config_hash, cfg.train.model_dump(mode="json"), str(self.src)],
                                          sort_keys=True).encode(), digest_size=8).hexdigest()


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
        return torch.load(path, weights_only=False)
    except Exception as e:  # noqa: BLE001 - torch raises several types for a damaged file
        raise CheckpointError(f"{path}: unreadable optimizer state ({type(e).__name__}); restore the file") from None


def update_inputs(cfg: CleanerConfig, run_id: str, iteration: int) -> UpdateInputs:
    layout = RunLayout(cfg.storage.root, run_id)
    check_checkpoint(checkpoint_for(cfg, run_id, iteration))  # whole weight files before any is loaded
    part, manifest, rows = _load_rows(cfg, run_id, iteration)
    return UpdateInputs(layout.checkpoint_dir(iteration + 1), checkpoint_for(cfg, run_id, iteration), part, manifest,
                        rows, read_manifest(layout.raw_dir(iteration)), layout.metrics_dir(iteration, "update"))


# The update trains with torch's scaled_dot_product_attention: eager attention keeps a length × length
# score and probability tensor per head and layer for backward (2.8 vs 1.8 GiB peak for two 4k rows on
# the Qwen3-shaped policy); SDPA's fused kernel does not.
UPDATE_ATTENTION = "sdpa"


def load_policy(cfg: CleanerConfig, inputs: UpdateInputs) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(inputs.src, dtype=torch.float32, attn_implementation=UPDATE_ATTENTION)
    _check_compatible(inputs.src, model, inputs.rows, inputs.raw_manifest)
    torch.set_num_threads(max(1, cfg.rollout.threads))
    return model


def log_steps(metrics: list, log) -> None:
    for m in metrics:
        entropy = "n/a" if m.entropy is None else f"{m.entropy:.3f}"  # not measured reads as such, never as 0
        log(f"[update] step {m.step}: loss {m.loss:+.4f} clip {m.clip_ratio:.3f} kl {m.approx_kl:+.4f} "
            f"grad {m.grad_norm:.3f} entropy {entropy} tokens {m.tokens}")


def write_update_metrics(run_id: str, iteration: int, inputs: UpdateInputs, metrics: list, key: str) -> None:
    records = [{"run_id": run_id, "iteration": iteration, "stage": "update", "step": m.step, "name": name,
                "value": None if getattr(m, name) is None else float(getattr(m, name))}  # null: not measured
               for m in metrics for name in ("loss", "clip_ratio", "approx_kl", "grad_norm", "entropy",
                                             "tokens", "lr", "seconds")]
    if not is_committed(inputs.metrics_dir):
        write_shard(inputs.metrics_dir, pa.Table.from_pylist(records, schema=METRICS), METRICS, key)


def run_update_stage(cfg: CleanerConfig, run_id: str, iteration: int, stop_after: int | None = None,
                     log=print) -> Path:
    layout = RunLayout(cfg.storage.root, run_id)
    target = layout.checkpoint_dir(iteration + 1)
    if (target / DONE_MARKER).is_file():
        return target  # done before; never overwritten
    check_writable_root(cfg.storage.root, create=False)  # before training, not at the first checkpoint write
    inputs = update_inputs(cfg, run_id, iteration)
    src, part, manifest = inputs.src, inputs.part, inputs.manifest
    prev_state = _trainer_state(cfg, src)
    if not inputs.rows:
        if manifest.extra.get("filtered_groups", 0) > 0:
            # documented skip: every group had one reward, so GRPO has no signal; the policy carries over
            log(f"[update] {part}: all {manifest.extra['filtered_groups']} groups were filtered; policy carried over")
            _write_checkpoint(target, src, None, {"skipped": "all groups filtered", "source": str(src),
                                                  "trainer": prev_state})
            if not is_committed(inputs.metrics_dir):
                write_shard(inputs.metrics_dir, pa.Table.from_pylist([{"run_id": run_id, "iteration": iteration, "stage": "update",
                            "step": 0, "name": "skipped", "value": 1.0}], schema=METRICS), METRICS, "skip")
            return target
        raise UpdateError(f"{part}: the purified shard has no rows; nothing to train on")
    if cfg.train.strategy == "deepspeed":
        from trainer.distributed import launch

        return launch(cfg, run_id, iteration, stop_after, log)
    model = load_policy(cfg, inputs)
    update = GRPOUpdate(model, cfg.train, cfg.rollout.temperature)
    if prev_state is not None:
        update.load_state_dict(prev_state)  # AdamW moments and the schedule continue across iterations
    key = inputs.key(cfg)
    partial = target.with_name(target.name + ".partial.pt")
    progress = load_partial(partial, model, update, key) or UpdateProgress()
    if progress.minibatches_done:
        log(f"[update] resuming after mini-batch {progress.minibatches_done}")
    pad = model.config.pad_token_id or 0
    t0 = time.perf_counter()
    update.run(inputs.rows, pad, progress, after_minibatch=lambda p: save_partial(partial, model, update, p, key),
               stop_after=stop_after)
    log_steps(progress.metrics, log)
    if stop_after is not None:
        return partial  # interrupted on purpose (tests): resume by calling again
    _write_checkpoint(target, src, model, {"source": str(src), "rows": len(inputs.rows), "purified": str(part),
                                           "wall_s": time.perf_counter() - t0, "trainer": update.state_dict()})
    write_update_metrics(run_id, iteration, inputs, progress.metrics, key)
    partial.unlink(missing_ok=True)
    return target
