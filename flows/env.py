"""Prefect settings that must be in place before `prefect` is imported (docs/install.md)."""

from __future__ import annotations

import os
from pathlib import Path

from storage.errors import CleanerError, check_writable_root


def configure_prefect(root: Path) -> None:
    """Per-project Prefect home and a temporary local server unless the user points at a real one
    (PREFECT_API_URL set: a `prefect server start` instance or Prefect Cloud)."""
    # Prefect's database lives under the root: a read-only or mistyped root fails here in one line,
    # not as thousands of lines of database errors and a two-minute start-up timeout.
    check_writable_root(root)
    home = Path(root).resolve() / ".prefect"
    home.mkdir(parents=True, exist_ok=True)
    os.environ.setdefault("PREFECT_HOME", str(home))
    os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
    os.environ.setdefault("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "120")
    os.environ.setdefault("PREFECT_LOGGING_LEVEL", "INFO")
    os.environ.setdefault("PREFECT_UI_ENABLED", "false")


def retry_unless_user_error(task, task_run, state) -> bool:
    """Prefect retry condition: a CleanerError fails the same way again (a truncated checkpoint, a
    corrupt shard), so only other failures are retried."""
    try:
        exc = state.result(raise_on_failure=False)
    except Exception:  # noqa: BLE001 - an unreadable result: retry as Prefect would
        return True
    return not isinstance(exc, CleanerError)
