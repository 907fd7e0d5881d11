"""Phase 3 as a stage: iteration I's purified partition + checkpoint I → checkpoint I+1, as plan (`plan_update`) →
train → commit.

Checkpoint I is the policy that sampled iteration I (for I = 0, rollout.policy when the run has no
copy of its own). The new checkpoint is written to a temporary folder and renamed into place: it
appears whole or not at all, and an existing one is never overwritten.

Torch and the trainer (seconds of OpenRLHF and transformers) are imported only once there is something to train: a
committed update is kept, by the flow and by `cleaner update`, without them.
"""

from __future__ import annotations

import shutil
import sys
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Literal

from pipeline.config import CleanerConfig, hashed_train_settings
from storage.checkpoints import committed_update, newest_checkpoint
from storage.errors import check_writable_root
from storage.identity import StageIdentity, stage_identity
from storage.layout import RunLayout, record_path

if TYPE_CHECKING:
    from trainer.inputs import UpdateInputs

# Outside a terminal (a flow's log, a pipe), a progress line at most this often, at the end of a micro-batch
PROGRESS_EVERY_S = 3.0


def update_identity(cfg: CleanerConfig) -> StageIdentity:
    """What a checkpoint records of the update that trained it: the train settings that decide what it computes
    (pipeline.config.hashed_train_settings), as `train_settings` in its _CHECKPOINT.json."""
    return stage_identity(cfg, lambda c: hashed_train_settings(c.train))


@dataclass(frozen=True)
class UpdatePlan:
    """An update of one iteration, decided before the trainer loads: keep checkpoint I+1 (committed, or removed by
    `cleaner gc` after the run went on past it), carry the policy over (every group filtered: nothing to train), or
    train checkpoint I (`source`) on the purified partition `part`."""

    layout: RunLayout
    iteration: int
    identity: StageIdentity
    outcome: Literal["kept", "removed", "carry_over", "train"] = "train"
    newest: int = 0  # the run's newest checkpoint
    source: Path | None = None
    part: Path | None = None
    filtered_groups: int = 0

    @property
    def run_id(self) -> str:
        return self.layout.run_id

    @property
    def target(self) -> Path:
        return self.layout.checkpoint_dir(self.iteration + 1)

    @property
    def metrics_dir(self) -> Path:
        return self.layout.metrics_dir(self.iteration, "update")

    @property
    def kept(self) -> bool:
        return self.outcome in ("kept", "removed")

    @property
    def note(self) -> str:
        """The plan in a log line."""
        if self.outcome == "kept":
            return f"checkpoint {self.target.name} already committed: kept"
        if self.outcome == "removed":
            return (
                f"checkpoint {self.target.name} was removed (cleaner gc); the run went on to checkpoint "
                f"{self.newest}: kept as done"
            )
        return f"loading the trainer (torch, OpenRLHF) and checkpoint {self.iteration}"


def _plan_training(cfg: CleanerConfig, plan: UpdatePlan) -> UpdatePlan:
    """What training needs, before the trainer loads anything: the device, a writable root, checkpoint I's weights
    whole (and its optimizer state, when the run wrote it), the purified partition; one without rows trains nothing."""
    from trainer.devices import check_partition_fits, check_train_device
    from trainer.grpo import UpdateError
    from trainer.inputs import check_trainer_state, trained_partition, update_source

    check_train_device(cfg.train)
    check_writable_root(cfg.storage.root, create=False)  # before training, not at the first checkpoint write
    source = update_source(cfg, plan.run_id, plan.iteration)
    part, manifest, _ = trained_partition(cfg, plan.run_id, plan.iteration)
    check_trainer_state(cfg, source)
    planned = replace(plan, source=source, part=part)
    if manifest.rows:
        check_partition_fits(cfg, part)
        return planned
    filtered = manifest.extra.get("filtered_groups", 0)
    if not filtered:
        raise UpdateError(f"{part}: the purified shard has no rows; nothing to train on")
    # the documented skip: every group had one reward, so GRPO has no signal
    return replace(planned, outcome="carry_over", filtered_groups=filtered)


