"""The catalog file is always current and never in anyone's way (issue #21).

Real flows (`cleaner train` in subprocesses, Prefect's temporary server), a real duckdb connection
held read-write by another process, and the duckdb CLI the set-up installs. The workspace is given
as a relative `storage.root`, and every reader runs from another working directory.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from tests.flow_helpers import run_cleaner, temporary_server_env, tiny_config

HOLD = """
import sys, time, duckdb
con = duckdb.connect(sys.argv[1])  # read-write, as the duckdb CLI opens a file by default
print(con.sql("SELECT count(*) FROM raw_trajectories").fetchall()[0][0], flush=True)
time.sleep(600)
"""


def _cleaner(argv: list[str], cwd: Path) -> subprocess.CompletedProcess:
    return run_cleaner(argv, cwd=cwd, env=temporary_server_env())


def _train(cwd: Path, run: str) -> None:
    cfg = tiny_config(
        cwd,
        f"{run}.yaml",
        flow={"run_id": run, "iterations": 1, "tensorboard": False},
        rollout={"tasks_per_iteration": 2, "samples_per_prompt": 2},
        purify={"modes": ["saar"]},
        train={"mini_batches": 1},
    )
    p = _cleaner(["train", "-c", str(cfg), "storage.root=ws"], cwd)  # relative to the working directory
    assert p.returncode == 0, p.stderr[-3000:]


def _runs_seen_read_only(db: Path, cwd: Path) -> list[tuple[str, int]]:
    code = (
        "import duckdb, sys; con = duckdb.connect(sys.argv[1], read_only=True); "
        "print(con.sql('SELECT run_id, count(*) FROM raw_trajectories GROUP BY 1 ORDER BY 1').fetchall())"
    )
    p = subprocess.run([sys.executable, "-c", code, str(db)], cwd=cwd, capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr[-2000:]
    return eval(p.stdout)  # a list of tuples printed by the child


def test_catalog_is_current_lock_free_and_opens_anywhere(tmp_path):
    work, elsewhere = tmp_path / "work", tmp_path / "elsewhere"
    work.mkdir(), elsewhere.mkdir()
    db = work / "ws" / "catalog.duckdb"
    _train(work, "one")
    # Published by the flow itself: no `cleaner inspect` has run, and the paths resolve from anywhere.
    assert _runs_seen_read_only(db, elsewhere) == [("one", 4)]

    holder = subprocess.Popen(
        [sys.executable, "-c", HOLD, str(db)], cwd=elsewhere, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    try:
        assert holder.stdout.readline().strip() == "4"  # it holds the file open, read-write
        _train(work, "two")  # a flow started meanwhile completes, and publishes without waiting for the holder:
        assert _runs_seen_read_only(db, elsewhere) == [("one", 4), ("two", 4)]  # while it still holds the old file
        p = _cleaner(
            [
                "inspect",
                "storage.root=ws",
                "--sql",
                "SELECT run_id, count(*) AS n FROM raw_trajectories GROUP BY 1 ORDER BY 1",
            ],
            work,
        )
        assert p.returncode == 0, p.stderr[-2000:]
        assert "one" in p.stdout and "two" in p.stdout and "Traceback" not in p.stderr
        p = _cleaner(["inspect", "storage.root=ws"], work)
        assert p.returncode == 0, p.stderr[-2000:]
        assert holder.poll() is None  # the holder was never disturbed
    finally:
        holder.kill()
        holder.wait(timeout=30)
    # A new read-only connection elsewhere sees both runs; so does the CLI that set-up installs.
    assert _runs_seen_read_only(db, elsewhere) == [("one", 4), ("two", 4)]
    cli = Path(sys.executable).parent / "duckdb"
    out = subprocess.run(
        [
            str(cli),
            "-readonly",
            "-csv",
            str(db),
            "-c",
            "SELECT run_id, count(*) AS n, count(DISTINCT measure) AS m FROM purified GROUP BY 1 ORDER BY 1",
        ],
        cwd=elsewhere,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["run_id,n,m", "one,4,1", "two,4,1"], out.stdout
