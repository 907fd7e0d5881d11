"""The training flow's evaluation as a stage: checkpoint i on the held-out tasks (flow.eval_tasks), SAAR at test
time on and off, written as iteration i's metrics shard (stage=eval), which the catalog's `metrics` view and
`cleaner report` read; as plan (`plan_eval`) → evaluate → commit. A shard committed from the same inputs is kept, so a
rerun of the flow resumes.

Metric names: `<setting>/<benchmark>/<metric>` for setting saar_on | saar_off, benchmark `all` or a task
source, metric pass@k, pass@k_se, tool_failures_per_trajectory, first_call_failure_rate, …; and
`<setting>/<metric>` for the run's wall_s, generated_tokens_per_s and latency_p50_s / latency_p90_s.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import pyarrow as pa

from pipeline.config import CleanerConfig
from rollout_gen.eval_run import evaluate_tasks
from rollout_gen.tasks import Task, load_task_parquet
from rollout_gen.world.tasks import eval_tasks
from rollout_gen.stage import sampling_checkpoint
from storage.checkpoints import policy_version
from storage.errors import check_writable_root
from storage.identity import StageIdentity, check_committed, file_digest, stage_identity
from storage.layout import RunLayout, record_path
from storage.schemas import METRICS
from storage.shards import Manifest, read_manifest, write_shard

STAGE = "eval"
# At test time SAAR is either on for every trajectory or off: the training gate's coin does not apply.
SETTINGS = {"saar_on": 1.0, "saar_off": 0.0}


def held_out_tasks(cfg: CleanerConfig) -> list[Task]:
    tasks = eval_tasks(cfg.world) if cfg.flow.eval_tasks == "world" else load_task_parquet(cfg.flow.eval_tasks)
    return tasks[: cfg.flow.eval_limit]


def check_eval_settings(cfg: CleanerConfig) -> None:
    """flow.eval_every's k and task file, refused before a training flow writes anything (`cleaner train` checks
    them before it starts Prefect, the flow again for a deployment's firings)."""
    if cfg.flow.eval_every:
        from rollout_gen.eval_run import check_samples

        check_samples(cfg, cfg.flow.eval_samples, "flow.eval_samples")
        held_out_tasks(cfg)


def eval_settings(cfg: CleanerConfig) -> list[str]:
    return ["saar_on", "saar_off"] if cfg.flow.eval_saar_off else ["saar_on"]


def _record(cfg: CleanerConfig, version: str, digest_size: int = 16) -> dict:
    f = cfg.flow
    source = "world" if f.eval_tasks == "world" else file_digest(f.eval_tasks, digest_size)
    return {
        "tasks": source,
        "samples": f.eval_samples,
        "limit": f.eval_limit,
        "settings": eval_settings(cfg),
        "sections": cfg.section_hash("rollout", "world"),
        "policy": version,
    }


def eval_identity(cfg: CleanerConfig, version: str) -> StageIdentity:
    """What the shard's numbers depend on: the eval settings, the task file's bytes, rollout and world, the policy
    (`version`). Shards committed before the one task-file digest recorded the file's 8-byte digest."""
    return stage_identity(cfg, lambda c: _record(c, version), lambda c: _record(c, version, digest_size=8))


def _value(v: object) -> float | None:
    return None if v is None or (isinstance(v, float) and math.isnan(v)) else float(v)


def metric_records(run_id: str, iteration: int, setting: str, metrics: dict) -> list[dict]:
    """One METRICS row per number of one setting's evaluation (names in the module docstring)."""
    values: dict[str, object] = {}
    for bench, group in metrics["benchmarks"].items():
        values.update({f"{setting}/{bench}/{k}": v for k, v in group.items()})
    values.update(
        {
            f"{setting}/wall_s": metrics["wall_s"],
            f"{setting}/generated_tokens_per_s": metrics["generated_tokens_per_s"],
            f"{setting}/latency_p50_s": metrics["latency_s"]["p50"],
            f"{setting}/latency_p90_s": metrics["latency_s"]["p90"],
        }
    )
    return [
        {"run_id": run_id, "iteration": iteration, "stage": STAGE, "step": 0, "name": name, "value": _value(v)}
        for name, v in values.items()
    ]


