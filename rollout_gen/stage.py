"""Phase 1 as a stage: one iteration's rollouts from a checkpoint into a committed raw shard."""
from __future__ import annotations

import hashlib
import time
from pathlib import Path
from typing import Callable

import pyarrow as pa

from pipeline.chat import ChatFormat, load_chat
from pipeline.config import CleanerConfig
from storage.errors import check_writable_root
from pipeline.progress import StageProgress
from pipeline.trajectory import Trajectory, trajectory_to_row
from rollout_gen.agent import SEEDING, AgentLoop, RolloutIdentity
from pipeline.engines import Engine
from rollout_gen.sandbox import SandboxPool
from rollout_gen.tasks import Task, TaskFileError, load_task_parquet
from rollout_gen.world.tasks import training_tasks
from storage.checkpoints import policy_version
from storage.layout import RunLayout, record_path
from storage.schemas import RAW
from storage.shards import Manifest, ShardError, ShardWriter, read_manifest


def iteration_tasks(cfg: CleanerConfig, iteration: int) -> list[Task]:
    n = cfg.rollout.tasks_per_iteration
    if cfg.rollout.tasks == "world":
        return training_tasks(cfg.world, n, seed=cfg.rollout.seed * 100_003 + iteration)
    pool = load_task_parquet(cfg.rollout.tasks)
    if len(pool) < n:  # an iteration would hold some task twice: two rows with one key
        raise TaskFileError(f"{cfg.rollout.tasks}: {len(pool)} distinct tasks, fewer than rollout.tasks_per_iteration "
                            f"({n}); lower it to at most {len(pool)}")
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

    return CPUEngine(checkpoint, threads=cfg.rollout.engine_tuning.threads, pad_id=chat.tokenizer.pad_token_id,
                     kv_cache_tokens=cfg.rollout.engine_tuning.kv_cache_tokens, device=cfg.rollout.device)


def roll_out(cfg: CleanerConfig, engine: Engine, chat: ChatFormat, tasks: list[Task], identity: RolloutIdentity,
             show_progress: bool = True, log: Callable[[str], None] | None = None) -> list[Trajectory]:
    """Every task × samples_per_prompt through the agent loop; progress on stderr (or through `log`)."""
    total = len(tasks) * cfg.rollout.samples_per_prompt
    with SandboxPool(cfg.rollout.sandbox) as sandbox:
        loop = AgentLoop(engine, sandbox, chat, cfg.rollout)
        if not show_progress:
            return loop.run(tasks, identity)
        with StageProgress(f"rollout it {identity.iteration}", "trajectories", total, log=log) as bar:
            return loop.run(tasks, identity, progress=lambda done, _total, note: bar.update(done, note))


def _hash(cfg: CleanerConfig, version: str) -> str:
    return hashlib.blake2b(f"{cfg.section_hash('rollout', 'world')}/{version}".encode(), digest_size=8).hexdigest()


def rollout_config_hash(cfg: CleanerConfig, version: str) -> str:
    """What a raw shard's rows depend on: the rollout and world settings and the policy, not how many threads the
    engine used (speed only, as the frozen run.json has it: a flow resumed with other threads keeps its shards)."""
    same = cfg.model_copy(deep=True)
    same.rollout.engine_tuning.threads = type(cfg.rollout.engine_tuning).model_fields["threads"].default
    return _hash(same, version)


def committed_with_same_inputs(done: Manifest, cfg: CleanerConfig, version: str) -> bool:
    """A committed raw shard's identity is this config's; shards committed before threads left the identity hashed
    the config with its threads (the same value at the default)."""
    return done.config_hash in (rollout_config_hash(cfg, version), _hash(cfg, version))


def run_rollout_stage(cfg: CleanerConfig, run_id: str, iteration: int, checkpoint: Path,
                      show_progress: bool = True, log: Callable[[str], None] | None = None) -> Manifest:
    """Write `iteration`'s raw shard; a shard already committed with the same inputs is kept."""
    layout = RunLayout(cfg.storage.root, run_id)
    out = layout.raw_dir(iteration)
    check_writable_root(cfg.storage.root)  # before the rollout's work, not at its commit
    version = policy_version(checkpoint)
    config_hash = rollout_config_hash(cfg, version)
    done = read_manifest(out)
    if done is not None:
        if not committed_with_same_inputs(done, cfg, version):
            raise ShardError(f"{out}: committed with other rollout settings or another cleaner version (config "
                             f"{done.config_hash}, now {config_hash}); use a new flow.run_id — raw shards are never "
                             "overwritten")
        return done
    chat = load_chat(checkpoint, cfg.rollout.chat_template_kwargs)
    engine = make_engine(cfg, checkpoint, chat)
    identity = RolloutIdentity(run_id, iteration, version, cfg.rollout.seed)
    t0 = time.perf_counter()
    try:
        trajectories = roll_out(cfg, engine, chat, iteration_tasks(cfg, iteration), identity, show_progress, log)
    finally:
        engine.close()
    wall = time.perf_counter() - t0
    too_long = sum(t.finish_reason == "prompt_too_long" for t in trajectories)
    if trajectories and too_long == len(trajectories):  # a shard of empty rows would train nothing, silently
        raise TaskFileError(f"every prompt of iteration {iteration} is longer than rollout.max_prompt_tokens "
                            f"({cfg.rollout.max_prompt_tokens} tokens, the chat template's system prompt and tools "
                            "included): raise it; nothing was written")
    if too_long and log is not None:  # the CLI says it from the manifest; a flow's log must too
        log(f"[rollout it {iteration}] {too_long // cfg.rollout.samples_per_prompt} of {cfg.rollout.tasks_per_iteration} "
            f"prompts are longer than rollout.max_prompt_tokens ({cfg.rollout.max_prompt_tokens}): not rolled out, "
            "their rows end prompt_too_long with reward -1; raise rollout.max_prompt_tokens")
    table = pa.Table.from_pylist([trajectory_to_row(t) for t in trajectories], schema=RAW)
    with ShardWriter(out, RAW, config_hash, inputs=[record_path(cfg.storage.root, checkpoint)],
                     rows_per_part=cfg.storage.rows_per_part,
                     compression=cfg.storage.compression) as w:
        w.write(table)
        generated = sum(t.stats.generated_tokens for t in trajectories)
        return w.commit({"wall_s": wall, "generated_tokens": generated, "policy_version": version,
                         "mean_reward": sum(t.reward for t in trajectories) / max(1, len(trajectories)),
                         "prompt_too_long": too_long,
                         # how the rows were lived and seeded, for readers without run.json (replay)
                         "saar": cfg.rollout.saar.model_dump(mode="json"), "seeding": SEEDING})
