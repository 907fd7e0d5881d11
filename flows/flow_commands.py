"""`cleaner demo`, `train`, `report` and `schedule` (Prefect flows), and `server` and `cluster` (local services)."""

from __future__ import annotations

import argparse
import contextlib
import os
import shlex
import sys
import threading
import time
from pathlib import Path
from typing import Callable

from flows.command import command_parser, config_of, port_arg
from flows.console import working
from pipeline.config import CleanerConfig, load_config

DEMO_CONFIG = Path(__file__).resolve().parent.parent / "configs" / "demo.yaml"
QUERIES = (
    '  cleaner inspect{args} --sql "SELECT iteration, avg(reward) AS reward, '
    "avg(stats.first_attempt_failures) AS first_call_failures_per_trajectory FROM raw_trajectories "
    'GROUP BY 1 ORDER BY 1"\n'
    "  cleaner inspect{args} --sql \"SELECT error_label, count(*) FROM raw_attempts WHERE status = 'failure' "
    'GROUP BY 1 ORDER BY 2 DESC"\n'
    '  cleaner inspect{args} --sql "SELECT * FROM purify_compare"\n'
    "  duckdb -readonly {db}    # the same views from the duckdb CLI (read-only: a running flow is unaffected)"
)


def _load(args: argparse.Namespace, check: Callable[[CleanerConfig], None] | None = None):
    """The command's config, checked by `check` (before anything is written under its root), with Prefect set up."""
    cfg = config_of(args)
    if check is not None:
        check(cfg)
    from flows.env import configure_prefect

    configure_prefect(cfg.storage.root)
    return cfg


def cmd_train(args: argparse.Namespace) -> int:
    from flows.run_config import check_run_config, preflight

    def check(cfg: CleanerConfig) -> None:  # one line before Prefect is set up, not a failed flow run
        from storage.checkpoints import check_checkpoint

        preflight(cfg)
        if not check_run_config(cfg, cfg.flow.run_id):  # a new run starts from rollout.policy: whole weights
            check_checkpoint(Path(cfg.rollout.policy))

    cfg = _load(args, check)
    from flows.server import start_temporary_server

    start_temporary_server(cfg.storage.root)  # dies with this command, even under kill -9
    with working(f"[train] loading Prefect and the training flow of run {cfg.flow.run_id!r}"):
        from flows.training import training_flow

    ckpt = training_flow(str(args.config) if args.config else None, list(args.overrides))
    print(f"final checkpoint: {ckpt}")
    return 0


def cmd_report(args: argparse.Namespace) -> int:
    from flows.report import iteration_table, markdown_table, write_report

    cfg = config_of(args)
    run_id = args.run or cfg.flow.run_id
    page = write_report(cfg.storage.root, run_id)
    print(markdown_table(iteration_table(cfg.storage.root, run_id)))
    print(f"report: {page}")
    return 0