def plan_update(cfg: CleanerConfig, run_id: str, iteration: int) -> UpdatePlan:
    """Every check of an update before it trains. Checkpoint I+1 committed by an update with these train settings is
    kept (with others: refused); removed by `cleaner gc` once the run trained past it, it is done (training it again
    is waste)."""
    layout = RunLayout(cfg.storage.root, run_id)
    plan = UpdatePlan(layout, iteration, update_identity(cfg), outcome="kept")
    if committed_update(plan.target, plan.identity):
        return plan
    newest = newest_checkpoint(layout)
    if newest > iteration + 1:
        return replace(plan, outcome="removed", newest=newest)
    return _plan_training(cfg, replace(plan, outcome="train"))


def _stderr(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


@dataclass(frozen=True)
class _Work:
    """What an update's work leaves to commit: the trained policy (None: checkpoint I's weights carry over), the
    optimizer and schedule state to continue from, the checkpoint's record and the iteration's update metrics."""

    model: object | None
    trainer_state: dict | None
    record: dict
    metrics: list[dict]
    metrics_hash: str


def _provenance(cfg: CleanerConfig, plan: UpdatePlan) -> dict:
    return {"train_settings": plan.identity.value, "source": record_path(cfg.storage.root, plan.source)}


def _carried_over(cfg: CleanerConfig, plan: UpdatePlan, log: Callable[[str], None]) -> _Work:
    from trainer.inputs import trainer_state

    state = trainer_state(plan.source)
    log(f"[update] {plan.part}: all {plan.filtered_groups} groups were filtered; policy carried over")
    skipped = {
        "run_id": plan.run_id,
        "iteration": plan.iteration,
        "stage": "update",
        "step": 0,
        "name": "skipped",
        "value": 1.0,
    }
    return _Work(
        model=None,
        trainer_state=state,
        record={"skipped": "all groups filtered", **_provenance(cfg, plan)},
        metrics=[skipped],
        metrics_hash="skip",
    )


def build_trainer(cfg: CleanerConfig, inputs: UpdateInputs, log: Callable[[str], None]) -> tuple:
    """The policy on its device and its GRPO update, optimizer and schedule continued from checkpoint I."""
    from pipeline.devices import prepare_device, resolve_device
    from trainer.grpo import GRPOUpdate
    from trainer.inputs import dpo_note, load_policy, trainer_state

    prev_state = None if cfg.train.fresh_optimizer else trainer_state(inputs.src)
    device = resolve_device(cfg.train.device, "train.device")
    prepare_device(device)
    model = load_policy(cfg, inputs, device)
    update = GRPOUpdate(model, cfg.train, cfg.rollout.temperature, device)
    if cfg.train.use_dpo_on_tool_calls:
        update.set_dpo_pairs(inputs.dpo_pairs)
        log(dpo_note(inputs))
    if prev_state is not None:
        update.load_state_dict(prev_state)  # AdamW moments and the schedule continue across iterations
    elif cfg.train.fresh_optimizer:
        log("[update] optimizer and schedule start fresh (train.fresh_optimizer)")
    return model, update


def _train(
    cfg: CleanerConfig,
    plan: UpdatePlan,
    stop_after: int | None,
    log: Callable[[str], None],
    progress_log: Callable[[str], None] | None,
) -> _Work | None:
    """GRPO on the planned partition, saved after every mini-batch so that a rerun resumes after the last one;
    None when stopped after `stop_after` of them."""
    from pipeline.progress import StageProgress
    from trainer.grpo import UpdateProgress, total_minibatches
    from trainer.inputs import log_steps, update_inputs, update_metric_records
    from trainer.resume import load_local, partial_dir, save_local

    inputs = update_inputs(cfg, plan.run_id, plan.iteration)
    model, update = build_trainer(cfg, inputs, log)
    key = inputs.key(cfg)
    partial = partial_dir(plan.target)
    progress = load_local(partial, model, update, key) or UpdateProgress()
    if progress.minibatches_done:
        log(f"[update] resuming after mini-batch {progress.minibatches_done}")
        log_steps(progress.metrics, log)
    t0 = time.perf_counter()
    total, resumed = total_minibatches(inputs.rows, cfg.train), progress.minibatches_done
    with StageProgress(
        f"update it {plan.iteration}", "mini-batches", total - resumed, log=progress_log, every_s=PROGRESS_EVERY_S
    ) as bar:

        def micro_batch_done(done: int, of: int) -> None:
            bar.update(
                progress.minibatches_done - resumed,
                note=f"mini-batch {progress.minibatches_done + 1}/{total}: micro-batch {done}/{of}",
            )

        def minibatch_done(p: UpdateProgress) -> None:
            save_local(partial, model, update, p, key)
            log_steps(p.metrics[-1:], log)  # each step's line when it is taken, not all at the end
            bar.update(p.minibatches_done - resumed)

        update.on_micro_batch = micro_batch_done
        update.run(
            inputs.rows, model.config.pad_token_id or 0, progress, after_minibatch=minibatch_done, stop_after=stop_after
        )
    if stop_after is not None:
        return None
    record = {
        **_provenance(cfg, plan),
        "rows": len(inputs.rows),
        "purified": record_path(cfg.storage.root, plan.part),
        "wall_s": time.perf_counter() - t0,
    }
    return _Work(
        model=model,
        trainer_state=update.state_dict(),
        record=record,
        metrics=update_metric_records(plan.run_id, plan.iteration, progress.metrics),
        metrics_hash=key,
    )


def _commit(plan: UpdatePlan, work: _Work) -> Path:
    """The iteration's update metrics, then checkpoint I+1; the partial update goes. Metrics first: a committed
    checkpoint skips the update on a rerun, so metrics that were to follow it were lost to a kill between the two
    (a rerun after a kill before the checkpoint trains again, to the same metrics, and keeps these)."""
    from trainer.inputs import commit_metrics, write_checkpoint
    from trainer.resume import partial_dir

    commit_metrics(plan.metrics_dir, work.metrics, work.metrics_hash)
    write_checkpoint(plan.target, plan.source, work.model, work.trainer_state, work.record)
    shutil.rmtree(partial_dir(plan.target), ignore_errors=True)
    return plan.target


def run_update_plan(
    cfg: CleanerConfig, plan: UpdatePlan, stop_after: int | None = None, log: Callable[[str], None] | None = None
) -> Path:
    """The planned update and its commit: checkpoint I+1 (the partial update when stopped after `stop_after`
    mini-batches, as tests do). `log`: where its lines and progress go (a flow's run logger); None: stderr, with a
    bar on a terminal."""
    if plan.kept:
        return plan.target
    from storage.locks import WriterLock

    # one update of a checkpoint at a time: two shared its staging and partial folders (the loser failed in
    # rmtree, "Directory not empty"); another live one is refused in one line
    with WriterLock.beside(plan.target, f"checkpoint {plan.target}"):
        if committed_update(plan.target, plan.identity):  # committed by the one that held the lock before
            return plan.target
        progress_log, log = log, log or _stderr
        if plan.outcome == "carry_over":
            return _commit(plan, _carried_over(cfg, plan, log))
        if cfg.train.strategy == "deepspeed":
            from trainer.distributed import launch

            return launch(cfg, plan.run_id, plan.iteration, stop_after, log)  # its ranks train and commit
        work = _train(cfg, plan, stop_after, log, progress_log)
        if work is None:
            from trainer.resume import partial_dir

            return partial_dir(plan.target)
        return _commit(plan, work)


def run_update_stage(
    cfg: CleanerConfig,
    run_id: str,
    iteration: int,
    stop_after: int | None = None,
    log: Callable[[str], None] | None = None,
) -> Path:
    """Checkpoint `iteration` + 1: plan, train, commit (run_update_plan)."""
    return run_update_plan(cfg, plan_update(cfg, run_id, iteration), stop_after, log)
