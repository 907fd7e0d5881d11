"""What an update of one iteration reads and how its checkpoint is written, the same for every
strategy (trainer/stage.py: local; trainer/distributed.py: torchrun ranks)."""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass, field
from pathlib import Path

import pyarrow as pa
import torch

from pipeline.config import CleanerConfig, hashed_train_settings
from pipeline.variants import trained_variant
from storage.checkpoints import DONE_MARKER, check_checkpoint, checkpoint_for, files_as_umask_says, policy_version
from storage.errors import CheckpointError
from storage.identity import identity_hash
from storage.layout import RunLayout, missing_run, record_path, resolve_recorded
from storage.schemas import METRICS, PURIFIED, readable_as
from storage.shards import Manifest, ShardMissing, read_manifest, read_shard, write_shard
from trainer.batches import BEHAVIOUR_COLUMN, TRAINING_COLUMNS, training_rows
from trainer.dpo import read_pairs
from trainer.grpo import UpdateError
from trainer.torch_files import save_torch

TRAINER_STATE = "trainer_state.pt"  # the local strategy's optimizer/schedule state (DeepSpeed's: deepspeed/)
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "chat_template.jinja",
    "special_tokens_map.json",
    "generation_config.json",
)


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
    dpo_pairs: list = field(default_factory=list)  # train.use_dpo_on_tool_calls: trainer.dpo.CallPairs of the raw shard
    dpo_skipped: int = 0  # positions whose lived prefix is not their recorded context

    def key(self, cfg: CleanerConfig) -> str:
        """Identifies a partial update: resumable only with the same inputs and settings."""
        src = record_path(cfg.storage.root, self.src)  # the same key wherever the store was moved
        return identity_hash([self.manifest.config_hash, hashed_train_settings(cfg.train), src])


def trained_partition(cfg: CleanerConfig, run_id: str, iteration: int) -> tuple[Path, Manifest, list[str]]:
    """The purified partition an update trains on (train.mode at its threshold, under the run's measure), its manifest,
    and the columns training reads from it."""
    variant = trained_variant(cfg)  # under the run's own measure (rollout.saar, frozen in run.json)
    part = RunLayout(cfg.storage.root, run_id).purified_dir(
        iteration, variant.mode, variant.threshold, variant.measure_key
    )
    manifest = read_manifest(part)
    if manifest is None:
        missing = missing_run(cfg.storage.root, run_id)  # a mistyped run or root: not a purify to run first
        if missing:
            raise ShardMissing(missing)
        raise ShardMissing(
            f"{part}: no purified shard for train.mode={cfg.train.mode} ({variant.partition}) "
            f"(run `cleaner purify --run {run_id} --iteration {iteration}` first, with this command's "
            "-c and overrides)"
        )
    # behaviour log-probs where the shard has them (purified schema version 2 on); older shards still train
    has_behaviour = BEHAVIOUR_COLUMN in getattr(readable_as(manifest.schema, PURIFIED), "names", ())
    if cfg.train.rollout_correction != "off" and not has_behaviour:
        raise UpdateError(
            f"{part}: written as {manifest.schema}, without the behaviour_logprobs that "
            f"train.rollout_correction={cfg.train.rollout_correction} needs; re-purify it "
            f"(cleaner purify --iteration {iteration}) or set train.rollout_correction=off"
        )
    return part, manifest, TRAINING_COLUMNS + ([BEHAVIOUR_COLUMN] if has_behaviour else [])


def load_rows(cfg: CleanerConfig, run_id: str, iteration: int):
    part, manifest, columns = trained_partition(cfg, run_id, iteration)
    return part, manifest, training_rows(read_shard(part, PURIFIED, columns=columns))


def check_compatible(checkpoint: Path, model: torch.nn.Module, rows, raw_manifest) -> None:
    vocab = model.get_input_embeddings().weight.shape[0]
    top = max((max(r.prompt_ids + r.response_ids) for r in rows), default=0)
    if top >= vocab:
        raise UpdateError(
            f"{checkpoint}: token id {top} in the purified shard is outside the model's vocabulary "
            f"({vocab}); the shard was tokenized for another tokenizer"
        )
    sampled_by = (raw_manifest.extra or {}).get("policy_version") if raw_manifest else None
    if sampled_by and sampled_by != policy_version(checkpoint):
        raise UpdateError(
            f"{checkpoint}: weights {policy_version(checkpoint)} are not the policy that sampled this "
            f"iteration ({sampled_by}); GRPO's old log-probs would not match"
        )


def update_source(cfg: CleanerConfig, run_id: str, iteration: int) -> Path:
    """Checkpoint `iteration`, the policy an update of the iteration trains, its weight files whole."""
    raw = read_manifest(RunLayout(cfg.storage.root, run_id).raw_dir(iteration))
    # iteration 0 trains the policy that sampled it, as its raw shard records it (rollout.policy may be another
    # now: `cleaner update` without the override the rollout had); later ones, the run's own checkpoint
    source = (
        resolve_recorded(cfg.storage.root, raw.inputs[0])
        if iteration == 0 and raw is not None and raw.inputs
        else checkpoint_for(cfg.storage.root, run_id, iteration, cfg.rollout.policy)
    )
    check_checkpoint(source)  # whole weight files before any is loaded
    return source