def cmd_demo(args: argparse.Namespace) -> int:
    config = args.config or DEMO_CONFIG
    cfg = load_config(config, args.overrides)
    from flows.server import start_temporary_server

    start_temporary_server(cfg.storage.root)  # dies with this command, even under kill -9
    if not (cfg.rollout.policy / "model.safetensors").exists():
        from flows.bootstrap import BootstrapConfig, bootstrap

        print(f"[demo] no policy at {cfg.rollout.policy}: bootstrapping one (about 20 minutes) ...")
        bootstrap(cfg.rollout.policy, BootstrapConfig(world=cfg.world))
    with working("[demo] loading Prefect and the training flow"):
        from flows.side_flows import replay_flow
        from flows.training import training_flow
    from flows.report import iteration_table, markdown_table, write_report

    print(
        f"[demo] training flow: run {cfg.flow.run_id!r}, {cfg.flow.iterations} iterations of rollout -> purify -> "
        f"update (Prefect, temporary local server; a rerun resumes)"
    )
    training_flow(str(config), list(args.overrides))
    print(f"[demo] replaying iteration 0 under γ = {cfg.flow.replay_gammas}")
    replay_flow(str(config), list(args.overrides), iterations=[0], gammas=cfg.flow.replay_gammas)
    page = write_report(cfg.storage.root, cfg.flow.run_id)
    run_dir = cfg.storage.root / "runs" / cfg.flow.run_id
    # the follow-up commands printed below look at the same workspace and settings
    again = "".join(f" {shlex.quote(p)}" for p in ["-c", str(config), *args.overrides])
    print("\n" + markdown_table(iteration_table(cfg.storage.root, cfg.flow.run_id)) + "\n")
    print(
        "Where to look:\n"
        f"  report      {page}\n"
        f"  shards      {run_dir}/iteration=*/raw, purified/mode=*/gamma=*\n"
        f"  checkpoints {run_dir}/checkpoints/\n"
        f"  viewer      cleaner view{again}   "
        "(then open the URL it prints: trajectories beside their purified variants)\n"
        f"  replay      cleaner replay{again} --run {cfg.flow.run_id} --iteration 0 "
        f"--gamma {' '.join(map(str, cfg.flow.replay_gammas))}\n"
        "Try these queries:\n"
        f"{QUERIES.format(args=again, db=shlex.quote(str((cfg.storage.root / cfg.storage.catalog).resolve())))}"
    )
    return 0


def schedule_problem(args: argparse.Namespace, run_id: str) -> str | None:
    """Why the schedule's own arguments cannot serve, checked before a server starts (a bad cron was a 58-line
    ValidationError after it, a bad --new-run template a KeyError at every firing); None when they can."""
    import math

    if args.interval is None and not args.cron:
        return "give --interval SECONDS or --cron 'EXPR'"
    if args.interval is not None and args.cron:
        return "give --interval or --cron, not both"
    if args.interval is not None and not (math.isfinite(args.interval) and args.interval > 0):
        return f"--interval {args.interval:g}: seconds between firings, a number above 0"
    if args.cron:
        from prefect.client.schemas.schedules import CronSchedule
        from pydantic import ValidationError

        try:
            CronSchedule(cron=args.cron)
        except ValidationError:
            return f"--cron {args.cron!r}: not a cron expression (five fields, e.g. '0 3 * * *': every day at 03:00)"
    if args.new_run:
        from flows.run_config import run_id_for
        from storage.errors import RunIdError
        from storage.layout import RunLayout

        try:
            RunLayout(Path("."), run_id_for(args.new_run, run_id))
        except (KeyError, IndexError, ValueError) as e:
            what = f"{{{e.args[0]}}} is not one of them" if isinstance(e, KeyError) else str(e)
            if isinstance(e, RunIdError):
                what = f"it makes {e}"
            return f"--new-run {args.new_run!r}: a run name from {{run_id}}, {{date}}, {{time}}; {what}"
    return None


def crash_stale_firings(deployment: str) -> int:
    """Mark Crashed the firings of `deployment` (flow/name) that the store's database still holds as running or
    pending; how many. Called on a server this command just started, so nothing of an earlier one can still be
    reporting to it: those firings' command was killed (kill -9, OOM, a reboot). Their run held the deployment's
    one concurrency slot, through a lease the earlier server kept in memory, so every later firing was cancelled,
    for good; the forced state change releases it (Prefect's ReleaseFlowConcurrencySlots, by its fallback)."""
    from prefect import get_client
    from prefect.client.schemas.filters import (
        DeploymentFilter,
        DeploymentFilterId,
        FlowRunFilter,
        FlowRunFilterState,
        FlowRunFilterStateType,
    )
    from prefect.client.schemas.objects import StateType
    from prefect.exceptions import ObjectNotFound
    from prefect.states import Crashed

    with get_client(sync_client=True) as client:
        try:
            found = client.read_deployment_by_name(deployment)
        except ObjectNotFound:
            return 0
        stale = client.read_flow_runs(
            deployment_filter=DeploymentFilter(id=DeploymentFilterId(any_=[found.id])),
            flow_run_filter=FlowRunFilter(
                state=FlowRunFilterState(type=FlowRunFilterStateType(any_=[StateType.RUNNING, StateType.PENDING]))
            ),
        )
        for run in stale:
            message = "its `cleaner schedule` ended while it ran (killed); marked crashed by the next one"
            client.set_flow_run_state(run.id, Crashed(message=message), force=True)
        return len(stale)


