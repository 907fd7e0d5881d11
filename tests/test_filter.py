"""`cleaner filter` (issue 19 §4): per-task pass rates from committed raw shards only, bounds excluded, and a
task file that rollout.tasks loads, on a real rollout of the tiny policy."""

from __future__ import annotations

from collections import defaultdict

import pyarrow as pa
import pyarrow.compute as pc
import pytest

from flows.cli import main
from flows.filter_cmd import FilterError, kept, pass_rates, run_filter
from rollout_gen.stage import iteration_tasks
from rollout_gen.tasks import TaskFileError, load_task_parquet
from storage.layout import RunLayout
from storage.schemas import RAW
from storage.shards import MANIFEST, ShardError, ShardMissing, read_shard, write_shard


@pytest.fixture()
def run(world_copy):
    return world_copy


def _expected(cfg, iteration: int = 0) -> dict[str, float]:
    rows = read_shard(RunLayout(cfg.storage.root, "w").raw_dir(iteration), RAW).to_pylist()
    by_task = defaultdict(list)
    for r in rows:
        by_task[r["prompt_id"]].append(r["reward"] > 0)
    return {p: sum(v) / len(v) for p, v in by_task.items()}


def test_pass_rates_kept_strictly_between_bounds_and_file_loads_as_tasks(run, tmp_path):
    rates = _expected(run)
    assert {0.0, 1.0} & set(rates.values()) and any(0 < r < 1 for r in rates.values())
    out = tmp_path / "tasks.parquet"
    n, seen = run_filter(run.storage.root, "w", None, 0.1, 0.9, out)
    want = sorted(p for p, r in rates.items() if 0.1 < r < 0.9)
    assert (n, seen) == (len(want), len(rates))
    tasks = load_task_parquet(out)
    assert sorted(t.prompt_id for t in tasks) == want  # the world's own prompt ids survive the round trip
    raw = {r["prompt_id"]: r for r in read_shard(RunLayout(run.storage.root, "w").raw_dir(0), RAW).to_pylist()}
    for t in tasks:
        assert (t.source, t.question, t.ground_truth, t.kind) == (
            raw[t.prompt_id]["task_source"],
            raw[t.prompt_id]["question"],
            raw[t.prompt_id]["ground_truth"],
            "math",
        )


def test_bounds_are_exclusive(run):
    rows = pass_rates(run.storage.root, "w")
    middle = next(r["pass_rate"] for r in rows if 0 < r["pass_rate"] < 1)
    assert all(r["pass_rate"] != middle for r in kept(rows, middle, 1.0))
    assert all(r["pass_rate"] != middle for r in kept(rows, 0.0, middle))
    assert any(r["pass_rate"] == middle for r in kept(rows, middle - 1e-9, 1.0))
    assert {r["prompt_id"] for r in kept(rows, 0.0, 1.0)} == {p for p, r in _expected(run).items() if 0 < r < 1}


def test_an_uncommitted_raw_shard_is_not_read(run, tmp_path, capsys):
    """A shard whose stage has not committed it yet (parts, no manifest) must not move any pass rate."""
    table = read_shard(RunLayout(run.storage.root, "w").raw_dir(0), RAW)
    table = table.set_column(
        table.schema.get_field_index("reward"), RAW.field("reward"), pa.array([1.0] * table.num_rows, pa.float64())
    )
    table = table.set_column(
        table.schema.get_field_index("iteration"),
        RAW.field("iteration"),
        pc.cast(pa.array([1] * table.num_rows), pa.int32()),
    )
    staging = RunLayout(run.storage.root, "w").raw_dir(1)
    write_shard(staging, table, RAW, config_hash="h")
    (staging / MANIFEST).unlink()  # as a rollout killed before its commit leaves it
    rows = pass_rates(run.storage.root, "w")
    assert {r["prompt_id"]: r["pass_rate"] for r in rows} == _expected(run)
    assert all(r["rollouts"] == 4 for r in rows)
    assert f"{staging}: not committed" in capsys.readouterr().err
    with pytest.raises(ShardMissing, match="no committed raw shard in iterations 1"):
        pass_rates(run.storage.root, "w", [1])
    (staging / MANIFEST).write_text("{}")  # once committed (here: a manifest that does not validate) ...
    with pytest.raises(ShardError, match="pass rates without this shard would be wrong"):
        pass_rates(run.storage.root, "w")


def test_iterations_select_rollouts_and_a_run_trains_on_the_file(run, tmp_path):
    out = tmp_path / "tasks.parquet"
    n, _ = run_filter(run.storage.root, "w", [0], 0.0, 1.0, out)
    cfg = run.model_copy(deep=True)
    cfg.rollout.tasks = str(out)
    cfg.rollout.tasks_per_iteration = n
    tasks = iteration_tasks(cfg, 0)
    assert len({t.prompt_id for t in tasks}) == n  # each once
    assert {t.prompt_id for t in tasks} == {p for p, r in _expected(run).items() if 0 < r < 1}
    assert iteration_tasks(cfg, 1) == tasks  # the next iteration goes on through the file, from its start again
    cfg.rollout.tasks_per_iteration = n + 1  # an iteration would roll one task out twice, as rows with one key
    with pytest.raises(TaskFileError, match=f"{n} distinct tasks, fewer than rollout.tasks_per_iteration"):
        iteration_tasks(cfg, 0)


def test_cli_filter_and_its_refusals(run, tmp_path, capsys):
    out = tmp_path / "t.parquet"
    root = f"storage.root={run.storage.root}"
    assert main(["filter", "--run", "w", "--min-pass", "0.1", "--max-pass", "0.9", "--out", str(out), root]) == 0
    printed = capsys.readouterr().out
    assert "kept" in printed and out.is_file()
    # the next command keeps this one's root (pasted alone it trained into ./workspace on the embedded defaults),
    # trains a run of its own (the filtered run's id was refused: another rollout.tasks) and passes train's
    # checks (16 tasks an iteration from fewer kept was refused)
    assert f"next: cleaner train {root} rollout.tasks={out}" in printed, printed
    import shlex

    from flows.run_config import preflight
    from pipeline.config import load_config

    overrides = shlex.split(printed.split("next: cleaner train ", 1)[1].strip())
    assert "flow.run_id=w-filtered" in overrides
    preflight(load_config(None, overrides))
    for bad, says in ((tmp_path, "is a folder"), (tmp_path / "nodir" / "t.parquet", "folder")):
        assert main(["filter", "--run", "w", "--out", str(bad), root]) == 2
        assert f"--out {bad}: {says}" in capsys.readouterr().err
    assert main(["filter", "--run", "w", "--min-pass", "0.9", "--max-pass", "0.1", "--out", str(out), root]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "0 <= --min-pass < --max-pass <= 1" in err
    nothing = tmp_path / "none.parquet"
    with pytest.raises(FilterError, match="no task of run 'w' has a pass rate strictly between 0.99 and 1"):
        run_filter(run.storage.root, "w", None, 0.99, 1.0, nothing)
    assert not nothing.exists() and not list(tmp_path.glob(".none.parquet*"))
    assert main(["filter", "--run", "nope", "--out", str(out), root]) == 1
    assert "run 'nope' does not exist" in capsys.readouterr().err


def test_filter_has_help(capsys):
    with pytest.raises(SystemExit) as e:
        main(["filter", "--help"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    assert "KEY=VALUE" in out and "cleaner filter --run demo --min-pass 0.1 --max-pass 0.9" in out
