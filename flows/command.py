"""What every `cleaner` command's parser shares: one-line refusals, the config arguments (YAML + dotted
KEY=VALUE overrides) and the splitting of those overrides out of the line, wherever they stand. Each
command module's `add_parser(subparsers)` sets `func` to the command's run function (flows/cli.py)."""

from __future__ import annotations

import argparse
import difflib
import re
from functools import partial
from pathlib import Path
from typing import Callable

from pipeline.config import CleanerConfig, load_config

EPILOG_OVERRIDES = (
    "Config: --config FILE loads YAML; trailing KEY=VALUE pairs override it, e.g.\n"
    "  cleaner train rollout.samples_per_prompt=8 'purify.gammas=[0.3,0.7]' flow.iterations=5"
)
# A dotted KEY=VALUE anywhere on the line is an override (argparse alone would refuse one placed before
# --run, or feed one placed after --gamma 0.5 to --gamma); see split_overrides.
OVERRIDE = re.compile(r"^[A-Za-z_]\w*(\.\w+)+=")


def run_id_arg(value: str) -> str:
    """--run RUN: a run id (an empty one fell back to flow.run_id: `gc --run ''` acted on the default run)."""
    from storage.layout import run_id_problem

    problem = run_id_problem(value)
    if problem:
        raise argparse.ArgumentTypeError(problem)
    return value


def port_type(free: bool) -> Callable[[str], int]:
    """An argparse type for --port: a TCP port, 1–65535, or 0 for a free one where `free` (99999 was an
    OverflowError traceback from bind)."""

    def port(value: str) -> int:
        n = int(value) if value.isdigit() else -1
        if not (0 if free else 1) <= n <= 65535:
            raise argparse.ArgumentTypeError(
                f"{value!r} is not a port (0-65535; 0 picks a free one)"
                if free
                else f"{value!r} is not a port: give a number from 1 to 65535"
            )
        return n

    return port


port_arg = port_type(free=False)


class Parser(argparse.ArgumentParser):
    """A refusal of the command line is one line (argparse would print the whole usage first); the options
    that take one value are recorded for the whole tree (`value_options`), so that the value of --sql or
    --run is never taken for an override."""

    def __init__(self, *args, value_options: set[str] | None = None, **kwargs) -> None:
        self.value_options = set() if value_options is None else value_options  # before -h is added
        super().__init__(*args, **kwargs)

    def add_subparsers(self, **kwargs):
        return super().add_subparsers(parser_class=partial(Parser, value_options=self.value_options), **kwargs)

    def add_argument(self, *args, **kwargs) -> argparse.Action:
        if args[:1] == ("--run",) and "type" not in kwargs:  # every command's --run is checked as a run id
            kwargs["type"] = run_id_arg
        action = super().add_argument(*args, **kwargs)
        if action.option_strings and action.nargs is None:  # flags have nargs 0, lists "+" or "*"
            self.value_options.update(action.option_strings)
        return action

    def error(self, message: str):
        typed = re.search(r"invalid choice: '([^']*)' \(choose from (.*)\)$", message)
        if typed:  # `cleaner trian`: the command meant, as a config key typo gets one
            choices = re.findall(r"'?([\w-]+)'?", typed[2])
            close = difflib.get_close_matches(typed[1], choices, n=1)
            if close:
                message = f"{message}; did you mean {close[0]!r}?"
        self.exit(2, f"{self.prog}: {message} (see {self.prog} --help)\n")


def split_overrides(parser: Parser, argv: list[str]) -> tuple[list[str], list[str]]:
    """(argv without the overrides, the overrides in order): KEY=VALUE may stand before or after any
    option, including after multi-value ones such as --gamma, but never as the value of --sql, --run …."""
    rest, overrides = [], []
    for i, token in enumerate(argv):
        if OVERRIDE.match(token) and not (i and argv[i - 1] in parser.value_options):
            overrides.append(token)
        else:
            rest.append(token)
    return rest, overrides


def command_parser(
    subparsers,
    name: str,
    help: str,
    example: str,
    description: str | None = None,
    config: bool = True,
    actions: tuple[str, ...] = (),
    *,
    func: Callable,
    config_default: str = "embedded defaults",
    positionals: Callable[[argparse.ArgumentParser], None] | None = None,
) -> Parser:
    """A command's parser: its help, description and examples, the function it runs (`func`), its first
    positional ACTION if it has `actions`, its own `positionals` (added before KEY=VALUE: argparse fills
    positionals in order, so a variable-length one after KEY=VALUE would get only the last value), and when it
    reads the config, -c FILE and the KEY=VALUE positional with their epilog."""
    p = subparsers.add_parser(
        name,
        help=help,
        description=description,
        epilog="\n\n".join(filter(None, [example, config and EPILOG_OVERRIDES])),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.set_defaults(func=func)
    if actions:
        p.add_argument("action", choices=actions)
    if positionals is not None:
        positionals(p)
    if config:
        p.add_argument("-c", "--config", type=Path, help=f"YAML config file (default: {config_default})")
        p.add_argument("overrides", nargs="*", metavar="KEY=VALUE", help="dotted config overrides")
    return p


def config_of(args: argparse.Namespace) -> CleanerConfig:
    return load_config(args.config, args.overrides)
