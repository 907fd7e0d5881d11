"""Purification on Beam's DaskRunner: a local scheduler and two worker processes (purifier/dask_cluster.py),
against the in-process FnApiRunner on the same real raw shard of the tiny policy.

The raw shard is world_rollout's rows (with two rows broken so that dead letters exist) rewritten in parts
of 8 rows: Dask runs one raw part per partition, so the parts are what spreads the work over workers.
Which worker ran what is read from the Dask scheduler itself (its task stream and `client.run`), not from
anything the pipeline writes for the test.
"""

from __future__ import annotations

import os
import signal
import subprocess
import threading
import time
from pathlib import Path

import apache_beam as beam
import pyarrow as pa
import pytest
from apache_beam.options.pipeline_options import PipelineOptions

from pipeline.config import DEFAULT_POLICY
from pipeline.modes import Variant
from pipeline.processes import alive
from pipeline.trajectory import trajectory_from_row, trajectory_to_row
from purifier import beam_pipeline, dask_cluster
from purifier.batch import SORT
from purifier.stage import DaskRunFailed, run_purify_stage
from pipeline.variants import plan_variants
from storage.errors import CleanerError
from storage.layout import RunLayout
from storage.schemas import DEAD_LETTER, PURIFIED, RAW
from storage.shards import read_manifest, read_shard, write_shard

pytest.importorskip("distributed")
VARIANTS = [("saar", 0.5), ("raw", 0.0)]
PARTS_OF = 8  # rows per raw part: 64 rows → 8 parts, 8 Dask partitions


def _raw_shard(world_rollout, root: Path) -> None:
    rows = read_shard(RunLayout(world_rollout.storage.root, "w").raw_dir(0), RAW).to_pylist()
    trajs = [trajectory_from_row(r) for r in rows]
    for t in [t for t in trajs if t.positions][:2]:  # two rows no purification can splice: dead letters
        t.positions[0].attempts[0].call_start = 99_999
    table = pa.Table.from_pylist([trajectory_to_row(t) for t in trajs], schema=RAW)
    write_shard(
        RunLayout(root, "w").raw_dir(0), table, RAW, "dask-test", inputs=[str(DEFAULT_POLICY)], rows_per_part=PARTS_OF
    )


def _cfg(world_rollout, root: Path, runner: str = "FnApiRunner", address: str | None = None, options=()):
    cfg = world_rollout.model_copy(deep=True)
    cfg.storage.root = root
    cfg.purify.modes, cfg.purify.gammas = ["saar", "raw"], [0.5]
    cfg.purify.runner, cfg.purify.dask_address, cfg.purify.beam_options = runner, address, list(options)
    return cfg


def _output(root: Path) -> dict:
    """Every committed partition's content (sorted; dead letters' source files by name, not folder) and
    manifest row counts."""
    layout, out = RunLayout(root, "w"), {}
    for mode, gamma in VARIANTS:
        pdir, ddir = layout.purified_dir(0, mode, gamma), layout.dead_letter_dir(0, mode, gamma)
        dead = read_shard(ddir, DEAD_LETTER).sort_by([("raw_key", "ascending")]).to_pylist()
        for d in dead:
            d["source_file"] = Path(d["source_file"]).name
        out[(mode, gamma)] = {
            "purified": read_shard(pdir, PURIFIED).sort_by(SORT).to_pylist(),
            "dead": dead,
            "rows": (read_manifest(pdir).rows, read_manifest(ddir).rows),
            "extra": {k: v for k, v in read_manifest(pdir).extra.items()},
        }
    return out


@pytest.fixture(scope="module")
def reference(world_rollout, tmp_path_factory):
    """The shard purified in-process (FnApiRunner): what every Dask run must commit."""
    root = tmp_path_factory.mktemp("fnapi")
    _raw_shard(world_rollout, root)
    run_purify_stage(_cfg(world_rollout, root), "w", 0)
    out = _output(root)
    assert out[("saar", 0.5)]["rows"] == (62, 2) and out[("raw", 0.0)]["rows"] == (62, 2)
    return out


@pytest.fixture
def cluster(tmp_path):
    """A scheduler and two worker processes on 127.0.0.1, stopped by their pids whatever the test did."""
    directory = tmp_path / "cluster"
    c = dask_cluster.start(directory, workers=2, timeout=60)
    try:
        yield c
    finally:
        dask_cluster.stop(directory, grace=5)
        assert not any(alive(p) for p in c.pids)


def _client(cluster):
    from distributed import Client

    return Client(cluster.address, timeout="10s", set_as_default=False)


