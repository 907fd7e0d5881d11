"""The training flow's evaluation as a stage: checkpoint i on the held-out tasks (flow.eval_tasks), SAAR at test
time on and off, written as iteration i's metrics shard (stage=eval), which the catalog's `metrics` view and
`cleaner report` read. A shard committed with the same inputs is kept, so a rerun of the flow resumes.

Metric names: `<setting>/<benchmark>/<metric>` for setting saar_on | saar_off, benchmark `all` or a task
source, metric pass@k, pass@k_se, tool_failures_per_trajectory, first_call_failure_rate, …; and
`<setting>/<metric>` for the run's wall_s, generated_tokens_per_s and latency_p50_s / latency_p90_s.
"""
from __future__ import annotations

import hashlib
import json
import math
from pathlib import Path
from typing import Callable

import pyarrow as pa

from pipeline.config import CleanerConfig
from rollout_gen.eval_run import evaluate_tasks
from rollout_gen.tasks import Task, load_task_parquet
from rollout_gen.world.tasks import eval_tasks
from storage.checkpoints import policy_version
from storage.errors import check_writable_root
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


def eval_config_hash(cfg: CleanerConfig, version: str) -> str:
    """What the shard's numbers depend on: the eval settings, the task file's bytes, rollout and world, the policy."""
    f = cfg.flow
    source = "world" if f.eval_tasks == "world" else hashlib.blake2b(Path(f.eval_tasks).read_bytes(), digest_size=8).hexdigest()
    data = {"tasks": source, "samples": f.eval_samples, "limit": f.eval_limit, "settings": eval_settings(cfg),
            "sections": cfg.section_hash("rollout", "world"), "policy": version}
    return hashlib.blake2b(json.dumps(data, sort_keys=True).encode(), digest_size=8).hexdigest()


def _value(v: object) -> float | None:
    return None if v is None or (isinstance(v, float) and math.isnan(v)) else float(v)


def metric_records(run_id: str, iteration: int, setting: str, metrics: dict) -> list[dict]:
    """One METRICS row per number of one setting's evaluation (names in the module docstring)."""
    values: dict[str, object] = {}
    for bench, group in metrics["benchmarks"].items():
        values.update({f"{setting}/{bench}/{k}": v for k, v in group.items()})
    values.update({f"{setting}/wall_s": metrics["wall_s"], f"{setting}/generated_tokens_per_s":
                   metrics["generated_tokens_per_s"], f"{setting}/latency_p50_s": metrics["latency_s"]["p50"],
                   f"{setting}/latency_p90_s": metrics["latency_s"]["p90"]})
    return [{"run_id": run_id, "iteration": iteration, "stage": STAGE, "step": 0, "name": name, "value": _value(v)}
            for name, v in values.items()]


def run_eval_stage(cfg: CleanerConfig, run_id: str, iteration: int, checkpoint: Path,
                   log: Callable[[str], None] = print) -> tuple[Manifest, bool]:
    """(the committed eval shard of `iteration`, whether it was already there)."""
    out = RunLayout(cfg.storage.root, run_id).metrics_dir(iteration, STAGE)
    check_writable_root(cfg.storage.root)
    tasks = held_out_tasks(cfg)  # a bad task file fails here, before any rollout
    config_hash = eval_config_hash(cfg, policy_version(checkpoint))
    done = read_manifest(out)
    if done is not None:
        if done.config_hash != config_hash:
            log(f"[eval it {iteration}] kept the evaluation committed with other settings (config "
                f"{done.config_hash}, now {config_hash}); remove {out} to evaluate again")
        return done, True
    records, extra = [], {}
    for setting in eval_settings(cfg):
        c = cfg.model_copy(deep=True)
        c.rollout.saar.gate_p = SETTINGS[setting]
        m = evaluate_tasks(c, checkpoint, tasks, cfg.flow.eval_samples, show_progress=False).metrics
        records += metric_records(run_id, iteration, setting, m)
        overall = m["benchmarks"]["all"]
        extra[setting] = {"pass@1": overall["pass@1"], "wall_s": m["wall_s"]}
        log(f"[eval it {iteration}] {setting}: avg@{cfg.flow.eval_samples} pass@1 {overall['pass@1']:.3f}, "
            f"tool failures/trajectory {overall['tool_failures_per_trajectory']:.3f}, {m['wall_s']:.1f} s")
    manifest = write_shard(out, pa.Table.from_pylist(records, schema=METRICS), METRICS, config_hash,
                           extra={"checkpoint": record_path(cfg.storage.root, checkpoint), "tasks": len(tasks), **extra})
    return manifest, False
