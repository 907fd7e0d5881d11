"""Where an iteration's metrics go once it is done: a Prefect markdown artifact (always, in the flow run's
page), and the optional experiment trackers, TensorBoard and Weights & Biases (flow.tensorboard,
flow.wandb_project; never required)."""

from __future__ import annotations

import re
from typing import Callable

from pipeline.config import CleanerConfig
from storage.errors import first_line
from storage.layout import RunLayout


def to_trackers(
    cfg: CleanerConfig, run_id: str, iteration: int, scalars: dict[str, float], warn: Callable[[str], None]
) -> None:
    """The scalars to TensorBoard and W&B when configured. A tracker that fails (no W&B login, no network, a full
    disk) is one warning: the metrics are in the run's shards and catalog whatever happens to a tracker."""
    run_dir = RunLayout(cfg.storage.root, run_id).run_dir
    if cfg.flow.tensorboard:
        try:
            from torch.utils.tensorboard import SummaryWriter

            with SummaryWriter(str(run_dir / "tensorboard")) as w:
                for k, v in scalars.items():
                    w.add_scalar(f"cleaner/{k}", v, iteration)
        except Exception as e:  # noqa: BLE001 - a tracker is never required
            warn(f"TensorBoard: iteration {iteration} not logged ({type(e).__name__}: {first_line(e)})")
    if cfg.flow.wandb_project:
        try:
            import wandb

            run = wandb.init(
                project=cfg.flow.wandb_project,
                name=run_id,
                id=run_id,
                resume="allow",
                config=cfg.model_dump(mode="json"),
            )
            run.log(scalars, step=iteration)
            run.finish()
        except Exception as e:  # noqa: BLE001 - a tracker is never required
            warn(
                f"W&B project {cfg.flow.wandb_project}: iteration {iteration} not logged ({type(e).__name__}: "
                f"{first_line(e)}); the metrics are in the catalog (`cleaner inspect`)"
            )


def record_iteration(cfg: CleanerConfig, run_id: str, iteration: int, warn: Callable[[str], None]) -> None:
    """The iteration's row of the report's table, as an artifact and to the configured trackers."""
    from prefect.artifacts import create_markdown_artifact

    from flows.report import iteration_table, markdown_table

    rows = [r for r in iteration_table(cfg.storage.root, run_id) if r["iteration"] == iteration]
    scalars = {k: float(v) for k, v in (rows or [{}])[0].items() if isinstance(v, (int, float)) and k != "iteration"}
    run_dir = RunLayout(cfg.storage.root, run_id).run_dir
    if rows:
        to_trackers(cfg, run_id, iteration, scalars, warn)
    page = (run_dir / "report" / "index.html").resolve().as_uri()
    key = re.sub(r"[^a-z0-9-]+", "-", f"{run_id}-iteration-{iteration}".lower())  # Prefect's key alphabet
    create_markdown_artifact(
        key=key,
        markdown=f"# {run_id} iteration {iteration}\n\n"
        + markdown_table(rows)
        + f"\n\nPlots: `cleaner report --run {run_id}` writes [runs/{run_id}/report/index.html]({page})",
        description=f"cleaner metrics of iteration {iteration}",
    )
