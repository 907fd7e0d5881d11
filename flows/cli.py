"""The `cleaner` command line. Every subcommand reads the one config tree (YAML + dotted overrides).

Each command module below exposes `add_parser(subparsers)`, its parsers beside the code they run; heavy
engines (torch, Beam, Prefect, OpenRLHF) are imported inside the commands so that `cleaner --help` and
`cleaner inspect` stay fast.
"""

from __future__ import annotations

import argparse
import importlib
import os
import signal
import sys

from flows.command import EPILOG_OVERRIDES, Parser, command_parser, config_of, split_overrides
from pipeline.config import ConfigError, describe_config, dump_config
from storage.errors import CleanerError, describe_os_error

COMMAND_MODULES = (
    "flows.inspect",
    "flows.flow_commands",
    "flows.policy_cmds",
    "flows.eval_cmd",
    "flows.view_cmd",
    "flows.stage_cmds",
    "flows.replay_cmd",
    "flows.gc_cmd",
    "flows.filter_cmd",
    "flows.export_cmd",
    "flows.import_cmd",
)
COMMAND_MODULES += ("flows.fit_cmd",)  # before a run: does the update fit the GPUs (trainer/memory.py)


def run_config(args: argparse.Namespace) -> int:
    cfg = config_of(args)
    if args.describe is None:
        print(dump_config(cfg), end="")
        return 0
    lines = [line for line in describe_config(cfg) if line.startswith(args.describe)]
    if not lines:
        raise ConfigError(
            f"--describe {args.describe}: no setting starts so (sections: {', '.join(type(cfg).model_fields)})"
        )
    print("\n".join(lines))
    return 0


def build_parser() -> Parser:
    parser = Parser(
        prog="cleaner",
        description="CLEANER: offline two-phase agentic RL with self-purified trajectories (SAAR).",
        epilog=EPILOG_OVERRIDES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    p = command_parser(
        sub,
        "config",
        "print the resolved config tree, or each setting with what it does",
        "Examples:\n  cleaner config -c configs/demo.yaml\n  cleaner config --describe rollout.saar\n"
        "  cleaner config --describe   # every setting",
        func=run_config,
    )
    p.add_argument(
        "--describe",
        nargs="?",
        const="",
        metavar="PREFIX",
        help=("print every setting (or those whose key starts with PREFIX) as key: value  # what it does"),
    )
    for module in COMMAND_MODULES:
        importlib.import_module(module).add_parser(sub)
    return parser


# Commands that commit nothing a rerun would resume (eval writes its files at its end, whole, or not at all)
COMMITS_NOTHING = frozenset({"config", "eval", "filter", "inspect", "report", "view", "server", "cluster", "export"})


# commands that run a flow on a Prefect server (the temporary one, or PREFECT_API_URL's)
FLOW_COMMANDS = frozenset({"train", "demo", "schedule"})


def environment_message(e: BaseException, command: str = "train") -> str | None:
    """One line for a failure that is the environment's, not a bug, raised by a library rather than as a
    CleanerError or OSError: None for the others (their traceback is kept)."""
    kind = f"{type(e).__module__.split('.')[0]}.{type(e).__name__}"
    first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
    if kind in ("duckdb.IOException", "_duckdb.IOException") and ("No files found" in first or "No such file" in first):
        # the catalog's views were made before another command (cleaner gc) removed a shard
        return (
            f"a file it was reading was removed meanwhile (by cleaner gc, or another command): run it again ({first})"
        )
    if command in FLOW_COMMANDS and kind in ("httpx.ConnectError", "httpx.RemoteProtocolError", "httpx.ReadError"):
        return (
            f"lost the Prefect server ({first}): it stopped while the flow ran; run the same command again to resume "
            "(what was committed is kept)"
        )
    return None


def main(argv: list[str] | None = None) -> int:
    from flows.console import command_prints_errors, quiet_libraries

    quiet_libraries()  # before torch, Beam or DeepSpeed are imported by a subcommand
    from pipeline.processes import keep_interrupts_from_finalizers

    keep_interrupts_from_finalizers()  # a Ctrl-C landing in a finalizer is not lost
    parser = build_parser()
    argv, overrides = split_overrides(parser, list(sys.argv[1:] if argv is None else argv))
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 0
    if hasattr(args, "overrides"):
        args.overrides = [*args.overrides, *overrides]
    elif overrides:
        parser.error(f"{overrides[0]}: {args.command} takes no config overrides")
    try:
        with command_prints_errors():  # a flow's records of a user error leave its line to the one below
            return int(args.func(args) or 0)
    except (CleanerError, OSError) as e:  # user-facing failures get one line, bugs keep their traceback
        if os.environ.get("CLEANER_TRACEBACK"):
            raise
        # an OSError is the environment's: a missing file, a full or read-only disk
        message, code = (str(e), e.exit_code) if isinstance(e, CleanerError) else (describe_os_error(e), 1)
        print(f"cleaner {args.command}: {' '.join(message.split())}", file=sys.stderr)
        return code
    except Exception as e:  # noqa: BLE001 - a library's failure that is the environment's gets one line too
        message = environment_message(e, args.command)
        if message is None or os.environ.get("CLEANER_TRACEBACK"):
            raise
        print(f"cleaner {args.command}: {' '.join(message.split())}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:  # Ctrl-C: committed stages are kept, an update resumes from its last mini-batch
        if os.environ.get("CLEANER_TRACEBACK"):
            raise
        print(
            f"cleaner {args.command}: interrupted"
            + (
                ""
                if args.command in COMMITS_NOTHING
                else "; run the same command again to resume (what was committed is kept)"
            ),
            file=sys.stderr,
        )
        # the interrupt is handled: one delivered again while the command's threads and servers wind down (a
        # terminal's Ctrl-C reaches the whole process group) must not end it by the signal instead of exit 130
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        # A Ctrl-C that landed in code run from a string (dataclasses and namedtuple build their methods with
        # exec at import) leaves CPython's mark of an unhandled Ctrl-C set, and under `python -m` it then ends
        # the process by SIGINT at exit, handled or not; running a string again clears that mark.
        exec("None")
        return 130


if __name__ == "__main__":
    sys.exit(main())
