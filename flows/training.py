"""Prefect flows: the training loop, γ replay and evaluation. Tasks are thin wrappers of the stages;
every stage skips work whose committed output already exists, so rerunning a flow resumes it."""
from __future__ import annotations

import re
from pathlib import Path
from typing import Callable

from prefect import flow, get_run_logger, task
from prefect.artifacts import create_markdown_artifact
from prefect.cache_policies import NONE
from prefect.states import Completed, State

from flows.console import quiet_libraries, user_errors_once
from flows.env import retry_unless_user_error, user_errors_without_tracebacks
from flows.run_config import freeze_run_config
from pipeline.config import CleanerConfig, load_config
from storage.layout import RunLayout

quiet_libraries()  # flows served by a deployment run in a fresh process that starts here
user_errors_without_tracebacks()
user_errors_once()


def describe_purified(purified: list[tuple[str, float, int, int]]) -> str:
    """`saar γ=0.50: 60 rows (4 dead letters), raw: 64 rows` from the purify task's (mode, γ, rows, dead)."""
    parts = []
    for mode, gamma, rows, dead in purified:
        name = f"{mode} γ={gamma:.2f}" if mode == "saar" else mode
        parts.append(f"{name}: {rows} rows" + (f" ({dead} dead letters)" if dead else ""))
    return ", ".join(parts) or "nothing"


def publish_catalog(cfg: CleanerConfig, warn: Callable[[str], None]) -> None:
    """Republish <root>/catalog.duckdb after a stage committed (never fails the flow)."""
    from storage.catalog import publish_quietly

    publish_quietly(cfg.storage.root, cfg.storage.root / cfg.storage.catalog, warn)


def _cfg(config_file: str | None, overrides: list[str] | None) -> CleanerConfig:
    return load_config(config_file, overrides or [])


def _result(value: object, skipped: bool) -> object:
    """A stage's result as the task's final state: a skipped stage reads `Completed('skipped (committed)')`
    in the run log instead of a plain `Completed()`."""
    return Completed(message="skipped (committed)", data=value) if skipped else value


def _value(result: object) -> object:
    return result.result() if isinstance(result, State) else result


@task(name="rollout", cache_policy=NONE)
def rollout_task(cfg: CleanerConfig, run_id: str, iteration: int) -> int:
    from rollout_gen.stage import run_rollout_stage
    from storage.checkpoints import checkpoint_for

    from storage.shards import read_manifest

    log = get_run_logger().info
    done = read_manifest(RunLayout(cfg.storage.root, run_id).raw_dir(iteration))
    if done is not None:  # resumed: its checkpoint may have been removed by `cleaner gc` since
        log(f"[rollout it {iteration}] raw shard already committed ({done.rows} trajectories): kept")
        return _result(done.rows, True)
    checkpoint = checkpoint_for(cfg.storage.root, run_id, iteration, cfg.rollout.policy)
    log(f"[rollout it {iteration}] loading {checkpoint} and starting the sandbox")
    manifest = run_rollout_stage(cfg, run_id, iteration, checkpoint, log=log)
    return _result(manifest.rows, False)


@task(name="purify", cache_policy=NONE)
def purify_task(cfg: CleanerConfig, run_id: str, iteration: int, modes: list[str], gammas: list[float]) -> list:
    from purifier.stage import run_purify_stage

    log = get_run_logger().info
    log(f"[purify it {iteration}] modes {', '.join(modes)} × γ {', '.join(f'{g:g}' for g in gammas)} on Beam "
        f"({cfg.purify.runner})")
    results = run_purify_stage(cfg, run_id, iteration, modes, gammas)
    skipped = all(r.skipped for r in results)
    log(f"[purify it {iteration}] {describe_purified([(r.mode, r.gamma, r.rows, r.dead) for r in results])}"
        + (": already committed, kept" if skipped else ""))
    return _result([(r.mode, r.gamma, r.rows, r.dead) for r in results], skipped)


@task(name="update", cache_policy=NONE)
def update_task(cfg: CleanerConfig, run_id: str, iteration: int) -> str:
    from storage.checkpoints import DONE_MARKER

    log = get_run_logger().info
    target = RunLayout(cfg.storage.root, run_id).checkpoint_dir(iteration + 1)
    if (target / DONE_MARKER).is_file():  # kept without importing the trainer (seconds of torch and OpenRLHF)
        log(f"[update it {iteration}] checkpoint {target.name} already committed: kept")
        return _result(str(target), True)
    log(f"[update it {iteration}] loading the trainer (torch, OpenRLHF) and checkpoint {iteration}")
    from trainer.stage import run_update_stage

    return _result(str(run_update_stage(cfg, run_id, iteration, log=log)), False)


