"""One progress indication per long stage: a live bar on a terminal, periodic lines everywhere else.

Stages report `update(done)`; where the output goes is the caller's choice: a rich bar on stderr when
stderr is a terminal and nothing else logs there, else one line at the start, at most one every
`every_s` seconds, and one at the end, through `log` (a Prefect run logger's `info` inside flows,
stderr otherwise). Progress never goes to stdout, so commands' results stay pipeable.
"""

from __future__ import annotations

import contextlib
import functools
import sys
import time
from typing import Callable


def singular(unit: str) -> str:
    """ "1 mini-batch", not "1 mini-batches" (the units progress counts: trajectories, rows, mini-batches …)."""
    if unit.endswith("ies"):
        return unit[:-3] + "y"
    if unit.endswith(("ches", "shes", "sses", "xes")):
        return unit[:-2]
    return unit[:-1] if unit.endswith("s") else unit


class StageProgress(contextlib.AbstractContextManager["StageProgress"]):
    def __init__(
        self,
        stage: str,
        unit: str,
        total: int,
        log: Callable[[str], None] | None = None,
        every_s: float = 10.0,
        bar: bool | None = None,
    ) -> None:
        self.stage, self.unit, self.total, self.every_s = stage, unit, max(int(total), 0), every_s
        self.log = log or functools.partial(print, file=sys.stderr, flush=True)
        self.t0 = self._last = time.monotonic()
        self.done = 0
        self._bar = None
        if bar or (bar is None and log is None and sys.stderr.isatty()):
            from rich.console import Console
            from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

            self._bar = Progress(
                TextColumn(f"[{stage}]", markup=False),
                BarColumn(),
                MofNCompleteColumn(),
                TextColumn(unit, markup=False),
                TimeElapsedColumn(),
                TextColumn("{task.fields[note]}", markup=False),
                console=Console(stderr=True),
            )
            self._bar.start()
            self._task = self._bar.add_task(stage, total=self.total, note="")
        else:
            self.log(f"[{stage}] {self.total} {unit if self.total != 1 else singular(unit)} to go")

    def update(self, done: int, note: str = "") -> None:
        self.done = done
        if self._bar is not None:
            self._bar.update(self._task, completed=done, note=note)
            return
        now = time.monotonic()
        if now - self._last >= self.every_s and done < self.total:
            self._last = now
            self.log(f"[{self.stage}] {self._fraction()}, {now - self.t0:.0f} s" + (f", {note}" if note else ""))

    def _fraction(self) -> str:
        share = f" ({100 * self.done / self.total:.0f}%)" if self.total else ""
        return f"{self.done}/{self.total} {self.unit}{share}"

    def close(self, note: str = "") -> None:
        if self._bar is not None:
            self._bar.update(self._task, completed=self.done)
            self._bar.stop()
            return
        self.log(
            f"[{self.stage}] {self._fraction()} in {time.monotonic() - self.t0:.1f} s" + (f", {note}" if note else "")
        )

    def __exit__(self, *exc: object) -> None:
        self.close()