@dataclass(frozen=True)
class EvalPlan:
    """An evaluation of one checkpoint, decided before anything loads: keep the committed shard `kept`, or evaluate
    `checkpoint` on `tasks` into `out`."""

    run_id: str
    iteration: int
    out: Path
    kept: Manifest | None = None
    checkpoint: Path | None = None
    identity: str = ""  # what the shard records as its config hash
    tasks: tuple[Task, ...] = ()

    @property
    def note(self) -> str:
        """The plan in a log line."""
        if self.kept is not None:
            return "evaluation already committed: kept"
        return f"evaluating {self.checkpoint} on {len(self.tasks)} held-out tasks"


def plan_eval(cfg: CleanerConfig, run_id: str, iteration: int, checkpoint: Path | None = None) -> EvalPlan:
    """Every check of an evaluation before anything loads. `checkpoint`: the policy evaluated (default: the run's
    checkpoint `iteration`). A committed shard is kept when made from the same inputs, or when that checkpoint is
    gone since; one made from other inputs is refused."""
    out = RunLayout(cfg.storage.root, run_id).metrics_dir(iteration, STAGE)
    check_writable_root(cfg.storage.root)
    tasks = held_out_tasks(cfg)  # a bad task file fails here, before any rollout
    done = read_manifest(out)
    checkpoint = checkpoint or sampling_checkpoint(cfg, run_id, iteration, committed=done is not None)
    if checkpoint is None:
        return EvalPlan(run_id, iteration, out, kept=done)
    identity = eval_identity(cfg, policy_version(checkpoint))
    if done is not None:
        check_committed(
            out,
            done.config_hash,
            identity,
            made_with="with other evaluation settings (flow.eval_*)",
            remedy=f"remove {out} to evaluate it again, or rerun with the settings it was evaluated with",
        )
        return EvalPlan(run_id, iteration, out, kept=done)
    return EvalPlan(run_id, iteration, out, checkpoint=checkpoint, identity=identity.value, tasks=tuple(tasks))


def run_eval_plan(cfg: CleanerConfig, plan: EvalPlan, log: Callable[[str], None] = print) -> tuple[Manifest, bool]:
    """The planned evaluation, each setting in turn, and its commit: (the committed shard, whether it was kept)."""
    if plan.kept is not None:
        return plan.kept, True
    records, extra = [], {}
    for setting in eval_settings(cfg):
        c = cfg.model_copy(deep=True)
        c.rollout.saar.gate_p = SETTINGS[setting]
        m = evaluate_tasks(c, plan.checkpoint, list(plan.tasks), cfg.flow.eval_samples, show_progress=False).metrics
        records += metric_records(plan.run_id, plan.iteration, setting, m)
        overall = m["benchmarks"]["all"]
        extra[setting] = {"pass@1": overall["pass@1"], "wall_s": m["wall_s"]}
        log(
            f"[eval it {plan.iteration}] {setting}: avg@{cfg.flow.eval_samples} pass@1 {overall['pass@1']:.3f}, "
            f"tool failures/trajectory {overall['tool_failures_per_trajectory']:.3f}, {m['wall_s']:.1f} s"
        )
    extra = {"checkpoint": record_path(cfg.storage.root, plan.checkpoint), "tasks": len(plan.tasks), **extra}
    manifest = write_shard(plan.out, pa.Table.from_pylist(records, schema=METRICS), METRICS, plan.identity, extra=extra)
    return manifest, False


def run_eval_stage(
    cfg: CleanerConfig, run_id: str, iteration: int, checkpoint: Path | None = None, log: Callable[[str], None] = print
) -> tuple[Manifest, bool]:
    """Evaluate checkpoint `iteration` into its metrics shard: plan, evaluate, commit. Returns the committed shard
    and whether it was already there."""
    return run_eval_plan(cfg, plan_eval(cfg, run_id, iteration, checkpoint), log)