def _artifact(cfg: CleanerConfig, run_id: str, iteration: int) -> None:
    from flows.report import iteration_table, markdown_table

    rows = [r for r in iteration_table(cfg.storage.root, run_id) if r["iteration"] == iteration]
    if rows:
        from flows.trackers import log_iteration

        log_iteration(cfg, run_id, rows[0])
    key = re.sub(r"[^a-z0-9-]+", "-", f"{run_id}-iteration-{iteration}".lower())  # Prefect's key alphabet
    create_markdown_artifact(key=key,
                             markdown=f"# {run_id} iteration {iteration}\n\n" + markdown_table(rows)
                             + f"\n\nPlots: `cleaner report --run {run_id}` writes "
                             f"[runs/{run_id}/report/index.html]({(cfg.storage.root / 'runs' / run_id / 'report' / 'index.html').resolve().as_uri()})",
                             description=f"cleaner metrics of iteration {iteration}")


def trained_iterations(cfg: CleanerConfig, run_id: str) -> int:
    """How many iterations of the run are done: their update's checkpoint is committed (done marker)."""
    from storage.checkpoints import DONE_MARKER

    layout = RunLayout(cfg.storage.root, run_id)
    n = 0
    while (layout.checkpoint_dir(n + 1) / DONE_MARKER).is_file():
        n += 1
    return n


def run_id_for(template: str, run_id: str, now: float | None = None) -> str:
    """A firing's run id from a template: {run_id} the configured one, {date} / {time} the firing's local
    date (YYYYMMDD) and time (HHMMSS); e.g. 'nightly-{date}'."""
    import time

    t = time.localtime(now)
    return template.format(run_id=run_id, date=time.strftime("%Y%m%d", t), time=time.strftime("%H%M%S", t))


@flow(name="cleaner-training")
def training_flow(config_file: str | None = None, overrides: list[str] | None = None, more: bool = False,
                  run_id_template: str | None = None) -> str:
    """N iterations of rollout → purify → update; resumes where a previous attempt stopped. `more` (what a
    schedule's firings use): N more iterations after the run's last trained one. `run_id_template`: a new
    run per firing, named from the template (`run_id_for`)."""
    cfg = _cfg(config_file, overrides)
    run_id = run_id_for(run_id_template, cfg.flow.run_id) if run_id_template else cfg.flow.run_id
    if cfg.flow.eval_every:  # a bad k or eval task file is refused before anything is written
        from rollout_gen.eval_run import check_samples
        from rollout_gen.eval_stage import held_out_tasks

        check_samples(cfg, cfg.flow.eval_samples, "flow.eval_samples")
        held_out_tasks(cfg)
    freeze_run_config(cfg, run_id)
    log = get_run_logger()
    retries = cfg.flow.task_retries
    modes = list(dict.fromkeys([*cfg.purify.modes, cfg.train.mode]))
    gammas = list(dict.fromkeys([*cfg.purify.gammas, cfg.train.gamma]))
    checkpoint = ""
    start = trained_iterations(cfg, run_id) if more else 0
    if start:
        log.info(f"run {run_id}: {start} iterations trained; training iterations {start} to "
                 f"{start + cfg.flow.iterations - 1}")
    again = {"retries": retries, "retry_condition_fn": retry_unless_user_error}
    for i in range(start, start + cfg.flow.iterations):
        if cfg.flow.eval_every and i % cfg.flow.eval_every == 0:  # the policy this iteration rolls out from
            _value(eval_stage_task.with_options(**again)(cfg, run_id, i))
            publish_catalog(cfg, log.warning)
        n = _value(rollout_task.with_options(**again)(cfg, run_id, i))
        publish_catalog(cfg, log.warning)  # every committed shard is queryable at once
        purified = _value(purify_task.with_options(**again)(cfg, run_id, i, modes, gammas))
        publish_catalog(cfg, log.warning)
        checkpoint = _value(update_task.with_options(**again)(cfg, run_id, i))
        publish_catalog(cfg, log.warning)
        log.info(f"iteration {i}: {n} trajectories; purified {describe_purified(purified)}; checkpoint {checkpoint}")
        _artifact(cfg, run_id, i)
    if cfg.flow.eval_every:  # the last checkpoint, always
        _value(eval_stage_task.with_options(**again)(cfg, run_id, start + cfg.flow.iterations))
        publish_catalog(cfg, log.warning)
    return checkpoint