def cmd_schedule(args: argparse.Namespace) -> int:
    cfg = _load(args)
    problem = schedule_problem(args, cfg.flow.run_id)
    if problem:
        print(f"cleaner schedule: {problem}", file=sys.stderr)
        return 2
    started = False
    if not os.environ.get("PREFECT_API_URL"):
        # Prefect's temporary server cannot schedule (it dies with the command): run a real one.
        from flows.server import running_server, start_server

        running = running_server(cfg.storage.root)
        owned = (
            f"it belongs to `cleaner schedule` pid {running.owner}, and ends with it"
            if running and running.owner
            else ""
        )
        print(
            f"[schedule] using the project's running Prefect server (pid {running.pid}, {running.url}); "
            + (owned or "it stays up when this command ends")
            + ("; --port and --no-ui apply to a server this command starts" if args.port or args.no_ui else "")
            if running
            else f"[schedule] starting a local Prefect server for {cfg.storage.root} (log: "
            f"{cfg.storage.root / '.prefect' / 'server.log'}) ...",
            flush=True,
        )
        # bound: even a killed command (kill -9, a CI timeout) takes its server down with it
        server, started = start_server(cfg.storage.root, port=args.port, ui=not args.no_ui, bound=True)
        os.environ["PREFECT_API_URL"] = server.url
    else:
        from flows.server import check_api

        check_api(os.environ["PREFECT_API_URL"])  # one line, before the banner says it works
    url = os.environ["PREFECT_API_URL"]
    if started:  # a server of our own: a firing it lists as running belongs to a command that is gone
        stale = crash_stale_firings(f"cleaner-training/{args.name}")
        if stale:
            print(
                f"[schedule] {stale} firing(s) of an earlier schedule were still running in the store's records "
                "(that command was killed): marked crashed, so that firings are not cancelled as if one ran",
                flush=True,
            )
    # the venv's own prefect: a shell without the venv activated has none on its PATH
    prefect = Path(sys.executable).parent / "prefect"
    prefect_cmd = shlex.quote(str(prefect)) if prefect.is_file() else "prefect"
    each = (
        f"a new run named {args.new_run!r}"
        if args.new_run
        else f"{cfg.flow.iterations} more iteration(s) of run {cfg.flow.run_id!r} from its last checkpoint"
    )
    print(
        f"[schedule] every firing trains {each}\n"
        f"[schedule] Prefect API {url}; trigger a run now from any shell with:\n"
        f"  PREFECT_API_URL={url} {prefect_cmd} deployment run 'cleaner-training/{args.name}'\n"
        + ("[schedule] the server stops when this command ends (Ctrl-C or kill; even kill -9)" if started else ""),
        flush=True,
    )
    if args.new_run and "{time}" not in args.new_run and (args.cron or args.interval < 86_400):
        print(
            f"[schedule] note: {args.new_run!r} names at most one run a day; a firing that finds its run already "
            "trained keeps every stage and trains nothing new (add {time} to fire more often)",
            flush=True,
        )
    import warnings

    from flows.training import training_flow

    # Prefect's runner leaves its stop coroutine unawaited when the process is told to end
    warnings.filterwarnings("ignore", message="coroutine 'Runner.astop' was never awaited")
    # SIGTERM (kill, systemd, docker stop) stops as Ctrl-C does: Prefect's runner answers it with sys.exit inside its
    # event loop, and the server stopped under a firing still running, which retried the API for minutes (hundreds
    # of traceback lines). Its handler is the runner's method: replaced for this process.
    from prefect.runner import Runner

    server_pid = server.pid if started else None
    Runner.handle_sigterm = lambda _runner, *_args, **_kw: _interrupt_firings(server_pid)
    # Stopped (Ctrl-C, kill), the runner waits for every firing it started, without a bound. A submission already
    # under way goes on while it pauses the deployment (seconds on a loaded server) and could start one more
    # firing, which never got the Ctrl-C: the command waited for it to train a whole iteration. Bounded here.
    runner_exit = Runner.__aexit__

    async def bounded_exit(runner, *exc_info):
        _bound_firings(server_pid)
        return await runner_exit(runner, *exc_info)

    Runner.__aexit__ = bounded_exit
    # SIGINT handled even when started in the background of a script (which starts it ignored): the SIGTERM
    # above goes through it, and the firings started from here inherit it (an ignored SIGINT is inherited)
    import signal

    signal.signal(signal.SIGINT, signal.default_int_handler)
    from pipeline.processes import SCHEDULE_PID_ENV

    os.environ[SCHEDULE_PID_ENV] = str(os.getpid())  # a firing stops when this process is gone (kill -9 included)
    ending = threading.Event()
    if started:
        threading.Thread(target=_end_with_server, args=(cfg.storage.root, server, ending), daemon=True).start()
    try:
        from prefect.client.schemas.objects import ConcurrencyLimitConfig, ConcurrencyLimitStrategy

        training_flow.serve(
            name=args.name,
            interval=args.interval,
            cron=args.cron,
            # one firing at a time: a firing while one trains is cancelled (two would train the same iteration)
            global_limit=ConcurrencyLimitConfig(limit=1, collision_strategy=ConcurrencyLimitStrategy.CANCEL_NEW),
            parameters={
                "config_file": str(args.config) if args.config else None,
                "overrides": list(args.overrides),
                "more": not args.new_run,
                "run_id_template": args.new_run,
            },
            print_starting_message=False,  # its banner's trigger command lacks PREFECT_API_URL; ours above works
        )
    finally:
        Runner.__aexit__ = runner_exit
        if started:
            from flows.server import stop_server

            ending.set()
            stop_server(cfg.storage.root)
    return 0