# subfolder of a checkpoint the DeepSpeed strategy writes: its ZeRO-partitioned optimizer and scheduler state
DS_STATE = "deepspeed"


def check_trainer_state(cfg: CleanerConfig, src: Path) -> None:
    """Training on from a checkpoint the run wrote itself needs the optimizer state this strategy reads:
    trainer_state.pt for the local strategy, the ZeRO partitions under deepspeed/ of as many ranks at the same stage
    for DeepSpeed. Without it the update would silently restart AdamW's moments and the LR warm-up in the middle of
    a run (the initial policy has none), or fail inside DeepSpeed after its ranks started."""
    marker = src / DONE_MARKER
    if not marker.is_file() or cfg.train.fresh_optimizer:
        return  # the initial policy, or a fresh optimizer asked for: nothing to continue
    try:
        record = json.loads(marker.read_text())
    except ValueError:
        record = {}
    written = record.get("strategy", "local")
    fresh = (
        f"start a new run from these weights (flow.run_id=NEW rollout.policy={src}), or restart the optimizer "
        "knowingly (train.fresh_optimizer=true)"
    )
    t = cfg.train
    if t.strategy == "local":
        path = src / TRAINER_STATE
        if not path.is_file():
            made = f"; the checkpoint was written by train.strategy={written}" if written != "local" else ""
            raise CheckpointError(
                f"{path}: missing, so this update would restart the optimizer (AdamW moments, LR "
                f"schedule) mid-run{made}; "
                + ("continue with its strategy, or " if made else "restore the file, or ")
                + fresh
            )
        return
    if not (src / DS_STATE).is_dir():
        raise CheckpointError(
            f"{src / DS_STATE}: missing (the checkpoint was written by train.strategy={written}), so this DeepSpeed "
            f"update would restart the optimizer (AdamW moments, LR schedule) mid-run; continue with "
            f"train.strategy={written}, or {fresh}"
        )
    ranks, stage = record.get("ranks"), record.get("zero_stage")
    if (ranks, stage) != (t.nproc, t.zero_stage) and ranks is not None:
        raise CheckpointError(
            f"{src / DS_STATE}: ZeRO-{stage} state of {ranks} rank(s), but this update asks train.nproc={t.nproc} "
            f"train.zero_stage={t.zero_stage}: DeepSpeed loads a ZeRO checkpoint only as it was partitioned; use "
            f"train.nproc={ranks} train.zero_stage={stage}, or {fresh}"
        )


def trainer_state(src: Path) -> dict | None:
    """The optimizer and schedule state to continue from (None: the initial policy, or a DeepSpeed checkpoint)."""
    path = src / TRAINER_STATE
    if not path.is_file():
        return None
    try:
        return torch.load(path, weights_only=False, map_location="cpu")  # the optimizer moves it to its weights
    except Exception as e:  # noqa: BLE001 - torch raises several types for a damaged file
        raise CheckpointError(f"{path}: unreadable optimizer state ({type(e).__name__}); restore the file") from None


def update_inputs(cfg: CleanerConfig, run_id: str, iteration: int) -> UpdateInputs:
    layout = RunLayout(cfg.storage.root, run_id)
    source = update_source(cfg, run_id, iteration)
    part, manifest, rows = load_rows(cfg, run_id, iteration)
    inputs = UpdateInputs(
        target=layout.checkpoint_dir(iteration + 1),
        src=source,
        part=part,
        manifest=manifest,
        rows=rows,
        raw_manifest=read_manifest(layout.raw_dir(iteration)),
        metrics_dir=layout.metrics_dir(iteration, "update"),
    )
    if cfg.train.use_dpo_on_tool_calls:  # pairs of failed calls and working retries, from the raw shard
        inputs.dpo_pairs, inputs.dpo_skipped = read_pairs(layout.raw_dir(iteration))
    return inputs


def dpo_note(inputs: UpdateInputs) -> str:
    return (
        f"[update] DPO on tool calls: {len(inputs.dpo_pairs)} pairs of a failed call and its working retry from "
        f"the raw shard"
        + (
            f" ({inputs.dpo_skipped} positions skipped: lived prefix is not their recorded context)"
            if inputs.dpo_skipped
            else ""
        )
    )


# The update trains with torch's scaled_dot_product_attention by default (train.attn_implementation): eager
# attention keeps a length × length score and probability tensor per head and layer for backward (2.8 vs 1.8 GiB
# peak for two 4k rows on the Qwen3-shaped policy); SDPA's fused kernel does not.
UPDATE_ATTENTION = "sdpa"


