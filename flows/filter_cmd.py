"""`cleaner filter`: the tasks a run found neither always solved nor never solved, as a task file a run
can train on (`rollout.tasks=FILE`), from the pass rates its raw shards logged.

The reference prepares its data by keeping tasks whose pass rate over several rollouts is neither 0 nor
1: a group whose rollouts all get the same reward has zero GRPO advantage and teaches nothing. Here the
pass rate of a task is the share of its rollouts with a positive reward (the report's accuracy), over
every committed rollout of the run (or of the iterations given), and a task is kept when
min_pass < pass rate < max_pass, both bounds excluded: the defaults 0 and 1 are exactly the reference's
rule, and `--min-pass 0.1 --max-pass 0.9` drops tasks at 10% and 90% too.

Rows are read through the DuckDB catalog (storage/catalog.py), whose views hold only parts listed in a
committed manifest and validated against it: a shard still being written, or one a crash left without
its manifest, is never read (named on stderr), and a corrupt committed shard of the run refuses the
command, since pass rates without it would be wrong.
"""

from __future__ import annotations

import argparse
import shlex
import sys
from pathlib import Path

from flows.command import command_parser, config_of
from storage.errors import CleanerError

PASS_RATES_SQL = """
SELECT prompt_id, any_value(task_source) AS data_source, any_value(question) AS question,
       any_value(ground_truth) AS ground_truth, count(*) AS rollouts, avg((reward > 0)::DOUBLE) AS pass_rate
FROM raw_trajectories
WHERE run_id = $run AND ($iterations IS NULL OR list_contains($iterations, iteration))
GROUP BY prompt_id ORDER BY prompt_id
"""


class FilterError(CleanerError, ValueError):
    """Bounds that keep nothing, or a filter that kept no task; nothing was written."""

    exit_code = 2


def pass_rates(root: Path, run_id: str, iterations: list[int] | None = None) -> list[dict]:
    """Per task of the run: data_source, question, ground_truth, rollouts and pass rate, from committed
    raw shards only. Uncommitted shards of the run are named on stderr; a corrupt one refuses."""
    from storage.catalog import Catalog  # DuckDB and Arrow load when the command runs, not with `cleaner --help`
    from storage.layout import RunLayout, missing_run
    from storage.shards import ShardError, ShardMissing

    run_dir = RunLayout(root, run_id).run_dir
    missing = missing_run(root, run_id)
    if missing:
        raise ShardMissing(missing)
    with Catalog(root) as cat:
        mine = [p for p in cat.problems if run_dir in p.path.parents and p.path.name == "raw"]
        corrupt = [p for p in mine if p.committed]
        if corrupt:
            raise ShardError(f"{corrupt[0]} (pass rates without this shard would be wrong; restore or remove it)")
        for p in mine:
            print(f"cleaner filter: skipped {p}", file=sys.stderr)
        rows = (
            cat.con.sql(PASS_RATES_SQL, params={"run": run_id, "iterations": iterations}).to_arrow_table().to_pylist()
        )
    if not rows:
        which = "" if iterations is None else f" in iterations {', '.join(map(str, iterations))}"
        raise ShardMissing(f"run {run_id!r} has no committed raw shard{which} under {root}")
    return rows


def kept(rows: list[dict], min_pass: float, max_pass: float) -> list[dict]:
    """Tasks whose pass rate is strictly between the bounds."""
    return [r for r in rows if min_pass < r["pass_rate"] < max_pass]


def write_task_file(rows: list[dict], out: Path) -> None:
    """The layout rollout_gen/tasks.py `load_task_parquet` reads (Open-AgentRL / verl), plus what the filter
    saw; written under a temporary name beside `out`, then renamed: a failure leaves no half-written file."""
    import pyarrow as pa

    from storage.shards import atomic_write_parquet

    schema = pa.schema(
        [
            ("prompt", pa.list_(pa.struct([("role", pa.string()), ("content", pa.string())]))),
            ("data_source", pa.string()),
            ("reward_model", pa.struct([("ground_truth", pa.string()), ("style", pa.string())])),
            ("prompt_id", pa.string()),
            ("pass_rate", pa.float64()),
            ("rollouts", pa.int64()),
        ]
    )
    atomic_write_parquet(
        Path(out),
        pa.Table.from_pylist(
            [
                {
                    "prompt": [{"role": "user", "content": r["question"]}],
                    "data_source": r["data_source"],
                    "reward_model": {"ground_truth": r["ground_truth"], "style": "rule"},
                    "prompt_id": r["prompt_id"],
                    "pass_rate": r["pass_rate"],
                    "rollouts": r["rollouts"],
                }
                for r in rows
            ],
            schema=schema,
        ),
    )