@pytest.mark.timeout(120)
def test_dask_commits_what_fnapi_commits_with_work_in_both_workers(world_rollout, reference, cluster, tmp_path):
    from distributed import get_task_stream

    root = tmp_path / "ws"
    _raw_shard(world_rollout, root)
    with _client(cluster) as client:
        pid_of = client.run(os.getpid)  # worker address → pid
        assert sorted(pid_of.values()) == sorted(cluster.worker_pids)
        with get_task_stream(client) as stream:
            results = run_purify_stage(_cfg(world_rollout, root, "dask", cluster.address), "w", 0)
        assert {(r.mode, r.threshold, r.rows, r.dead, r.skipped) for r in results} == {
            ("saar", 0.5, 62, 2, False),
            ("raw", 0.0, 62, 2, False),
        }
        assert _output(root) == reference
        # the scheduler's own record: the DoFn bundles ran in both worker processes
        bundles = [t for t in stream.data if "apply_dofn_to_bundle" in str(t["key"])]
        assert {pid_of[t["worker"]] for t in bundles} == set(cluster.worker_pids)
        # each worker built the recompute model (and the tokenizer) once, though Dask calls setup() per
        # bundle: here 8 GroupStage bundles, the 8 partitions of the raw parts
        loads = client.run(lambda: dict(__import__("purifier.beam_pipeline").beam_pipeline.loads))
        assert all(n["recompute"] == 1 and n["tokenizer"] == 1 for n in loads.values()), loads
        # another γ on the same workers: the same checkpoint stays loaded
        again = _cfg(world_rollout, root, "dask", cluster.address)
        run_purify_stage(again, "w", 0, plan_variants(again, ["saar"], [0.7]))
        loads = client.run(lambda: dict(__import__("purifier.beam_pipeline").beam_pipeline.loads))
        assert all(n["recompute"] == 1 for n in loads.values()), loads
    assert not (RunLayout(root, "w").iteration_dir(0) / ".staging").exists()


@pytest.mark.timeout(120)
def test_a_relative_storage_root_purifies_on_dask_as_in_process(
    world_rollout, reference, cluster, tmp_path, monkeypatch
):
    """The default storage.root is relative (workspace): Dask's workers run in another directory, and resolved
    the job's paths there (a 46-line traceback, or staging written under the workers' directory)."""
    monkeypatch.chdir(tmp_path)
    _raw_shard(world_rollout, Path("ws"))
    run_purify_stage(_cfg(world_rollout, Path("ws"), "dask", cluster.address), "w", 0)
    assert _output(tmp_path / "ws") == reference


@pytest.mark.timeout(150)
def test_a_worker_killed_mid_run_is_survived_or_one_line_and_the_rerun_commits_the_same(
    world_rollout, reference, cluster, tmp_path
):
    root = tmp_path / "ws"
    _raw_shard(world_rollout, root)
    cfg = _cfg(world_rollout, root, "dask", cluster.address)
    outcome: dict = {}

    def purify() -> None:
        try:
            outcome["results"] = run_purify_stage(cfg, "w", 0)
        except Exception as e:  # noqa: BLE001 - judged below
            outcome["error"] = e

    with _client(cluster) as client:
        pid_of = client.run(os.getpid)
        driver = threading.Thread(target=purify)
        driver.start()
        victim, deadline = None, time.monotonic() + 60
        while victim is None and driver.is_alive() and time.monotonic() < deadline:
            busy = [w for w, keys in client.processing().items() if any("apply_dofn_to_bundle" in str(k) for k in keys)]
            if busy:
                victim = pid_of[busy[0]]
            else:
                time.sleep(0.02)
        assert victim is not None, "the pipeline ended before a worker could be killed mid-run"
        os.kill(victim, signal.SIGKILL)
        killed_mid_run = driver.is_alive()
        driver.join(timeout=100)
        assert not driver.is_alive()
    assert killed_mid_run
    layout = RunLayout(root, "w")
    if "error" in outcome:  # failed: one line, nothing committed, no staging left
        e = outcome["error"]
        assert isinstance(e, CleanerError) and "\n" not in str(e), repr(e)
        assert all(read_manifest(layout.purified_dir(0, m, g)) is None for m, g in VARIANTS)
    else:  # survived on the remaining worker: the same output as in-process
        assert _output(root) == reference
    assert not (layout.iteration_dir(0) / ".staging").exists()
    # the rerun, on the one worker left, commits (or keeps) exactly the same
    run_purify_stage(cfg, "w", 0)
    assert _output(root) == reference


