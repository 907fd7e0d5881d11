"""A quiet console: library messages that carry nothing for a cleaner user are silenced at their source.

Each entry names one message of one library, so a real warning (from our code, or a library's
warning about a real problem) still shows. Settings go into the environment as well as into this
process, because flows served by Prefect and torchrun ranks are child processes.
"""
from __future__ import annotations

import logging
import os
import warnings

# (logger name, start of the message): records that say nothing to a user of a CPU pipeline.
_NOISE: tuple[tuple[str, str], ...] = (
    # Beam probes for cloud file systems whose client libraries are optional extras.
    ("apache_beam.io.filesystems", "Failed to import GCSFileSystem"),
    ("", "apitools not found"),  # Beam's GCP module logs this on the root logger
    # DeepSpeed falls back to its CPU accelerator by design here.
    ("DeepSpeed", "Setting accelerator to CPU"),
    # bitsandbytes (an OpenRLHF dependency; cleaner quantizes nothing) probes an optional kernels package.
    ("bitsandbytes.backends.cpu.ops", "Failed to load CPU gemm_4bit_forward"),
)
_PYNVML = "The pynvml package is deprecated"  # torch.cuda imports pynvml whether or not a GPU exists


class _DropMessages(logging.Filter):
    def __init__(self, prefixes: tuple[str, ...]) -> None:
        super().__init__()
        self.prefixes = prefixes

    def filter(self, record: logging.LogRecord) -> bool:
        msg = record.msg if isinstance(record.msg, str) else str(record.msg)
        return not msg.startswith(self.prefixes)


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
    by_logger: dict[str, tuple[str, ...]] = {}
    for name, prefix in _NOISE:
        by_logger[name] = by_logger.get(name, ()) + (prefix,)
    for name, prefixes in by_logger.items():
        logger = logging.getLogger(name or None)
        if not any(isinstance(f, _DropMessages) for f in logger.filters):
            logger.addFilter(_DropMessages(prefixes))


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
    columns = [k for k, v in metrics.items() if isinstance(v, dict) and all(not isinstance(x, dict) for x in v.values())
               and k not in ("finish_reasons", "first_call_failures_by_label")]
    if columns and len(columns) == sum(isinstance(v, dict) for v in metrics.values()):
        table.add_column("metric")
        for c in columns:
            table.add_column(c, justify="right")
        for key in dict.fromkeys(k for c in columns for k in metrics[c]):
            table.add_row(key, *(_cell(metrics[c].get(key)) for c in columns))
        for key, value in metrics.items():
            if key not in columns:
                table.add_row(key, _cell(value), *[""] * (len(columns) - 1))
    else:
        table.add_column("metric")
        table.add_column("value", justify="right")
        for key, value in sorted(metrics.items()):
            table.add_row(key, _cell(value))
    Console(width=max(100, Console().width)).print(table)