def run_filter(
    root: Path, run_id: str, iterations: list[int] | None, min_pass: float, max_pass: float, out: Path
) -> tuple[int, int]:
    """Write the task file; returns (tasks kept, tasks seen)."""
    if not (0.0 <= min_pass < max_pass <= 1.0):
        raise FilterError(
            f"pass-rate bounds must satisfy 0 <= --min-pass < --max-pass <= 1 (got {min_pass:g} and "
            f"{max_pass:g}); tasks strictly between them are kept"
        )
    rows = pass_rates(root, run_id, iterations)
    keep = kept(rows, min_pass, max_pass)
    if not keep:
        raise FilterError(
            f"no task of run {run_id!r} has a pass rate strictly between {min_pass:g} and {max_pass:g} "
            f"({len(rows)} tasks seen); nothing was written to {out}"
        )
    out = Path(out)
    if out.is_dir() or not out.parent.is_dir():
        raise FilterError(
            f"--out {out}: "
            + (
                "is a folder; give a file name such as tasks.parquet"
                if out.is_dir()
                else f"folder {out.parent} does not exist"
            )
        )
    write_task_file(keep, out)
    return len(keep), len(rows)


def run(args: argparse.Namespace) -> int:
    cfg = config_of(args)
    run_id = args.run or cfg.flow.run_id
    n, seen = run_filter(cfg.storage.root, run_id, args.iterations, args.min_pass, args.max_pass, args.out)
    # the same config and overrides (pasted alone, the hint trained into ./workspace on the embedded defaults)
    again = "".join(f" {shlex.quote(str(a))}" for a in [*(["-c", args.config] if args.config else []), *args.overrides])
    # a run of its own (the filtered run's config differs: resuming it would be refused), at most n tasks an
    # iteration (more would roll a task out twice in one iteration, which train refuses)
    per_iteration = f" rollout.tasks_per_iteration={n}" if n < cfg.rollout.tasks_per_iteration else ""
    print(
        f"kept {n} of {seen} tasks of run {run_id} (pass rate strictly between {args.min_pass:g} and "
        f"{args.max_pass:g}); wrote {args.out}\nnext: cleaner train{again} rollout.tasks={shlex.quote(str(args.out))}"
        f"{per_iteration} flow.run_id={shlex.quote(run_id + '-filtered')}"
    )
    return 0


def add_parser(sub) -> None:
    p = command_parser(
        sub,
        "filter",
        "a task file of the tasks whose logged pass rate is strictly between two bounds",
        "Example:\n  cleaner filter --run demo --min-pass 0.1 --max-pass 0.9 --out tasks.parquet\n"
        "  cleaner train rollout.tasks=tasks.parquet flow.run_id=filtered",
        "Per task of a run, the share of its committed rollouts with a positive reward (from the raw shards, "
        "through the DuckDB catalog: uncommitted shards are never read); tasks with min-pass < pass rate < "
        "max-pass are written as a task file that rollout.tasks accepts. The defaults keep tasks neither always "
        "nor never solved.",
        func=run,
    )
    p.add_argument("--run", help="run id (default: flow.run_id)")
    p.add_argument("--iterations", type=int, nargs="+", help="only these iterations (default: all committed)")
    p.add_argument("--min-pass", type=float, default=0.0, help="keep tasks whose pass rate is above this [0]")
    p.add_argument("--max-pass", type=float, default=1.0, help="keep tasks whose pass rate is below this [1]")
    p.add_argument("--out", type=Path, required=True, help="task file to write (Parquet)")
