"""The `cleaner` command line. Every subcommand reads the one config tree (YAML + dotted overrides).

Imports of heavy engines (torch, Beam, Prefect, OpenRLHF) happen inside the subcommands so that
`cleaner --help` and `cleaner inspect` stay fast.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Callable

from pipeline.config import CleanerConfig, ConfigError, dump_config, load_config

EPILOG_OVERRIDES = (
    "Config: --config FILE loads YAML; trailing KEY=VALUE pairs override it, e.g.\n"
    "  cleaner train rollout.samples_per_prompt=8 'purify.gammas=[0.3,0.7]' flow.iterations=5"
)

PLANNED: dict[str, tuple[str, str]] = {
    # subcommand -> (help, the issue that delivers it)
    "train": ("run the training flow: N iterations of rollout -> purify -> update (Prefect)", "#7"),
    "rollout": ("phase 1 alone: sample trajectories with retries and write raw shards", "#4"),
    "purify": ("phase 2 alone: purify one iteration's raw shards into purified shards (Beam)", "#5"),
    "replay": ("re-purify stored raw shards under other γ / modes without regenerating", "#5"),
    "update": ("phase 3 alone: one GRPO update over an iteration's purified shards (OpenRLHF)", "#6"),
    "eval": ("measure a policy on a held-out task set with the real agent loop", "#3"),
    "report": ("write PNG plots and an HTML page for a run", "#7"),
    "bootstrap": ("build the tool-use world's tokenizer, SFT corpus and tiny policy", "#3"),
    "schedule": ("serve the flows as Prefect deployments (interval or cron)", "#7"),
}


def _add_config_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("-c", "--config", type=Path, help="YAML config file (default: embedded defaults)")
    p.add_argument("overrides", nargs="*", metavar="KEY=VALUE", help="dotted config overrides")


def _config(args: argparse.Namespace) -> CleanerConfig:
    return load_config(args.config, args.overrides)


def cmd_config(args: argparse.Namespace) -> int:
    print(dump_config(_config(args)), end="")
    return 0


def cmd_inspect(args: argparse.Namespace) -> int:
    from storage.inspect import run_inspect

    cfg = _config(args)
    return run_inspect(cfg, sql=args.sql, run_id=args.run, print_queries=args.queries)


def cmd_demo(args: argparse.Namespace) -> int:
    # Until the training flow lands (issue #7) the demo runs what exists: the config tree and the
    # DuckDB catalog over the project root.
    cfg = _config(args)
    print("cleaner demo: the multi-iteration training flow arrives with issue #7; running what exists now.")
    print(f"resolved config (storage root {cfg.storage.root}):")
    print(dump_config(cfg), end="")
    from storage.inspect import run_inspect

    return run_inspect(cfg)


def _planned(name: str, issue: str) -> Callable[[argparse.Namespace], int]:
    def run(args: argparse.Namespace) -> int:
        print(f"cleaner {name}: not available yet (tracked in issue {issue}).", file=sys.stderr)
        return 2

    return run


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="cleaner",
        description="CLEANER: offline two-phase agentic RL with self-purified trajectories (SAAR).",
        epilog=EPILOG_OVERRIDES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")

    p = sub.add_parser("config", help="print the resolved config tree", epilog=EPILOG_OVERRIDES,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    _add_config_args(p)
    p.set_defaults(func=cmd_config)

    p = sub.add_parser(
        "inspect",
        help="summarise runs from the DuckDB catalog, or run SQL on its views",
        description="Views: raw_trajectories, raw_attempts, purified, splices, purify_compare, dead_letters.",
        epilog="Examples:\n  cleaner inspect\n  cleaner inspect --sql \"SELECT error_label, count(*) FROM raw_attempts "
        "GROUP BY 1\"\n  cleaner inspect --queries   # print example queries for duckdb\n\n" + EPILOG_OVERRIDES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    _add_config_args(p)
    p.add_argument("--sql", help="run this SQL against the catalog and print the result")
    p.add_argument("--run", help="restrict the summary to one run id")
    p.add_argument("--queries", action="store_true", help="print example queries to try")
    p.set_defaults(func=cmd_inspect)

    p = sub.add_parser("demo", help="the main job: a multi-iteration training flow on the embedded defaults",
                       epilog=EPILOG_OVERRIDES, formatter_class=argparse.RawDescriptionHelpFormatter)
    _add_config_args(p)
    p.set_defaults(func=cmd_demo)

    for name, (help_text, issue) in PLANNED.items():
        p = sub.add_parser(name, help=help_text, description=f"{help_text}. (Arrives with issue {issue}.)",
                           epilog=EPILOG_OVERRIDES, formatter_class=argparse.RawDescriptionHelpFormatter)
        _add_config_args(p)
        p.set_defaults(func=_planned(name, issue))
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 0
    try:
        return int(args.func(args) or 0)
    except ConfigError as e:
        print(f"cleaner {args.command}: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
