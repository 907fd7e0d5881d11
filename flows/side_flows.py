"""The Prefect flows beside training: γ replay of stored raw shards (`cleaner demo`'s last step) and the
evaluation of a checkpoint with SAAR at test time on and off (`cleaner eval --flow`)."""

from __future__ import annotations

from pathlib import Path

from prefect import flow, get_run_logger, task
from prefect.artifacts import create_markdown_artifact
from prefect.cache_policies import NONE

from flows.run_config import publish_catalog
from flows.training import purify_task, value
from pipeline.config import CleanerConfig, load_config
from pipeline.variants import plan_variants


@flow(name="cleaner-replay")
def replay_flow(
    config_file: str | None = None,
    overrides: list[str] | None = None,
    iterations: list[int] | None = None,
    gammas: list[float] | None = None,
    modes: list[str] | None = None,
) -> list:
    """Purify stored raw shards under several (mode, γ) without regenerating anything."""
    cfg = load_config(config_file, overrides or [])
    out = []
    for i in iterations if iterations is not None else [0]:
        variants = plan_variants(cfg, modes or ["saar"], gammas or cfg.flow.replay_gammas)
        out += value(purify_task(cfg, cfg.flow.run_id, i, variants))
        publish_catalog(cfg, get_run_logger().warning)
    return out


@task(name="evaluate", cache_policy=NONE)
def eval_task(
    cfg: CleanerConfig,
    checkpoint: str,
    saar: bool,
    tasks_file: str | None = None,
    samples: int = 1,
    limit: int | None = None,
) -> dict:
    from rollout_gen.eval_run import evaluate_tasks
    from rollout_gen.tasks import load_task_parquet
    from rollout_gen.world.tasks import eval_tasks

    c = cfg.model_copy(deep=True)
    c.rollout.saar.gate_p = 1.0 if saar else 0.0  # at test time SAAR is on for every trajectory, or off
    tasks = load_task_parquet(tasks_file) if tasks_file else eval_tasks(cfg.world)
    return evaluate_tasks(c, Path(checkpoint), tasks[:limit], samples, show_progress=False).metrics


@flow(name="cleaner-eval")
def eval_flow(
    config_file: str | None = None,
    overrides: list[str] | None = None,
    checkpoint: str | None = None,
    tasks_file: str | None = None,
    samples: int = 1,
    limit: int | None = None,
) -> dict:
    """avg@k pass@1, pass@k, tool errors and latency of a checkpoint, with SAAR at test time on and off."""
    cfg = load_config(config_file, overrides or [])
    ckpt = checkpoint or str(cfg.rollout.policy)
    result: dict = {}
    benchmarks: dict[str, dict] = {}  # per setting: avg@k, pass@k ± se per task source, as eval prints them
    for saar in (True, False):
        m = eval_task(cfg, ckpt, saar, tasks_file, samples, limit)
        overall = m["benchmarks"]["all"]
        benchmarks["on" if saar else "off"] = m["benchmarks"]
        result["saar_on" if saar else "saar_off"] = {
            "pass@1": m["accuracy"],
            **{k: v for k, v in overall.items() if k.startswith("pass@") and k != "pass@1"},
            "tool_failures_per_trajectory": overall["tool_failures_per_trajectory"],
            "very_first_call_failure_rate": m["very_first_call_failure_rate"],
            "first_call_failure_rate": m["first_call_failure_rate"],
            "generated_tokens": m["generated_tokens"],
            "generated_tokens_per_s": m["generated_tokens_per_s"],
            "latency_p50_s": m["latency_s"]["p50"],
            "wall_s": m["wall_s"],
        }
    on, off = result["saar_on"], result["saar_off"]
    result["saar_latency_overhead"] = on["wall_s"] / off["wall_s"] - 1 if off["wall_s"] else None
    result["answer_match"] = cfg.rollout.answer_match  # equivalent scores above the paper's exact rule (docs/eval.md)
    result["benchmarks"] = {  # each source's SAAR on beside its SAAR off, "all" first
        f"{source} · SAAR {setting}": benchmarks[setting][source]
        for source in benchmarks["on"]
        for setting in benchmarks
    }
    create_markdown_artifact(
        key="cleaner-eval",
        markdown="| setting | pass@1 | tool failures / trajectory | "
        "very first call failed | first-call failure rate (per position) | wall s |\n"
        "|---|---|---|---|---|---|\n"
        + "\n".join(
            f"| {k} | {v['pass@1']:.3f} | {v['tool_failures_per_trajectory']:.3f} | "
            f"{v['very_first_call_failure_rate']:.3f} | "
            f"{v['first_call_failure_rate']:.3f} | {v['wall_s']:.1f} |"
            for k, v in result.items()
            if k in ("saar_on", "saar_off")
        )
        + "\n\n| benchmark · SAAR at test time | tasks | pass@1 | ± se | tool failures / trajectory |\n"
        "|---|---|---|---|---|\n"
        + "\n".join(
            f"| {k} | {v['tasks']} | {v['pass@1']:.3f} | {v['pass@1_se']:.3f} | "
            f"{v['tool_failures_per_trajectory']:.3f} |"
            for k, v in result["benchmarks"].items()
        )
        + f"\n\nMath and GPQA answers matched by rollout.answer_match={cfg.rollout.answer_match} (docs/eval.md).",
    )
    return result