def _end_with_server(root: Path, server, ending: threading.Event) -> None:
    """A schedule whose own server died (killed, out of memory) ends at once, in one line: Prefect's runner went
    on polling a dead API with a traceback a minute and no longer stopped on Ctrl-C. Its firings stop as Ctrl-C
    would (they also stop by themselves once this process is gone)."""
    from flows.server import forget_server
    from pipeline.processes import alive

    while not ending.is_set() and alive(server.pid):
        time.sleep(1.0)
    if ending.is_set():  # this command is stopping it
        return
    print(
        f"[schedule] its Prefect server (pid {server.pid}) stopped (log: {server.log}); ending this schedule: "
        "firings in progress stop as Ctrl-C would, and a rerun resumes them",
        file=sys.stderr,
        flush=True,
    )
    _signal_firings(server.pid)
    with contextlib.suppress(Exception):
        forget_server(root, server.pid)  # its record names a dead pid (a server started since is not touched)
    os._exit(1)


def _interrupt_firings(server_pid: int | None) -> None:
    """What Ctrl-C does from a terminal, for a SIGTERM sent to this process alone: SIGINT to every child but the
    Prefect server (the firings in progress crash and are recorded so), then to this process (its event loop
    stops on SIGINT the way it does on Ctrl-C)."""
    import signal

    _signal_firings(server_pid)
    signal.raise_signal(signal.SIGINT)


FIRINGS_GRACE_S = 20.0  # how long a stopping schedule waits for its firings before it kills them


