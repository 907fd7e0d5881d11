"""One training iteration, top to bottom: rollout → purify → update, as Prefect tasks of one flow.

    task     reads                                    writes (under runs/RUN/)
    rollout  checkpoint I (rollout.policy for I = 0)  iteration=I/raw
    purify   iteration=I/raw                          iteration=I/purified/mode=M/gamma=G and dead_letter/…
    update   checkpoint I, the purified partition     checkpoints/iteration=I+1, iteration=I/metrics/stage=update
             pipeline.variants.trained_variant names
    eval     checkpoint I (flow.eval_every)           iteration=I/metrics/stage=eval

Each task calls its stage (rollout_gen/, purifier/, trainer/ `stage.py`) and logs; the stage's plan decides, as it
does for `cleaner rollout/purify/update`, that an output committed from the same inputs is kept, so rerunning the
flow resumes it. After every commit the catalog is republished; after every iteration its metrics go to the flow's
page (flows/trackers.py).
"""

from __future__ import annotations

from prefect import flow, get_run_logger, task
from prefect.cache_policies import NONE
from prefect.states import Completed, State

from flows.console import quiet_libraries, user_errors_once
from flows.env import retry_unless_user_error
from flows.run_config import freeze_run_config, preflight, publish_catalog, run_id_for, trained_iterations
from flows.trackers import record_iteration
from pipeline.config import CleanerConfig, load_config

quiet_libraries()  # flows served by a deployment run in a fresh process that starts here
user_errors_once()  # and without tracebacks


def as_state(value: object, skipped: bool) -> object:
    """A stage's result as the task's final state: a skipped stage reads `Completed('skipped (committed)')`
    in the run log instead of a plain `Completed()`."""
    return Completed(message="skipped (committed)", data=value) if skipped else value


def value(result: object) -> object:
    return result.result() if isinstance(result, State) else result


def describe_purified(purified: list[tuple[str, float, int, int]]) -> str:
    """`saar γ=0.50: 60 rows (4 dead letters), raw: 64 rows` from the purify task's (mode, threshold, rows, dead):
    the threshold is γ for saar, the only mode the line names it for."""
    parts = []
    for mode, threshold, rows, dead in purified:
        name = f"{mode} γ={threshold:.2f}" if mode == "saar" else mode
        parts.append(f"{name}: {rows} rows" + (f" ({dead} dead letters)" if dead else ""))
    return ", ".join(parts) or "nothing"


@task(name="rollout", cache_policy=NONE)
def rollout_task(cfg: CleanerConfig, run_id: str, iteration: int) -> int:
    from rollout_gen.stage import plan_rollout, run_rollout_plan

    log = get_run_logger().info
    plan = plan_rollout(cfg, run_id, iteration)
    log(f"[rollout it {iteration}] {plan.note}")
    return as_state(run_rollout_plan(cfg, plan, log=log).rows, plan.kept is not None)


@task(name="purify", cache_policy=NONE)
def purify_task(cfg: CleanerConfig, run_id: str, iteration: int, variants: list | None = None) -> list:
    from pipeline.variants import describe, plan_variants
    from purifier.stage import run_purify_stage

    log = get_run_logger().info
    variants = variants or plan_variants(cfg)  # the flow's: the trained partition among them
    log(f"[purify it {iteration}] {describe(variants)} on Beam ({cfg.purify.runner})")
    results = run_purify_stage(cfg, run_id, iteration, variants)
    purified, skipped = [(r.mode, r.threshold, r.rows, r.dead) for r in results], all(r.skipped for r in results)
    log(f"[purify it {iteration}] {describe_purified(purified)}" + (": already committed, kept" if skipped else ""))
    return as_state(purified, skipped)


@task(name="update", cache_policy=NONE)
def update_task(cfg: CleanerConfig, run_id: str, iteration: int) -> str:
    from trainer.stage import plan_update, run_update_plan

    log = get_run_logger().info
    plan = plan_update(cfg, run_id, iteration)
    log(f"[update it {iteration}] {plan.note}")
    return as_state(str(run_update_plan(cfg, plan, log=log)), plan.kept)


@task(name="eval", cache_policy=NONE)
def eval_stage_task(cfg: CleanerConfig, run_id: str, iteration: int) -> dict:
    """Checkpoint `iteration` on flow.eval_tasks, SAAR at test time on and off, into iteration's metrics shard."""
    from rollout_gen.eval_stage import plan_eval, run_eval_plan

    log = get_run_logger().info
    plan = plan_eval(cfg, run_id, iteration)
    log(f"[eval it {iteration}] {plan.note}")
    return as_state(run_eval_plan(cfg, plan, log=log)[0].extra, plan.kept is not None)


@flow(name="cleaner-training")
def training_flow(
    config_file: str | None = None,
    overrides: list[str] | None = None,
    more: bool = False,
    run_id_template: str | None = None,
) -> str:
    """N iterations of rollout → purify → update; resumes where a previous attempt stopped. `more` (what a
    schedule's firings use): N more iterations after the run's last trained one. `run_id_template`: a new
    run per firing, named from the template (`run_id_for`)."""
    import os

    from pipeline.processes import SCHEDULE_PID_ENV, keep_interrupts_from_finalizers, stop_when_orphaned

    keep_interrupts_from_finalizers()  # a schedule's firing is a process of its own: Ctrl-C is not lost there either
    if os.environ.get(SCHEDULE_PID_ENV, "").isdigit():  # a firing ends with its schedule, however that ends
        stop_when_orphaned(int(os.environ[SCHEDULE_PID_ENV]), "schedule")
    cfg = load_config(config_file, overrides or [])
    run_id = run_id_for(run_id_template, cfg.flow.run_id) if run_id_template else cfg.flow.run_id
    preflight(cfg)  # a bad task file, eval setting or device: one line before anything is written
    freeze_run_config(cfg, run_id)
    log = get_run_logger()
    again = {"retries": cfg.flow.task_retries, "retry_condition_fn": retry_unless_user_error}
    rollout, purify, update, evaluate = (
        t.with_options(**again) for t in (rollout_task, purify_task, update_task, eval_stage_task)
    )
    checkpoint = ""
    start = trained_iterations(cfg, run_id) if more else 0
    if start:
        log.info(
            f"run {run_id}: {start} iterations trained; training iterations {start} to "
            f"{start + cfg.flow.iterations - 1}"
        )
    for i in range(start, start + cfg.flow.iterations):
        if cfg.flow.eval_every and i % cfg.flow.eval_every == 0:  # the policy this iteration rolls out from
            value(evaluate(cfg, run_id, i))
            publish_catalog(cfg, log.warning)
        n = value(rollout(cfg, run_id, i))
        publish_catalog(cfg, log.warning)  # every committed shard is queryable at once
        purified = value(purify(cfg, run_id, i))
        publish_catalog(cfg, log.warning)
        checkpoint = value(update(cfg, run_id, i))
        publish_catalog(cfg, log.warning)
        log.info(f"iteration {i}: {n} trajectories; purified {describe_purified(purified)}; checkpoint {checkpoint}")
        record_iteration(cfg, run_id, i, log.warning)
    if cfg.flow.eval_every:  # the last checkpoint, always
        value(evaluate(cfg, run_id, start + cfg.flow.iterations))
        publish_catalog(cfg, log.warning)
    return checkpoint