@pytest.mark.timeout(60)
def test_stop_ends_a_running_cluster_through_dask_shutdown_without_a_signal(tmp_path):
    directory = tmp_path / "cluster"
    c = dask_cluster.start(directory, workers=1, timeout=60)
    try:
        dask_cluster._shutdown(c, grace=30)  # what stop() does first while the scheduler runs
        assert not any(alive(p) for p in c.pids)  # the scheduler closed its worker and itself: no pid was signalled
    finally:
        dask_cluster.stop(directory, grace=5)
    assert dask_cluster.status(directory) is None


def test_no_cluster_or_no_scheduler_is_one_line_and_writes_nothing(world_rollout, tmp_path):
    root = tmp_path / "ws"
    _raw_shard(world_rollout, root)
    before = sorted(p.relative_to(root) for p in root.rglob("*"))
    with pytest.raises(dask_cluster.ClusterError, match=r"no local Dask cluster in .*cleaner cluster start"):
        run_purify_stage(_cfg(world_rollout, root, "dask"), "w", 0)
    with pytest.raises(DaskRunFailed, match=r"tcp://127\.0\.0\.1:9 failed .*nothing was committed") as e:
        run_purify_stage(
            _cfg(world_rollout, root, "dask", "tcp://127.0.0.1:9", ["--dask_connection_timeout=2"]), "w", 0
        )
    assert "\n" not in str(e.value)
    assert sorted(p.relative_to(root) for p in root.rglob("*")) == before


@pytest.mark.timeout(90)
def test_cluster_start_options_and_a_concurrent_start_are_one_line_before_anything_starts(tmp_path):
    """A port in use was 'Scheduler failed to start', 99999 started on 34463, GPU a ValueError; two starts at once
    left a broken cluster or two misleading errors."""
    import fcntl
    import socket

    directory = tmp_path / "c"
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        used = taken.getsockname()[1]
        for kw, says in (
            ({"port": used}, f"--port {used}: in use on 127.0.0.1"),
            ({"port": 99999}, "--port 99999"),
            ({"resources": "GPU"}, "expected NAME=NUMBER pairs"),
            ({"timeout": 0}, "--timeout 0"),
        ):
            with pytest.raises(dask_cluster.ClusterError, match=says) as e:
                dask_cluster.start(directory, workers=1, **kw)
            assert "\n" not in str(e.value)
    directory.mkdir(exist_ok=True)
    with open(directory / ".start.lock", "w") as held:  # another start under way
        fcntl.flock(held, fcntl.LOCK_EX)
        with pytest.raises(dask_cluster.ClusterError, match="another `cleaner cluster start` is starting"):
            dask_cluster.start(directory, workers=1)
    assert dask_cluster.status(directory) is None


def test_cluster_start_stop_status_leave_no_process(tmp_path):
    directory = tmp_path / "c"
    c = dask_cluster.start(directory, workers=2, timeout=60)
    try:
        st = dask_cluster.status(directory)
        assert st.running and len(c.worker_pids) == 2 and c.address.startswith("tcp://127.0.0.1:")
        assert "2/2 workers up" in st.line()
        with pytest.raises(dask_cluster.ClusterError, match="already runs"):
            dask_cluster.start(directory, workers=1)
        # the project is importable in the workers (PYTHONPATH = this checkout)
        with _client(c) as client:
            where = client.run(lambda: __import__("purifier.dask_cluster").dask_cluster.CHECKOUT)
        assert set(where.values()) == {dask_cluster.CHECKOUT}
    finally:
        stopped = dask_cluster.stop(directory, grace=5)
    assert stopped == c
    assert not any(alive(p) or Path(f"/proc/{p}").exists() for p in c.pids)
    assert dask_cluster.status(directory) is None and dask_cluster.stop(directory) is None
    # a cluster that cannot come up is stopped again, by pid, and said in one line
    with pytest.raises(dask_cluster.ClusterError, match=r"worker exited .*worker-0\.log") as e:
        dask_cluster.start(directory, workers=1, memory_limit="not-a-size", timeout=60)
    assert "\n" not in str(e.value) and dask_cluster.status(directory) is None
    ours = subprocess.run(["pgrep", "-f", str(directory)], capture_output=True, text=True).stdout.split()
    assert ours == [], ours


