"""Prefect settings that must be in place before `prefect` is imported (docs/install.md)."""
from __future__ import annotations

import logging
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


class _UserErrorsWithoutTraceback(logging.Filter):
    """Prefect logs each failed task and flow with its traceback; for a CleanerError (the input's or the
    environment's fault, not a bug) the message already names the file and the fix, so the traceback
    goes. Every other exception keeps it."""

    def filter(self, record: logging.LogRecord) -> bool:
        if record.exc_info and isinstance(record.exc_info[1], CleanerError):
            record.exc_info, record.exc_text = None, None
        return True


def user_errors_without_tracebacks() -> None:
    """Install the filter on the handlers Prefect's run loggers write through (after `import prefect`)."""
    keep = _UserErrorsWithoutTraceback()
    for name in ("", "prefect", "prefect.flow_runs", "prefect.task_runs"):
        for handler in logging.getLogger(name).handlers:
            if not any(isinstance(f, _UserErrorsWithoutTraceback) for f in handler.filters):
                handler.addFilter(keep)


def retry_unless_user_error(task, task_run, state) -> bool:
    """Prefect retry condition: a CleanerError fails the same way again (a truncated checkpoint, a
    corrupt shard), so only other failures are retried."""
    try:
        exc = state.result(raise_on_failure=False)
    except Exception:  # noqa: BLE001 - an unreadable result: retry as Prefect would
        return True
    return not isinstance(exc, CleanerError)
