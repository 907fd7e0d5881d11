"""Where an iteration's metrics go once it is done: a Prefect markdown artifact (always, in the flow run's
page), and the optional experiment trackers, TensorBoard and Weights & Biases (flow.tensorboard,
flow.wandb_project; never required)."""
from __future__ import annotations

import re

from pipeline.config import CleanerConfig
from storage.layout import RunLayout


def record_iteration(cfg: CleanerConfig, run_id: str, iteration: int) -> None:
    """The iteration's row of the report's table, as an artifact and to the configured trackers."""
    from prefect.artifacts import create_markdown_artifact

    from flows.report import iteration_table, markdown_table

    rows = [r for r in iteration_table(cfg.storage.root, run_id) if r["iteration"] == iteration]
    scalars = {k: float(v) for k, v in (rows or [{}])[0].items() if isinstance(v, (int, float)) and k != "iteration"}
    run_dir = RunLayout(cfg.storage.root, run_id).run_dir
    if rows and cfg.flow.tensorboard:
        from torch.utils.tensorboard import SummaryWriter

        with SummaryWriter(str(run_dir / "tensorboard")) as w:
            for k, v in scalars.items():
                w.add_scalar(f"cleaner/{k}", v, iteration)
    if rows and cfg.flow.wandb_project:
        import wandb

        run = wandb.init(project=cfg.flow.wandb_project, name=run_id, id=run_id, resume="allow",
                         config=cfg.model_dump(mode="json"))
        run.log(scalars, step=iteration)
        run.finish()
    page = (run_dir / "report" / "index.html").resolve().as_uri()
    key = re.sub(r"[^a-z0-9-]+", "-", f"{run_id}-iteration-{iteration}".lower())  # Prefect's key alphabet
    create_markdown_artifact(key=key,
                             markdown=f"# {run_id} iteration {iteration}\n\n" + markdown_table(rows)
                             + f"\n\nPlots: `cleaner report --run {run_id}` writes [runs/{run_id}/report/index.html]({page})",
                             description=f"cleaner metrics of iteration {iteration}")

