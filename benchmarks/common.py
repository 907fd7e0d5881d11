"""Shared benchmark plumbing: machine facts, best-of-N timing, and RESULTS.md upkeep.

Every benchmark measures its baseline in the same run and reports the ratio; results are kept per
benchmark in results.json so running one benchmark refreshes its own section of RESULTS.md only.
"""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable, Iterator

HERE = Path(__file__).resolve().parent
RESULTS_JSON = HERE / "results.json"
RESULTS_MD = HERE / "RESULTS.md"


@dataclass
class Row:
    metric: str
    value: float
    baseline: float | None = None
    unit: str = ""
    higher_is_better: bool = True
    target: str = ""  # e.g. ">= 0.8x baseline"
    passed: bool | None = None

    @property
    def ratio(self) -> float | None:
        if self.baseline in (None, 0):
            return None
        return self.value / self.baseline


@dataclass
class BenchResult:
    name: str
    description: str
    rows: list[Row]
    notes: list[str] = field(default_factory=list)
    machine: dict[str, str] = field(default_factory=dict)
    when: str = ""


def machine_info() -> dict[str, str]:
    import torch

    mem = ""
    try:
        with open("/proc/meminfo") as f:
            mem = f"{int(f.readline().split()[1]) / 2**20:.1f} GiB"
    except OSError:
        pass
    cpu = platform.processor() or ""
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next((ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")), cpu)
    except OSError:
        pass
    return {
        "cpu": cpu,
        "cores": str(os.cpu_count()),
        "memory": mem,
        "python": platform.python_version(),
        "torch": torch.__version__,
        "torch_threads": str(torch.get_num_threads()),
    }


def peak_rss_bytes() -> int:
    """This process's peak resident set since it started (VmHWM). Not `ru_maxrss`: Linux carries that
    across exec, so a child started from a large benchmark process reports its parent's peak."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def best_of(fn: Callable[[], object], repeat: int = 3) -> float:
    """Best wall time of `repeat` runs: the least disturbed by the shared machine."""
    best = float("inf")
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def interleaved_best(a: Callable[[], object], b: Callable[[], object], repeat: int = 5) -> tuple[float, float]:
    """Best times of a and b, run alternately so that drift in machine speed hits both alike."""
    ta, tb = float("inf"), float("inf")
    for _ in range(repeat):
        ta = min(ta, best_of(a, 1))
        tb = min(tb, best_of(b, 1))
    return ta, tb


def archived_tree(commit: str, into: Path) -> Path:
    """The repository's tree at `commit`, extracted under `into` with `git archive` (the repository is only
    read): an earlier cleaner to run a benchmark's worker in, in the same run as today's."""
    tree = Path(into) / f"tree-{commit}"
    tree.mkdir()
    archive = subprocess.run(["git", "-C", str(HERE.parent), "archive", commit], capture_output=True, check=True).stdout
    subprocess.run(["tar", "-x", "-C", str(tree)], input=archive, check=True)
    return tree


def alternated(rounds: int, ours: Path, before: Path) -> Iterator[tuple[int, str, Path]]:
    """(round, side, tree) for `rounds` rounds of this tree's worker and an earlier tree's, which goes first
    swapped every round (this tree in even rounds), so that drift in the machine's speed hits both sides alike."""
    for k in range(rounds):
        pair = [("ours", ours), ("before", before)]
        yield from ((k, side, tree) for side, tree in (pair if k % 2 == 0 else pair[::-1]))


def vs_earlier(metric: str, value: float, baseline: float, unit: str) -> Row:
    """A figure beside the same figure of an earlier commit measured in the same run: unchanged within noise
    down to 0.95×."""
    return Row(metric, value, baseline, unit, target=">= 0.95×", passed=value >= 0.95 * baseline)


def tree_worker(tree: Path, script: Path, *args: str) -> dict:
    """Run `script` (a benchmark file of today's tree) as a program with `tree`'s code alone on the path
    (PYTHONPATH=tree, `-P`: not the script's folder), in `tree`; its last stdout line, as JSON. The script's
    imports resolve in `tree`, so an earlier tree is driven through its own API."""
    out = subprocess.run(
        [sys.executable, "-P", str(script), *args],
        capture_output=True,
        text=True,
        cwd=tree,
        env={**os.environ, "PYTHONPATH": str(tree)},
    )
    if out.returncode:
        raise RuntimeError(f"{script.name} {' '.join(args)} in {tree} exited {out.returncode}:\n{out.stderr[-4000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def cpu_counters() -> list[int]:
    """/proc/stat's all-CPU jiffies (user, nice, system, idle, iowait, irq, softirq, steal); [] where absent."""
    try:
        with open("/proc/stat") as f:
            return [int(v) for v in f.readline().split()[1:9]]
    except (OSError, ValueError):
        return []


def load_note(since: list[int]) -> str:
    """How busy the machine was since `cpu_counters()` returned `since`: the load average now, and the
    share of all cores' time that niced (background) processes took meanwhile."""
    load = "load average " + " / ".join(f"{v:.2f}" for v in os.getloadavg()) + " (1/5/15 min)"
    now = cpu_counters()
    if not since or not now:
        return f"{load} on {os.cpu_count()} cores"
    delta = [b - a for a, b in zip(since, now)]
    total = sum(delta) or 1
    return (
        f"{load} on {os.cpu_count()} cores at the end; meanwhile niced processes (nice > 0) took "
        f"{delta[1] / total:.0%} of all cores' time, processes not niced (this benchmark's included) "
        f"{(delta[0] + delta[2]) / total:.0%}, idle "
        f"{(delta[3] + delta[4]) / total:.0%}"
    )


def swing(ratios: list[float], band: float = 0.1) -> str:
    """What ratios measured in alternated rounds say about noise: steady, or a swing (max/min over 1 + band)
    inside which a ratio is not a measured change."""
    lo, hi = min(ratios), max(ratios)
    if hi <= lo * (1 + band):
        return f"steady across rounds: {lo:.2f}–{hi:.2f}×"
    return (
        f"it SWINGS from {lo:.2f}× to {hi:.2f}× between rounds: at this load a ratio inside that band is noise, not a "
        "measured change"
    )


def record(result: BenchResult) -> None:
    result.machine = result.machine or machine_info()
    result.when = result.when or time.strftime("%Y-%m-%d %H:%M:%S")
    data = json.loads(RESULTS_JSON.read_text()) if RESULTS_JSON.exists() else {}
    data[result.name] = asdict(result)
    RESULTS_JSON.write_text(json.dumps(data, indent=1, sort_keys=True))
    RESULTS_MD.write_text(render(data))


def _fmt(v: float | None) -> str:
    if v is None:
        return "—"
    return f"{v:,.0f}" if abs(v) >= 100 else f"{v:.3g}"


def render(data: dict) -> str:
    out = [
        "# Benchmark results",
        "",
        "Written by `make bench` (`python -m benchmarks.run`). Each baseline is measured in the same run "
        "as the figure it is compared with; ratio = measured / baseline.",
        "",
    ]
    for name in sorted(data):
        r = data[name]
        m = r["machine"]
        out += [
            f"## {name}",
            "",
            r["description"],
            "",
            f"Machine: {m.get('cpu')} · {m.get('cores')} cores · {m.get('memory')} · Python {m.get('python')} · "
            f"torch {m.get('torch')} ({m.get('torch_threads')} threads) · measured {r['when']}",
            "",
            "| metric | measured | baseline | ratio | target | met |",
            "|---|---|---|---|---|---|",
        ]
        for row in r["rows"]:
            ratio = None if row["baseline"] in (None, 0) else row["value"] / row["baseline"]
            met = {True: "yes", False: "**no**", None: ""}[row["passed"]]
            out.append(
                f"| {row['metric']} ({row['unit']}) | {_fmt(row['value'])} | {_fmt(row['baseline'])} | "
                f"{'' if ratio is None else f'{ratio:.2f}×'} | {row['target']} | {met} |"
            )
        out += [""] + [f"- {n}" for n in r["notes"]] + [""]
    return "\n".join(out)