def test_pipeline_uses_no_construct_the_dask_runner_drops():
    """What Beam's DaskRunner does not execute (tagged outputs, finish_bundle output, branches that do not
    end in the last transform, metrics) is absent from the pipeline, whatever the runner."""
    import apache_beam as beam

    p = beam.Pipeline()
    beam_pipeline.build(p, beam_pipeline.PurifyJob((), (Variant.of("saar", 0.5),), "/nonexistent", str(DEFAULT_POLICY)))
    found = []

    class Visitor(beam.pipeline.PipelineVisitor):
        def visit_transform(self, node):
            found.append(node)

    p.visit(Visitor())
    consumed = {id(i) for n in found for i in n.inputs}
    for node in found:
        assert len(node.outputs) <= 1, node.full_label  # no with_outputs
        fn = getattr(node.transform, "fn", None)
        assert not (fn and type(fn).finish_bundle is not beam.DoFn.finish_bundle), node.full_label
        assert all(id(o) in consumed for o in node.outputs.values()) or node is found[-1], node.full_label
    assert found[-1].full_label == "WriteSummary"
    assert "Metrics" not in vars(beam_pipeline)  # counts are staged as rows: DaskRunner reports no metrics


@pytest.mark.timeout(150)
def test_scheduler_killed_mid_run_is_one_line_and_a_new_cluster_commits_the_same(
    world_rollout, reference, cluster, tmp_path
):
    root = tmp_path / "ws"
    _raw_shard(world_rollout, root)
    outcome: dict = {}

    def purify() -> None:
        try:
            outcome["results"] = run_purify_stage(_cfg(world_rollout, root, "dask", cluster.address), "w", 0)
        except Exception as e:  # noqa: BLE001 - judged below
            outcome["error"] = e

    with _client(cluster) as client:
        driver = threading.Thread(target=purify)
        driver.start()
        deadline = time.monotonic() + 60
        while (
            driver.is_alive()
            and time.monotonic() < deadline
            and not any("apply_dofn_to_bundle" in str(k) for keys in client.processing().values() for k in keys)
        ):
            time.sleep(0.02)
        os.kill(cluster.scheduler_pid, signal.SIGKILL)
        killed_mid_run = driver.is_alive()
        driver.join(timeout=100)
        assert not driver.is_alive()
    assert killed_mid_run
    e = outcome.get("error")
    assert isinstance(e, DaskRunFailed) and "\n" not in str(e), repr(e)
    layout = RunLayout(root, "w")
    assert all(read_manifest(layout.purified_dir(0, m, g)) is None for m, g in VARIANTS)
    assert not (layout.iteration_dir(0) / ".staging").exists()
    dask_cluster.stop(cluster.directory, grace=5)
    fresh = dask_cluster.start(tmp_path / "again", workers=2, timeout=60)
    try:
        run_purify_stage(_cfg(world_rollout, root, "dask", fresh.address), "w", 0)
    finally:
        dask_cluster.stop(fresh.directory, grace=5)
    assert _output(root) == reference


class _Parity(beam.DoFn):
    """Odd numbers on the main output, even ones tagged "even", each counted in a Beam metric."""

    def process(self, x):
        beam.metrics.Metrics.counter("parity", "seen").inc()
        yield x if x % 2 else beam.pvalue.TaggedOutput("even", x)


def _tagged_run(options: list[str], seen: Path):
    p = beam.Pipeline(options=PipelineOptions(options))
    outs = p | beam.Create([1, 2, 3, 4]) | beam.ParDo(_Parity()).with_outputs("even", main="odd")
    _ = outs.even | beam.Map(lambda x, d=str(seen): (Path(d) / str(x)).touch())  # the last transform
    result = p.run()
    result.wait_until_finish()
    return result, sorted(int(f.name) for f in seen.iterdir())


def test_why_purify_keys_its_one_output_and_stages_its_counts(cluster, tmp_path):
    """beam_pipeline tells groups from destined tables by key and stages its counts as rows, rather than using
    tagged outputs and Beam metrics, because Beam's DaskRunner keeps neither (FnApiRunner keeps both). If a Beam
    upgrade fixes the Dask side, this fails: then PurifyBatches can tag its outputs and the counts become metrics."""
    (fn_seen := tmp_path / "fn").mkdir()
    result, even = _tagged_run(["--runner=FnApiRunner"], fn_seen)
    assert even == [2, 4]
    (counter,) = result.metrics().query(beam.metrics.MetricsFilter().with_name("seen"))["counters"]
    assert counter.committed == 4
    (dask_seen := tmp_path / "dask").mkdir()
    result, even = _tagged_run(
        [f"--runner={beam_pipeline.DASK_RUNNER}", f"--dask_client_address={cluster.address}"], dask_seen
    )
    try:
        assert even == [1, 2, 3, 4]  # the consumer of the "even" tag read the main output too
        with pytest.raises(NotImplementedError):
            result.metrics()
    finally:
        result.client.close()