def load_policy(cfg: CleanerConfig, inputs: UpdateInputs, device: torch.device | None = None) -> torch.nn.Module:
    """The policy to train, on `device` (None: the CPU, where DeepSpeed takes it from)."""
    from pipeline.policy_model import load_causal_lm  # (torch and transformers load with the trainer)

    model = load_causal_lm(inputs.src, attn_implementation=cfg.train.attn_implementation, device=device)
    check_compatible(inputs.src, model, inputs.rows, inputs.raw_manifest)
    torch.set_num_threads(max(1, cfg.rollout.engine_tuning.threads))
    return model


def log_steps(metrics: list, log) -> None:
    for m in metrics:
        entropy = "n/a" if m.entropy is None else f"{m.entropy:.3f}"  # not measured reads as such, never as 0
        corrected = (
            ""
            if m.correction_filtered is None
            else (
                f" is-filtered {m.correction_filtered:.3f} behaviour-kl (k1 estimate, may be < 0) {m.behaviour_kl:+.4f}"
            )
        )
        dpo = "" if m.dpo_pairs is None else f" dpo {m.dpo_loss:.4f} ({m.dpo_pairs} pairs)"
        log(
            f"[update] step {m.step}: loss {m.loss:+.4f} clip {m.clip_ratio:.3f} kl {m.approx_kl:+.4f} "
            f"grad {m.grad_norm:.3f} entropy {entropy} tokens {m.tokens}{corrected}{dpo}"
        )


# metrics an update writes only when its option is on (train.rollout_correction, train.use_dpo_on_tool_calls)
OPTIONAL_METRICS = ("correction_filtered", "behaviour_kl", "dpo_loss", "dpo_pairs", "dpo_capped")


def update_metric_records(run_id: str, iteration: int, metrics: list) -> list[dict]:
    """The METRICS rows of an update's steps."""
    records = [
        {
            "run_id": run_id,
            "iteration": iteration,
            "stage": "update",
            "step": m.step,
            "name": name,
            "value": None if getattr(m, name) is None else float(getattr(m, name)),
        }  # null: not measured
        for m in metrics
        for name in ("loss", "clip_ratio", "approx_kl", "grad_norm", "entropy", "tokens", "lr", "seconds")
    ]
    records += [
        {
            "run_id": run_id,
            "iteration": iteration,
            "stage": "update",
            "step": m.step,
            "name": name,
            "value": float(getattr(m, name)),
        }
        for m in metrics
        for name in OPTIONAL_METRICS
        if getattr(m, name) is not None
    ]
    return records


def commit_metrics(metrics_dir: Path, records: list[dict], config_hash: str) -> None:
    """The iteration's update metrics shard, committed just before its checkpoint, unless an earlier attempt of the
    same update committed it. An attempt with other settings that failed between the two left metrics that are not
    this checkpoint's: they are replaced (nothing trained on them, no checkpoint names them)."""
    before = read_manifest(metrics_dir)
    if before is not None and before.config_hash == config_hash:
        return
    if before is not None:
        shutil.rmtree(metrics_dir)
    write_shard(metrics_dir, pa.Table.from_pylist(records, schema=METRICS), METRICS, config_hash)


def write_update_metrics(run_id: str, iteration: int, inputs: UpdateInputs, metrics: list, key: str) -> None:
    commit_metrics(inputs.metrics_dir, update_metric_records(run_id, iteration, metrics), key)


def copy_tokenizer_files(src: Path, out: Path) -> None:
    """The source checkpoint's tokenizer files beside the new weights (an update never loads a tokenizer)."""
    for name in TOKENIZER_FILES:
        if (src / name).is_file():
            shutil.copy2(src / name, out / name)


def staging_dir(target: Path) -> Path:
    return target.with_name(target.name + ".tmp")


def start_checkpoint(target: Path) -> Path:
    """A fresh staging folder (staging_dir) beside `target` for the new checkpoint's files."""
    tmp = staging_dir(target)
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    return tmp


def write_checkpoint(target: Path, src: Path, model: torch.nn.Module | None, state: dict | None, record: dict) -> None:
    """Checkpoint `target`, the local strategy's way: the trained `model`'s weights (None: `src`'s carried over) and
    the tokenizer, the optimizer and schedule `state`, then `record`, committed as finish_checkpoint does."""
    tmp = start_checkpoint(target)
    try:
        if model is None:
            shutil.rmtree(tmp)
            shutil.copytree(src, tmp, ignore=shutil.ignore_patterns(DONE_MARKER, TRAINER_STATE))
        else:
            model.save_pretrained(tmp, safe_serialization=True)
            copy_tokenizer_files(src, tmp)
        save_torch(state, tmp / TRAINER_STATE)  # a full disk is an OSError naming the file
        finish_checkpoint(tmp, target, record)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)  # a failed write (full disk) leaves no half checkpoint
        raise


def finish_checkpoint(tmp: Path, target: Path, record: dict) -> None:
    """The one way a checkpoint is committed, whatever the strategy: the record as `_CHECKPOINT.json`,
    then the staging folder renamed into place, so a checkpoint appears whole or not at all."""
    files_as_umask_says(tmp)
    (tmp / DONE_MARKER).write_text(json.dumps(record, indent=1))
    tmp.rename(target)
