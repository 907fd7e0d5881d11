"""Prefect settings that must be in place before `prefect` is imported (ARCHITECTURE.md install facts)."""
from __future__ import annotations

import os
from pathlib import Path


def configure_prefect(root: Path) -> None:
    """Per-project Prefect home and a temporary local server unless the user points at a real one
    (PREFECT_API_URL set: a `prefect server start` instance or Prefect Cloud)."""
    home = Path(root).resolve() / ".prefect"
    home.mkdir(parents=True, exist_ok=True)
    os.environ.setdefault("PREFECT_HOME", str(home))
    os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
    os.environ.setdefault("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "120")
    os.environ.setdefault("PREFECT_LOGGING_LEVEL", "INFO")
    os.environ.setdefault("PREFECT_UI_ENABLED", "false")