def _firing_pids(server_pid: int | None) -> set[int]:
    """This process's children that run a firing (Prefect's runner starts each by multiprocessing's spawn): not
    its Prefect server, nor multiprocessing's resource tracker."""
    import psutil

    pids = set()
    for child in psutil.Process().children():
        with contextlib.suppress(psutil.Error):  # gone meanwhile, or exited (a zombie)
            if child.pid != server_pid and "--multiprocessing-fork" in child.cmdline():
                pids.add(child.pid)
    return pids


def _bound_firings(server_pid: int | None, grace_s: float = FIRINGS_GRACE_S) -> None:
    """The runner is stopping: the firings running now got the Ctrl-C (the terminal's, or _interrupt_firings');
    one it starts from now on (a submission under way) is interrupted as it appears; any still running `grace_s`
    later is killed (its run is marked crashed by the next schedule), so that the runner's wait for them ends."""
    import signal

    interrupted = _firing_pids(server_pid)

    def watch() -> None:
        deadline = time.monotonic() + grace_s
        while time.monotonic() < deadline:
            for pid in _firing_pids(server_pid) - interrupted:
                interrupted.add(pid)
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGINT)
            time.sleep(0.1)
        for pid in _firing_pids(server_pid):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)

    threading.Thread(target=watch, name="schedule-stop", daemon=True).start()


def _signal_firings(server_pid: int | None) -> None:
    """SIGINT to every child of this process but the Prefect server: the firings in progress."""
    import signal

    me = os.getpid()
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            pid, ppid = int(stat.parent.name), int(stat.read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue  # gone meanwhile
        if ppid == me and pid != server_pid:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGINT)


def cmd_server(args: argparse.Namespace) -> int:
    from contextlib import nullcontext

    from flows.server import prefect_home, running_server, start_server, stop_server

    root = config_of(args).storage.root
    if args.action == "start":
        starting = (
            None
            if running_server(root)
            else working(f"starting a Prefect server for {root} (log: {prefect_home(root) / 'server.log'})")
        )
        with starting or nullcontext():  # its first start creates its database: tens of seconds
            state, started = start_server(root, port=args.port, ui=not args.no_ui)
        print(
            f"{'started' if started else 'already running'}: pid {state.pid}, UI/API "
            f"http://127.0.0.1:{state.port} (log: {state.log})\n  export PREFECT_API_URL={state.url}"
        )
    elif args.action == "stop":
        state = stop_server(root)
        print(f"stopped pid {state.pid}" if state else "no project server was running")
    else:
        state = running_server(root)
        print(f"running: pid {state.pid}, {state.url}" if state else "not running")
        return 0 if state else 1
    return 0


def cmd_cluster(args: argparse.Namespace) -> int:
    from purifier import dask_cluster

    directory = dask_cluster.cluster_dir(config_of(args).storage.root)
    if args.action == "start":
        c = dask_cluster.start(
            directory,
            workers=args.workers,
            threads=args.threads,
            port=args.port,
            timeout=args.timeout,
            resources=args.resources or "",
        )
        print(
            f"started: scheduler pid {c.scheduler_pid} at {c.address}, worker pids "
            f"{', '.join(map(str, c.worker_pids))} (logs in {c.directory})\n"
            f"  purify with: purify.runner=dask   (or purify.dask_address={c.address})"
        )
    elif args.action == "stop":
        c = dask_cluster.stop(directory)
        print(f"stopped pids {', '.join(map(str, c.pids))}" if c else "no local Dask cluster was running")
    else:
        st = dask_cluster.status(directory)
        print(st.line() if st else "not running")
        return 0 if st and st.running else 1
    return 0


