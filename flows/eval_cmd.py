"""`cleaner eval --world`: a policy on the world's held-out tasks with the real agent loop."""
from __future__ import annotations

import json
import time
from pathlib import Path

from pipeline.config import CleanerConfig
from rollout_gen.agent import RolloutIdentity
from rollout_gen.evaluate import world_metrics
from rollout_gen.stage import make_engine, roll_out
from pipeline.chat import load_chat
from storage.checkpoints import policy_version
from rollout_gen.tasks import Task
from rollout_gen.world.tasks import eval_tasks

METRICS_FILE = "metrics.json"
# Fields that depend on wall-clock time, not on the policy: excluded when comparing reruns.
TIMING_FIELDS = ("generated_tokens_per_s", "wall_s")


def evaluate_world(cfg: CleanerConfig, checkpoint: Path, limit: int | None = None, show_progress: bool = True) -> dict:
    return evaluate(cfg, checkpoint, eval_tasks(cfg.world)[:limit], show_progress)


def evaluate(cfg: CleanerConfig, checkpoint: Path, tasks: list[Task], show_progress: bool = True) -> dict:
    """pass@1 and tool metrics of one sample per task with the real agent loop."""
    cfg = cfg.model_copy(deep=True)
    cfg.rollout.samples_per_prompt = 1
    chat = load_chat(checkpoint, cfg.rollout.chat_template_kwargs)
    engine = make_engine(cfg, checkpoint, chat)
    identity = RolloutIdentity("eval", 0, policy_version(checkpoint), cfg.rollout.seed)
    t0 = time.perf_counter()
    try:
        trajectories = roll_out(cfg, engine, chat, tasks, identity, show_progress)
    finally:
        engine.close()
    metrics = world_metrics(trajectories, time.perf_counter() - t0)
    metrics["settings"] = {
        "tasks": len(tasks), "temperature": cfg.rollout.temperature, "seed": cfg.rollout.seed,
        "saar_live_mode": cfg.rollout.saar.live_mode, "max_retries": cfg.rollout.saar.max_retries,
        "world": cfg.world.model_dump(), "policy_version": identity.policy_version,
    }
    return metrics


def write_metrics(metrics: dict, path: Path) -> None:
    path.write_text(json.dumps(metrics, indent=1, sort_keys=True) + "\n")
