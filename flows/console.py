"""A quiet console: library messages that carry nothing for a cleaner user are silenced at their source.

Each entry names one message of one library, so a real warning (from our code, or a library's
warning about a real problem) still shows. Settings go into the environment as well as into this
process, because flows served by Prefect and torchrun ranks are child processes.
"""

from __future__ import annotations

import logging
import os
import re
import sys
import warnings
from contextlib import contextmanager
from typing import Iterator

from storage.errors import CleanerError

# logger name -> starts of its messages that say nothing to a user of a CPU pipeline.
_NOISE: dict[str, tuple[str, ...]] = {
    # Beam probes for cloud file systems whose client libraries are optional extras.
    "apache_beam.io.filesystems": ("Failed to import GCSFileSystem",),
    "": ("apitools not found",),  # Beam's GCP module logs this on the root logger
    # DeepSpeed falls back to its CPU accelerator by design here.
    "DeepSpeed": ("Setting accelerator to CPU",),
    # bitsandbytes (an OpenRLHF dependency; cleaner quantizes nothing) probes an optional kernels package.
    "bitsandbytes.backends.cpu.ops": ("Failed to load CPU gemm_4bit_forward",),
}
_PYNVML = "The pynvml package is deprecated"  # torch.cuda imports pynvml whether or not a GPU exists


class _DropMessages(logging.Filter):
    def __init__(self, prefixes: tuple[str, ...]) -> None:
        super().__init__()
        self.prefixes = prefixes

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith(self.prefixes)


def quiet_libraries() -> None:
    """Silence the known noise of torch, transformers, Beam and DeepSpeed (idempotent)."""
    warnings.filterwarnings("ignore", message=_PYNVML, category=FutureWarning)
    entry = f"ignore:{_PYNVML}:FutureWarning"
    inherited = os.environ.get("PYTHONWARNINGS", "")
    if entry not in inherited.split(","):
        os.environ["PYTHONWARNINGS"] = ",".join(filter(None, [inherited, entry]))
    # transformers draws a "Loading weights" / "Writing model shards" bar for a 5 MB model several
    # times per iteration; cleaner draws its own progress per stage.
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    for name, prefixes in _NOISE.items():
        logger = logging.getLogger(name or None)
        if not any(isinstance(f, _DropMessages) for f in logger.filters):
            logger.addFilter(_DropMessages(prefixes))


@contextmanager
def working(message: str) -> Iterator[None]:
    """`message …` on stderr before a step that takes seconds (an import of torch, a tokenizer, a server's
    start): one line, and on a terminal a spinner with the seconds spent until the step ends, so that the
    console is never silent for long. Results keep stdout to themselves."""
    print(f"{message} …", file=sys.stderr, flush=True)
    if not sys.stderr.isatty():
        yield
        return
    from rich.console import Console
    from rich.progress import Progress, SpinnerColumn, TimeElapsedColumn

    with Progress(SpinnerColumn(), TimeElapsedColumn(), console=Console(stderr=True), transient=True) as spinner:
        spinner.add_task("", total=None)
        yield


# True while the `cleaner` command runs: it prints a user error's one line itself when it ends (flows/cli.py).
_COMMAND_PRINTS_ERRORS = False


@contextmanager
def command_prints_errors() -> Iterator[None]:
    """While the command line runs a subcommand, Prefect's records of a user error name its class only."""
    global _COMMAND_PRINTS_ERRORS
    before, _COMMAND_PRINTS_ERRORS = _COMMAND_PRINTS_ERRORS, True
    try:
        yield
    finally:
        _COMMAND_PRINTS_ERRORS = before


def _user_error_names(cls: type = CleanerError) -> set[str]:
    """The names of CleanerError and of every class below it."""
    return {cls.__name__}.union(*(_user_error_names(c) for c in cls.__subclasses__()))


class _UserErrors(logging.Filter):
    """Prefect logs a failed task's state, then the flow's exception, then the flow's state, each failure with
    its traceback: one user error (a CleanerError, the input's or the environment's fault, not a bug, whose
    message is the one line that names the file and the fix) three times, and the command prints it a fourth.
    For a CleanerError the traceback goes, and each record keeps the error's class; its message stays in the
    first record only, or in none when the command prints it at its end. Other exceptions are left as they are."""

    def __init__(self) -> None:
        super().__init__()
        self.shown: set[str] = set()
        self._last: logging.LogRecord | None = None  # a record passes each handler: rewritten once

    def filter(self, record: logging.LogRecord) -> bool:
        if record is self._last:
            return True
        self._last = record
        if record.exc_info and isinstance(record.exc_info[1], CleanerError):
            record.exc_info, record.exc_text = None, None
        message = record.getMessage()
        found = re.search(r"\b(%s)(: |\()" % "|".join(sorted(_user_error_names())), message)
        if found is None:
            return True
        quote, text, close = re.fullmatch(r"(['\"]?)(.*?)(['\"]?\)*)", message[found.end() :], re.S).groups()
        key = re.sub(r"\W+", "", text)  # the same message, whether a state's str or the exception's repr
        if _COMMAND_PRINTS_ERRORS or key in self.shown:
            record.msg = (
                message[: found.end()] + quote + ("see below" if _COMMAND_PRINTS_ERRORS else "as above") + close
            )
            record.args = ()
        self.shown.add(key)
        return True


def user_errors_once() -> None:
    """Install _UserErrors on the handlers Prefect's run loggers write through (after `import prefect`): a
    user error without its traceback, its message once."""
    once = _UserErrors()
    for name in ("", "prefect", "prefect.flow_runs", "prefect.task_runs"):
        for handler in logging.getLogger(name).handlers:
            if not any(isinstance(f, _UserErrors) for f in handler.filters):
                handler.addFilter(once)


def _cell(value: object) -> str:
    if isinstance(value, float):
        return f"{value:.3f}" if abs(value) < 1000 else f"{value:,.0f}"
    if isinstance(value, dict):
        return ", ".join(f"{k} {_cell(v)}" for k, v in value.items())
    return "n/a" if value is None else str(value)


def print_metrics(title: str, metrics: dict, as_json: bool = False) -> None:
    """A metrics dict as a two-column table on stdout (`as_json`: one JSON document, for scripts).

    Nested dicts of dicts (e.g. SAAR on/off of the eval flow) become one column per inner dict.
    """
    import json

    if as_json:
        print(json.dumps(metrics, indent=1, sort_keys=True))
        return
    from rich.console import Console
    from rich.table import Table

    table = Table(title=title, title_justify="left")
    table.add_column("metric")
    columns = [
        k
        for k, v in metrics.items()
        if isinstance(v, dict)
        and all(not isinstance(x, dict) for x in v.values())
        and k not in ("finish_reasons", "first_call_failures_by_label")
    ]
    if columns and len(columns) == sum(isinstance(v, dict) for v in metrics.values()):
        for c in columns:
            table.add_column(c, justify="right")
        for key in dict.fromkeys(k for c in columns for k in metrics[c]):
            table.add_row(key, *(_cell(metrics[c].get(key)) for c in columns))
        for key, value in metrics.items():
            if key not in columns:
                table.add_row(key, _cell(value), *[""] * (len(columns) - 1))
    else:
        table.add_column("value", justify="right")
        for key, value in sorted(metrics.items()):
            table.add_row(key, _cell(value))
    Console(width=max(100, Console().width)).print(table)