def add_parser(sub) -> None:
    command_parser(
        sub,
        "demo",
        "the main job: a multi-iteration training flow on the embedded defaults",
        "Example:\n  cleaner demo flow.iterations=2",
        "Build the tiny policy if absent, run the training flow of configs/demo.yaml, replay "
        "iteration 0 under three γ, write the report and print where to look.",
        func=cmd_demo,
        config_default="configs/demo.yaml",
    )
    command_parser(
        sub,
        "train",
        "run the training flow: N iterations of rollout -> purify -> update (Prefect)",
        "Example:\n  cleaner train -c configs/demo.yaml flow.run_id=exp1 flow.iterations=10",
        "Runs as a Prefect flow (temporary local server unless PREFECT_API_URL points at `prefect "
        "server start`). Stages whose output is committed are skipped: rerun to resume.",
        func=cmd_train,
    )

    p = command_parser(
        sub,
        "report",
        "write PNG plots and an HTML page for a run",
        "Example:\n  cleaner report --run demo -c configs/demo.yaml",
        func=cmd_report,
    )
    p.add_argument("--run", help="run id (default: flow.run_id)")

    p = command_parser(
        sub,
        "schedule",
        "serve the training flow as a Prefect deployment (interval or cron)",
        "Example:\n  cleaner schedule --cron '0 2 * * *' -c configs/demo.yaml",
        "Blocks and serves the deployment. Without PREFECT_API_URL it first starts a local Prefect "
        "server on 127.0.0.1 (home <storage.root>/.prefect, stopped when this command ends), since "
        "Prefect's temporary server cannot schedule; with PREFECT_API_URL it registers the deployment "
        "there. Each firing does new work: by default it trains flow.iterations more iterations of "
        "flow.run_id from its last checkpoint (--new-run: a new run per firing).",
        func=cmd_schedule,
    )
    p.add_argument("--name", default="cleaner-training")
    p.add_argument("--interval", type=float, help="seconds between runs")
    p.add_argument("--cron", help="cron expression")
    p.add_argument("--port", type=port_arg, help="port of the local Prefect server it starts (default: a free one)")
    p.add_argument("--no-ui", action="store_true", help="start the local server without its web UI")
    p.add_argument(
        "--new-run",
        metavar="TEMPLATE",
        help=(
            "each firing starts a new run named from TEMPLATE ({run_id}, {date}, {time}; e.g. 'nightly-{date}') "
            "and trains flow.iterations on it; default: each firing continues flow.run_id for flow.iterations more "
            "iterations from its last checkpoint"
        ),
    )

    p = command_parser(
        sub,
        "server",
        "start/stop/status of the project's local Prefect server (127.0.0.1)",
        "Example:\n  cleaner server start\n  cleaner server stop",
        "A real Prefect server with the project's Prefect home (<storage.root>/.prefect), started in "
        "the background and stopped by its recorded pid. Runs, deployments and schedules then show "
        "in its UI; commands use it when PREFECT_API_URL is exported as printed. `status` exits 1 when none runs.",
        actions=("start", "stop", "status"),
        func=cmd_server,
    )
    p.add_argument("--port", type=port_arg, help="port (default: a free one)")
    p.add_argument("--no-ui", action="store_true", help="without the web UI")

    p = command_parser(
        sub,
        "cluster",
        "start/stop/status of a local Dask cluster for purify.runner=dask (127.0.0.1)",
        "Example:\n  cleaner cluster start --workers 2\n  cleaner purify --run demo --iteration 0 "
        "purify.runner=dask\n  cleaner cluster stop",
        "A Dask scheduler and N worker processes on 127.0.0.1, pids in <storage.root>/.dask/"
        "cluster.json, each stopped by its own pid. With purify.runner=dask and no "
        "purify.dask_address, purify uses this cluster. Many nodes: docs/scale_out.md.",
        actions=("start", "stop", "status"),
        func=cmd_cluster,
    )
    p.add_argument("--workers", type=int, default=2, help="worker processes (default 2)")
    p.add_argument("--threads", type=int, default=1, help="threads per worker (default 1)")
    p.add_argument("--port", type=int, default=0, help="scheduler port (default: a free one)")
    p.add_argument("--timeout", type=float, default=60.0, help="seconds to wait for every worker to join (default 60)")
    p.add_argument("--resources", help='worker resources, e.g. "GPU=1"')
