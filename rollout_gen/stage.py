"""Phase 1 as a stage: one iteration's rollouts from a checkpoint into a committed raw shard, as plan
(`plan_rollout`) → roll out → commit."""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import pyarrow as pa

from pipeline.chat import ChatFormat, load_chat
from pipeline.config import CleanerConfig
from storage.errors import CheckpointError, check_writable_root
from pipeline.progress import StageProgress
from pipeline.trajectory import Trajectory, trajectory_to_row
from rollout_gen.agent import SEEDING, AgentLoop, RolloutIdentity
from pipeline.engines import Engine
from rollout_gen.sandbox import SandboxPool
from rollout_gen.tasks import Task, TaskFileError, load_task_parquet
from rollout_gen.world.tasks import training_tasks
from storage.checkpoints import checkpoint_for, policy_version
from storage.identity import StageIdentity, check_committed, stage_identity
from storage.layout import RunLayout, record_path
from storage.schemas import RAW
from storage.shards import CommittedMeanwhile, Manifest, ShardWriter, read_manifest


def iteration_tasks(cfg: CleanerConfig, iteration: int) -> list[Task]:
    n = cfg.rollout.tasks_per_iteration
    if cfg.rollout.tasks == "world":
        return training_tasks(cfg.world, n, seed=cfg.rollout.seed * 100_003 + iteration)
    pool = load_task_parquet(cfg.rollout.tasks)
    if len(pool) < n:  # an iteration would hold some task twice: two rows with one key
        raise TaskFileError(
            f"{cfg.rollout.tasks}: {len(pool)} distinct tasks, fewer than rollout.tasks_per_iteration "
            f"({n}); lower it to at most {len(pool)}"
        )
    start = iteration * n
    return [pool[(start + i) % len(pool)] for i in range(n)]


def make_engine(cfg: CleanerConfig, checkpoint: Path, chat: ChatFormat) -> Engine:
    if cfg.rollout.engine == "sglang":
        from pipeline.engines.sglang import SGLangEngine

        engine = SGLangEngine(cfg.rollout.sglang_url, checkpoint)
        engine.serve(checkpoint)  # after an update, the server still holds the previous weights
        return engine
    if cfg.rollout.engine == "vllm":
        from pipeline.engines.vllm import connect

        return connect(cfg.rollout, checkpoint, chat.tokenizer)  # serves `checkpoint`, reloaded after an update
    from rollout_gen.engines.cpu import CPUEngine

    return CPUEngine(
        checkpoint,
        threads=cfg.rollout.engine_tuning.threads,
        pad_id=chat.tokenizer.pad_token_id,
        kv_cache_tokens=cfg.rollout.engine_tuning.kv_cache_tokens,
        device=cfg.rollout.device,
    )


def roll_out(
    cfg: CleanerConfig,
    engine: Engine,
    chat: ChatFormat,
    tasks: list[Task],
    identity: RolloutIdentity,
    show_progress: bool = True,
    log: Callable[[str], None] | None = None,
) -> list[Trajectory]:
    """Every task × samples_per_prompt through the agent loop; progress on stderr (or through `log`)."""
    total = len(tasks) * cfg.rollout.samples_per_prompt
    with SandboxPool(cfg.rollout.sandbox) as sandbox:
        loop = AgentLoop(engine, sandbox, chat, cfg.rollout)
        if not show_progress:
            return loop.run(tasks, identity)
        with StageProgress(f"rollout it {identity.iteration}", "trajectories", total, log=log) as bar:
            return loop.run(tasks, identity, progress=lambda done, _total, note: bar.update(done, note))


def rollout_identity(cfg: CleanerConfig, version: str) -> StageIdentity:
    """What a raw shard's rows depend on: the rollout and world settings and the policy's weights (`version`)."""
    return stage_identity(cfg, lambda c: f"{c.section_hash('rollout', 'world')}/{version}")


def sampling_checkpoint(cfg: CleanerConfig, run_id: str, iteration: int, committed: bool) -> Path | None:
    """The policy `iteration` samples from (storage.checkpoints.checkpoint_for). None when the iteration's output is
    committed and that policy is gone (removed by `cleaner gc` since): nothing is left to compare it with."""
    try:
        found = checkpoint_for(cfg.storage.root, run_id, iteration, cfg.rollout.policy)
    except CheckpointError:
        if committed:
            return None
        raise
    return None if committed and not found.is_dir() else found


