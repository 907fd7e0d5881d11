"""Optional experiment trackers for the per-iteration metrics: TensorBoard and Weights & Biases.

Never required: off unless configured (flow.tensorboard, flow.wandb_project)."""
from __future__ import annotations

from pipeline.config import CleanerConfig
from storage.layout import RunLayout


def log_iteration(cfg: CleanerConfig, run_id: str, row: dict) -> None:
    scalars = {k: float(v) for k, v in row.items() if isinstance(v, (int, float)) and k != "iteration"}
    step = int(row["iteration"])
    if cfg.flow.tensorboard:
        from torch.utils.tensorboard import SummaryWriter

        with SummaryWriter(str(RunLayout(cfg.storage.root, run_id).run_dir / "tensorboard")) as w:
            for k, v in scalars.items():
                w.add_scalar(f"cleaner/{k}", v, step)
    if cfg.flow.wandb_project:
        import wandb

        run = wandb.init(project=cfg.flow.wandb_project, name=run_id, id=run_id, resume="allow",
                         config=cfg.model_dump(mode="json"))
        run.log(scalars, step=step)
        run.finish()
