"""Trackers are never required (flows/trackers.py): W&B without a login failed the flow after its first
iteration, with two tracebacks, and every rerun the same way. Now one warning, and the run goes on."""

from __future__ import annotations

from pipeline.config import load_config


def test_wandb_without_a_login_is_one_warning_and_tensorboard_still_logs(tmp_path, monkeypatch):
    from flows.trackers import to_trackers

    for var in ("WANDB_API_KEY", "WANDB_MODE", "WANDB_BASE_URL"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))  # no ~/.netrc, no wandb settings: as on a fresh machine
    monkeypatch.setenv("WANDB_DIR", str(tmp_path))
    monkeypatch.setenv("WANDB_SILENT", "true")
    cfg = load_config(None, [f"storage.root={tmp_path / 'ws'}", "flow.wandb_project=myproj", "flow.tensorboard=true"])
    warnings: list[str] = []
    to_trackers(cfg, "r", 0, {"mean_reward": 0.5}, warnings.append)
    assert len(warnings) == 1 and warnings[0].startswith("W&B project myproj: iteration 0 not logged ("), warnings
    assert "the metrics are in the catalog" in warnings[0] and "\n" not in warnings[0]
    assert list((tmp_path / "ws" / "runs" / "r" / "tensorboard").glob("events.out.tfevents.*"))