@dataclass(frozen=True)
class RolloutPlan:
    """A rollout of one iteration, decided before anything loads: keep the committed raw shard `kept`, or roll
    `tasks` out from `checkpoint` into `out`."""

    run_id: str
    iteration: int
    out: Path
    kept: Manifest | None = None
    checkpoint: Path | None = None
    version: str = ""  # the checkpoint's weights' hash: the rows' policy_version
    identity: str = ""  # what the shard records as its config hash
    tasks: tuple[Task, ...] = ()

    @property
    def note(self) -> str:
        """The plan in a log line."""
        if self.kept is not None:
            return f"raw shard already committed ({self.kept.rows} trajectories): kept"
        return f"loading {self.checkpoint} and starting the sandbox"


def plan_rollout(cfg: CleanerConfig, run_id: str, iteration: int, checkpoint: Path | None = None) -> RolloutPlan:
    """Every check of a rollout before anything loads. `checkpoint`: the policy to sample from (default: the run's
    checkpoint of the iteration). A committed shard is kept when made from the same inputs, or when that checkpoint
    is gone since; one made from other inputs is refused."""
    out = RunLayout(cfg.storage.root, run_id).raw_dir(iteration)
    check_writable_root(cfg.storage.root)  # before the rollout's work, not at its commit
    done = read_manifest(out)
    checkpoint = checkpoint or sampling_checkpoint(cfg, run_id, iteration, committed=done is not None)
    if checkpoint is None:
        return RolloutPlan(run_id, iteration, out, kept=done)
    version = policy_version(checkpoint)
    identity = rollout_identity(cfg, version)
    if done is not None:
        check_committed(
            out,
            done.config_hash,
            identity,
            made_with="with other rollout settings",
            remedy="raw shards are never overwritten: use a new flow.run_id",
        )
        return RolloutPlan(run_id, iteration, out, kept=done)
    return RolloutPlan(
        run_id,
        iteration,
        out,
        checkpoint=checkpoint,
        version=version,
        identity=identity.value,
        tasks=tuple(iteration_tasks(cfg, iteration)),
    )


def _roll_out_planned(
    cfg: CleanerConfig, plan: RolloutPlan, show_progress: bool, log: Callable[[str], None] | None
) -> tuple[list[Trajectory], float]:
    """The planned trajectories and the seconds they took."""
    chat = load_chat(plan.checkpoint, cfg.rollout.chat_template_kwargs)
    engine = make_engine(cfg, plan.checkpoint, chat)
    identity = RolloutIdentity(plan.run_id, plan.iteration, plan.version, cfg.rollout.seed)
    t0 = time.perf_counter()
    try:
        trajectories = roll_out(
            cfg,
            engine=engine,
            chat=chat,
            tasks=list(plan.tasks),
            identity=identity,
            show_progress=show_progress,
            log=log,
        )
    finally:
        engine.close()
    return trajectories, time.perf_counter() - t0


def _commit(
    cfg: CleanerConfig,
    plan: RolloutPlan,
    trajectories: list[Trajectory],
    wall: float,
    log: Callable[[str], None] | None,
) -> Manifest:
    """The raw shard, refused when no prompt fitted rollout.max_prompt_tokens."""
    too_long = sum(t.finish_reason == "prompt_too_long" for t in trajectories)
    if trajectories and too_long == len(trajectories):  # a shard of empty rows would train nothing, silently
        raise TaskFileError(
            f"every prompt of iteration {plan.iteration} is longer than rollout.max_prompt_tokens "
            f"({cfg.rollout.max_prompt_tokens} tokens, the chat template's system prompt and tools "
            "included): raise it; nothing was written"
        )
    if too_long and log is not None:  # the CLI says it from the manifest; a flow's log must too
        log(
            f"[rollout it {plan.iteration}] {too_long // cfg.rollout.samples_per_prompt} of "
            f"{cfg.rollout.tasks_per_iteration} prompts are longer than rollout.max_prompt_tokens "
            f"({cfg.rollout.max_prompt_tokens}): not rolled out, their rows end prompt_too_long with reward -1; raise "
            "rollout.max_prompt_tokens"
        )
    past, limit = past_max_positions(plan.checkpoint, trajectories)
    if past and log is not None:
        log(f"[rollout it {plan.iteration}] {past_positions_note(past, limit)}")
    table = pa.Table.from_pylist([trajectory_to_row(t) for t in trajectories], schema=RAW)
    try:
        return _write(cfg, plan, table, trajectories, wall=wall, too_long=too_long, past=past)
    except CommittedMeanwhile as e:  # another process rolled out the same inputs and committed first: its shard
        if log is not None:
            log(f"[rollout it {plan.iteration}] {e}")
        return e.manifest