@flow(name="cleaner-replay")
def replay_flow(config_file: str | None = None, overrides: list[str] | None = None,
                iterations: list[int] | None = None, gammas: list[float] | None = None,
                modes: list[str] | None = None) -> list:
    """Purify stored raw shards under several (mode, γ) without regenerating anything."""
    cfg = _cfg(config_file, overrides)
    out = []
    for i in iterations if iterations is not None else [0]:
        out += _value(purify_task(cfg, cfg.flow.run_id, i, modes or ["saar"], gammas or cfg.flow.replay_gammas))
        publish_catalog(cfg, get_run_logger().warning)
    return out


@task(name="eval", cache_policy=NONE)
def eval_stage_task(cfg: CleanerConfig, run_id: str, iteration: int) -> dict:
    """Checkpoint `iteration` on flow.eval_tasks, SAAR at test time on and off, into iteration's metrics shard."""
    from rollout_gen.eval_stage import STAGE, run_eval_stage
    from storage.checkpoints import checkpoint_for
    from storage.shards import read_manifest

    done = read_manifest(RunLayout(cfg.storage.root, run_id).metrics_dir(iteration, STAGE))
    if done is not None:  # resumed: kept as committed (its checkpoint may be gone since)
        return _result(done.extra, True)
    ckpt = checkpoint_for(cfg.storage.root, run_id, iteration, cfg.rollout.policy)
    manifest, _ = run_eval_stage(cfg, run_id, iteration, ckpt, log=get_run_logger().info)
    return _result(manifest.extra, False)


@task(name="evaluate", cache_policy=NONE)
def eval_task(cfg: CleanerConfig, checkpoint: str, saar: bool, tasks_file: str | None = None, samples: int = 1,
              limit: int | None = None) -> dict:
    from rollout_gen.eval_run import evaluate_tasks
    from rollout_gen.tasks import load_task_parquet
    from rollout_gen.world.tasks import eval_tasks

    c = cfg.model_copy(deep=True)
    c.rollout.saar.gate_p = 1.0 if saar else 0.0  # at test time SAAR is on for every trajectory, or off
    tasks = load_task_parquet(tasks_file) if tasks_file else eval_tasks(cfg.world)
    return evaluate_tasks(c, Path(checkpoint), tasks[:limit], samples, show_progress=False).metrics


@flow(name="cleaner-eval")
def eval_flow(config_file: str | None = None, overrides: list[str] | None = None, checkpoint: str | None = None,
              tasks_file: str | None = None, samples: int = 1, limit: int | None = None) -> dict:
    """avg@k pass@1, pass@k, tool errors and latency of a checkpoint, with SAAR at test time on and off."""
    cfg = _cfg(config_file, overrides)
    ckpt = checkpoint or str(cfg.rollout.policy)
    result = {}
    for saar in (True, False):
        m = eval_task(cfg, ckpt, saar, tasks_file, samples, limit)
        overall = m["benchmarks"]["all"]
        result["saar_on" if saar else "saar_off"] = {
            "pass@1": m["accuracy"], **{k: v for k, v in overall.items() if k.startswith("pass@") and k != "pass@1"},
            "tool_failures_per_trajectory": overall["tool_failures_per_trajectory"],
            "first_call_failure_rate": m["first_call_failure_rate"], "generated_tokens": m["generated_tokens"],
            "generated_tokens_per_s": m["generated_tokens_per_s"], "latency_p50_s": m["latency_s"]["p50"],
            "wall_s": m["wall_s"]}
    on, off = result["saar_on"], result["saar_off"]
    result["saar_latency_overhead"] = on["wall_s"] / off["wall_s"] - 1 if off["wall_s"] else None
    create_markdown_artifact(key="cleaner-eval", markdown="| setting | pass@1 | tool failures / trajectory | "
                             "first-call failure rate | wall s |\n|---|---|---|---|---|\n" + "\n".join(
                                 f"| {k} | {v['pass@1']:.3f} | {v['tool_failures_per_trajectory']:.3f} | "
                                 f"{v['first_call_failure_rate']:.3f} | {v['wall_s']:.1f} |"
                                 for k, v in result.items() if isinstance(v, dict)))
    return result
