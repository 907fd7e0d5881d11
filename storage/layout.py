"""Where every shard of a run lives (hive-style paths under one project root)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from storage.errors import RunIdError
from storage.modes import IS_MODES


# The similarity measure whose partitions carry no suffix (gamma=0.50); pipeline.similarity's
# DEFAULT_MEASURE has this key (tested).
DEFAULT_MEASURE_KEY = "rapidfuzz-segment"


def format_threshold(value: float) -> str:
    """0.5 -> '0.50', 1.01 -> '1.01', 0.125 -> '0.125': stable partition names for γ and τ (read back exactly)."""
    two = f"{value:.2f}"
    return two if float(two) == value else repr(float(value))


def threshold_partition(mode: str, value: float, measure: str = "") -> str:
    """A variant's partition folder name: tau=0.50 for the importance-ratio modes; else 'gamma=0.50' for the
    default similarity measure (the paths every earlier run wrote), and 'gamma=0.50-difflib-segment' for another
    one (pipeline.modes.partition_measure names it), so replays under different measures sit side by side and the
    `mode=*/gamma=*` globs see them all."""
    if mode in IS_MODES:
        return f"tau={format_threshold(value)}"
    return f"gamma={format_threshold(value)}" + (f"-{measure}" if measure else "")


def record_path(root: Path, path: Path | str) -> str:
    """A path as a manifest records it: relative to the storage root when inside it (`runs/demo/checkpoints/
    iteration=0001`), so a copied or moved store works from any directory and never reads the original's
    files; absolute otherwise (an initial policy outside the store)."""
    p, r = Path(path).resolve(), Path(root).resolve()
    try:
        return p.relative_to(r).as_posix()
    except ValueError:
        return str(p)


def resolve_recorded(root: Path, recorded: str) -> Path:
    """The file a recorded path names in this store. Earlier cleaners recorded store paths relative to the
    directory the command ran in, or absolute: any path through `runs/<run>/checkpoints|iteration=…` is read
    inside this root whatever came before it, so a relocated store never reads its original's files."""
    path = Path(recorded)
    parts = path.parts
    for i in range(len(parts) - 3, -1, -1):
        if parts[i] == "runs" and (parts[i + 2] == "checkpoints" or parts[i + 2].startswith("iteration=")):
            return Path(root) / Path(*parts[i:])
    if not path.is_absolute() and (Path(root) / path).exists():  # recorded relative to the root (a policy kept there)
        return Path(root) / path
    return path  # absolute, or relative to the directory an earlier cleaner ran in


def run_id_problem(run_id: str) -> str | None:
    """Why `run_id` cannot name a run, None when it can: a plain folder name that a shell, Prefect's run names and
    `--run` take as it is (a tab or a leading dash made runs that no command line could name again)."""
    if (
        not run_id
        or run_id.startswith((".", "-"))
        or any(c in "/\\" or not c.isprintable() for c in run_id)  # a space is printable: quoted, it is named
    ):
        return (
            f"run id {run_id!r} must be a plain folder name: no '/', no tab or other control character, not empty and "
            "not starting with '.' or '-' (e.g. exp1, qwen3-4b_gamma0.5)"
        )
    return None


def missing_run(root: Path, run_id: str) -> str | None:
    """Why `run_id` names no run under `root` (the runs that are there), None when it does: one sentence for every
    command given a mistyped --run or storage.root."""
    run_dir = Path(root) / "runs" / run_id
    if run_dir.is_dir():
        return None
    runs = sorted(p.name for p in run_dir.parent.glob("*") if p.is_dir())
    return (
        f"run {run_id!r} does not exist under {root} (runs there: {', '.join(runs) or 'none'}); check --run and "
        "storage.root"
    )


@dataclass(frozen=True)
class RunLayout:
    root: Path
    run_id: str

    def __post_init__(self) -> None:
        problem = run_id_problem(self.run_id)
        if problem:
            raise RunIdError(problem)

    @property
    def run_dir(self) -> Path:
        return Path(self.root) / "runs" / self.run_id

    @property
    def run_json(self) -> Path:
        return self.run_dir / "run.json"

    def iteration_dir(self, iteration: int) -> Path:
        return self.run_dir / f"iteration={iteration:04d}"

    def raw_dir(self, iteration: int) -> Path:
        return self.iteration_dir(iteration) / "raw"

    def purified_dir(self, iteration: int, mode: str, threshold: float, measure: str = "") -> Path:
        """A variant's purified partition; `threshold` is its γ, or its τ for an importance-ratio mode."""
        partition = threshold_partition(mode, threshold, measure)
        return self.iteration_dir(iteration) / "purified" / f"mode={mode}" / partition

    def dead_letter_dir(self, iteration: int, mode: str, threshold: float, measure: str = "") -> Path:
        partition = threshold_partition(mode, threshold, measure)
        return self.iteration_dir(iteration) / "dead_letter" / f"mode={mode}" / partition

    def metrics_dir(self, iteration: int, stage: str) -> Path:
        return self.iteration_dir(iteration) / "metrics" / f"stage={stage}"

    def checkpoint_dir(self, iteration: int) -> Path:
        """The policy that rollout of `iteration` samples from (iteration 0 = the initial policy)."""
        return self.run_dir / "checkpoints" / f"iteration={iteration:04d}"

    def iterations(self) -> list[int]:
        return sorted(int(p.name.split("=")[1]) for p in self.run_dir.glob("iteration=*") if p.is_dir())