def _write(
    cfg: CleanerConfig,
    plan: RolloutPlan,
    table: pa.Table,
    trajectories: list[Trajectory],
    *,
    wall: float,
    too_long: int,
    past: int,
) -> Manifest:
    with ShardWriter(
        plan.out,
        RAW,
        plan.identity,
        inputs=[record_path(cfg.storage.root, plan.checkpoint)],
        rows_per_part=cfg.storage.rows_per_part,
        compression=cfg.storage.compression,
    ) as w:
        w.write(table)
        generated = sum(t.stats.generated_tokens for t in trajectories)
        return w.commit(
            {
                "wall_s": wall,
                "generated_tokens": generated,
                "policy_version": plan.version,
                "mean_reward": sum(t.reward for t in trajectories) / max(1, len(trajectories)),
                "prompt_too_long": too_long,
                "past_max_positions": past,
                # how the rows were lived and seeded, for readers without run.json (replay)
                "saar": cfg.rollout.saar.model_dump(mode="json"),
                "seeding": SEEDING,
            }
        )


def past_max_positions(checkpoint: Path, trajectories: list[Trajectory]) -> tuple[int, int]:
    """(trajectories longer than the policy's max_position_embeddings, that limit; 0 when config.json has none).
    Nothing stops a rollout there (rollout.max_*_tokens do): positions past it were never trained, RoPE
    extrapolates, and a vLLM server would refuse them without VLLM_ALLOW_LONG_MAX_MODEL_LEN; so it is said."""
    from pipeline.engines.vllm_server import model_max_len

    limit = model_max_len(checkpoint)
    if not limit:
        return 0, 0
    return sum(len(t.prompt_ids) + len(t.lived_ids or []) > limit for t in trajectories), limit


def past_positions_note(past: int, limit: int, rolled_out: bool = True) -> str:
    rows = "trajectory runs" if past == 1 else "trajectories run"
    return f"{past} {rows} past the policy's max_position_embeddings ({limit}): positions it was never " + (
        "trained at (RoPE extrapolates there); keep rollout.max_prompt_tokens + rollout.max_response_tokens "
        f"within {limit} to stay inside"
        if rolled_out
        else "trained at (RoPE extrapolates there); an update trains them all the same"
    )


def run_rollout_plan(
    cfg: CleanerConfig, plan: RolloutPlan, show_progress: bool = True, log: Callable[[str], None] | None = None
) -> Manifest:
    """The planned rollout and its commit; the committed shard when the plan keeps it."""
    if plan.kept is not None:
        return plan.kept
    from storage.locks import WriterLock

    # one rollout of an iteration at a time: the second is refused at once, not after its whole rollout
    with WriterLock.beside(plan.out, f"the raw shard {plan.out}"):
        done = read_manifest(plan.out)
        if done is not None:  # committed by the one that held the lock before: the plan's checks, again
            return plan_rollout(cfg, plan.run_id, plan.iteration, plan.checkpoint).kept or done
        trajectories, wall = _roll_out_planned(cfg, plan, show_progress, log)
        return _commit(cfg, plan, trajectories, wall, log)


def run_rollout_stage(
    cfg: CleanerConfig,
    run_id: str,
    iteration: int,
    checkpoint: Path | None = None,
    show_progress: bool = True,
    log: Callable[[str], None] | None = None,
) -> Manifest:
    """Write `iteration`'s raw shard: plan, roll out, commit (a shard committed from the same inputs is kept)."""
    return run_rollout_plan(cfg, plan_rollout(cfg, run_id, iteration, checkpoint), show_progress, log)
