"""The `cleaner` command line. Every subcommand reads the one config tree (YAML + dotted overrides).

Imports of heavy engines (torch, Beam, Prefect, OpenRLHF) happen inside the subcommands so that
`cleaner --help` and `cleaner inspect` stay fast.
"""
from __future__ import annotations

import argparse
import os
import re
import sys
from pathlib import Path

from pipeline.config import CleanerConfig, check_gamma, check_is_threshold, dump_config, load_config
from pipeline.modes import IS_MODES, MODES
from pipeline.qwen3_tokenizer import TEMPLATE_FAMILIES
from storage.errors import CleanerError, describe_os_error

EPILOG_OVERRIDES = (
    "Config: --config FILE loads YAML; trailing KEY=VALUE pairs override it, e.g.\n"
    "  cleaner train rollout.samples_per_prompt=8 'purify.gammas=[0.3,0.7]' flow.iterations=5"
)

# A dotted KEY=VALUE anywhere on the line is an override (argparse alone would refuse one placed before
# --run, or feed one placed after --gamma 0.5 to --gamma); see split_overrides.
OVERRIDE = re.compile(r"^[A-Za-z_]\w*(\.\w+)+=")


class _Parser(argparse.ArgumentParser):
    """Refusals of the command line are one line too (argparse would print the whole usage first)."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: {message} (see {self.prog} --help)\n")


def gamma_arg(text: str) -> float:
    try:
        return check_gamma(float(text))
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"invalid γ {text!r}: {e}") from None


def is_threshold_arg(text: str) -> float:
    try:
        return check_is_threshold(float(text))
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"invalid τ {text!r}: {e}") from None


def split_overrides(parser: argparse.ArgumentParser, argv: list[str]) -> tuple[list[str], list[str]]:
    """(argv without the overrides, the overrides in order): KEY=VALUE may stand before or after any
    option, including after multi-value ones such as --gamma, but never as the value of --sql, --run …."""
    takes_value = {s for p in [parser, *_subparsers(parser)] for a in p._actions
                   if a.option_strings and a.nargs is None and a.const is None for s in a.option_strings}
    rest, overrides = [], []
    for i, token in enumerate(argv):
        if OVERRIDE.match(token) and not (i and argv[i - 1] in takes_value):
            overrides.append(token)
        else:
            rest.append(token)
    return rest, overrides


def _subparsers(parser: argparse.ArgumentParser) -> list[argparse.ArgumentParser]:
    return [p for a in parser._actions if isinstance(a, argparse._SubParsersAction) for p in a.choices.values()]


def _add_config_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("-c", "--config", type=Path, help="YAML config file (default: embedded defaults)")
    p.add_argument("overrides", nargs="*", metavar="KEY=VALUE", help="dotted config overrides")


def _config(args: argparse.Namespace) -> CleanerConfig:
    return load_config(args.config, args.overrides)


def cmd_config(args: argparse.Namespace) -> int:
    print(dump_config(_config(args)), end="")
    return 0


def cmd_inspect(args: argparse.Namespace) -> int:
    from flows.inspect import run_inspect

    cfg = _config(args)
    return run_inspect(cfg, sql=args.sql, run_id=args.run, print_queries=args.queries, verify=args.verify,
                       show_all=args.all, wide=args.wide)


def cmd_bootstrap(args: argparse.Namespace) -> int:
    from flows.bootstrap import BootstrapConfig, bootstrap
    from trainer.sft import SFTConfig

    cfg = _config(args)
    out = args.out or cfg.rollout.policy
    if (out / "model.safetensors").exists() and not args.force:
        print(f"cleaner bootstrap: {out} already holds a policy; pass --force to rebuild it", file=sys.stderr)
        return 2
    boot = BootstrapConfig(corpus_size=args.corpus_size, seed=args.seed, world=cfg.world,
                           sft=SFTConfig(steps=args.steps, seed=args.seed, threads=args.threads))
    bootstrap(out, boot)
    print(f"next: cleaner eval --world rollout.policy={out}")
    return 0


def cmd_init_policy(args: argparse.Namespace) -> int:
    from flows.init_policy import InitPolicyConfig, init_policy

    init_policy(args.out, InitPolicyConfig(steps=0) if args.random else InitPolicyConfig(), retrain=args.retrain,
                template=args.template)
    print(f"next: cleaner rollout rollout.policy={args.out} rollout.max_prompt_tokens=512")
    return 0


def _publish_catalog(cfg: CleanerConfig) -> None:
    """A stage run alone republishes the catalog file too (one warning if it cannot)."""
    from storage.catalog import publish_quietly

    publish_quietly(cfg.storage.root, cfg.storage.root / cfg.storage.catalog,
                    lambda message: print(f"cleaner: {message}", file=sys.stderr))


def cmd_gc(args: argparse.Namespace) -> int:
    from flows.gc_cmd import run_gc

    cfg = _config(args)
    return run_gc(cfg, args.run or cfg.flow.run_id, args.keep_last, args.keep or [], args.remove_partition or [],
                  args.dry_run)


def cmd_rollout(args: argparse.Namespace) -> int:
    from rollout_gen.stage import run_rollout_stage
    from storage.checkpoints import checkpoint_for
    from storage.layout import RunLayout
    from storage.shards import read_manifest

    cfg = _config(args)
    run_id = args.run or cfg.flow.run_id
    # the policy the run samples this iteration from, as in the flow (a rerun checks the shard was sampled by it)
    checkpoint = args.checkpoint or checkpoint_for(cfg.storage.root, run_id, args.iteration, cfg.rollout.policy)
    done = read_manifest(RunLayout(cfg.storage.root, run_id).raw_dir(args.iteration)) is not None
    if not done:  # the tokenizer, the weights and the sandbox take seconds before the first trajectory
        print(f"[rollout it {args.iteration}] loading {checkpoint} and starting the sandbox …", file=sys.stderr,
              flush=True)
    manifest = run_rollout_stage(cfg, run_id, args.iteration, checkpoint)
    _publish_catalog(cfg)
    print(f"raw shard: {manifest.rows} trajectories, mean reward {manifest.extra.get('mean_reward', float('nan')):.3f}"
          + (" — kept (already committed)" if done else ""))
    return 0


def cmd_purify(args: argparse.Namespace) -> int:
    from purifier.stage import run_purify_stage

    cfg = _config(args)
    print(f"[purify it {args.iteration}] modes {', '.join(args.mode or cfg.purify.modes)} on Beam "
          f"({cfg.purify.runner}) …", file=sys.stderr, flush=True)
    results = run_purify_stage(cfg, args.run or cfg.flow.run_id, args.iteration, args.mode, args.gamma,
                               is_thresholds=args.is_threshold)
    _publish_catalog(cfg)
    for r in results:
        state = "kept (already committed)" if r.skipped else "written"
        threshold = f"tau={r.gamma:g}" if r.mode in IS_MODES else f"gamma={r.gamma:g}"
        print(f"mode={r.mode} {threshold}: {r.rows} rows, {r.dead} dead letters — {state}")
    return 0


def cmd_replay(args: argparse.Namespace) -> int:
    from flows.replay_cmd import run_replay

    cfg = _config(args)
    code = run_replay(cfg, args.run or cfg.flow.run_id, args.iteration, args.gamma, args.mode, args.sweep,
                      args.is_threshold)
    _publish_catalog(cfg)
    return code


def cmd_update(args: argparse.Namespace) -> int:
    from flows.console import working
    from storage.checkpoints import DONE_MARKER
    from storage.layout import RunLayout

    cfg = _config(args)
    run_id = args.run or cfg.flow.run_id
    target = RunLayout(cfg.storage.root, run_id).checkpoint_dir(args.iteration + 1)
    done = (target / DONE_MARKER).is_file()
    if not done:  # a committed checkpoint is kept without loading the trainer (seconds of torch and OpenRLHF)
        with working(f"[update it {args.iteration}] loading the trainer (torch, OpenRLHF)"):
            from trainer.stage import run_update_stage
        target = run_update_stage(cfg, run_id, args.iteration)
    _publish_catalog(cfg)
    print(f"checkpoint: {target}" + (" — kept (already committed)" if done else ""))
    return 0


def cmd_filter(args: argparse.Namespace) -> int:
    from flows.filter_cmd import run_filter

    cfg = _config(args)
    run_id = args.run or cfg.flow.run_id
    n, seen = run_filter(cfg.storage.root, run_id, args.iterations, args.min_pass, args.max_pass, args.out)
    print(f"kept {n} of {seen} tasks of run {run_id} (pass rate strictly between {args.min_pass:g} and "
          f"{args.max_pass:g}); wrote {args.out}\nnext: cleaner train rollout.tasks={args.out}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
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

    from flows.inspect import columns_help  # the module loads DuckDB and Arrow only when inspect runs

    p = sub.add_parser(
        "inspect",
        help="summarise runs from the DuckDB catalog, or run SQL on its views",
        description="Views: raw_trajectories, raw_attempts, purified, splices, purify_compare, dead_letters, metrics, "
        "raw_kinds, trajectory_kinds, failed_call_advantage, off_policy. Every part is checked in full once "
        "(checksum, schema, rows) and then trusted while the file is unchanged; --verify checks all again.",
        epilog="Examples:\n  cleaner inspect\n  cleaner inspect --sql \"SELECT error_label, count(*) FROM raw_attempts "
        "GROUP BY 1\"\n  cleaner inspect --queries   # print example queries for duckdb\n\n" + columns_help() + "\n\n"
        + EPILOG_OVERRIDES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    _add_config_args(p)
    p.add_argument("--sql", help="run this SQL against the catalog and print the result")
    p.add_argument("--run", help="restrict the summary to one run id")
    p.add_argument("--queries", action="store_true", help="print example queries to try")
    p.add_argument("--all", action="store_true", help="summary tables of every iteration (default: each run's last 10)")
    p.add_argument("--wide", action="store_true", help=(
        "every column of the summary tables (default: those that fit 100 columns; a table wider than the terminal "
        "is printed whole, for `less -S`)"))
    p.add_argument("--verify", action="store_true", help=(
        "check every committed part in full (checksum, schema, rows) whatever the verification records say, "
        "name each bad file, and exit 1 if any is bad"))
    p.set_defaults(func=cmd_inspect)

    from flows.flow_commands import add_flow_commands  # prefect is imported only when a flow command runs

    add_flow_commands(sub, _add_config_args, EPILOG_OVERRIDES)

    p = sub.add_parser(
        "bootstrap", help="build the tool-use world's tokenizer, SFT corpus and tiny policy",
        description="Generate the SFT corpus (tool outputs from the real sandbox), train the byte-level BPE "
        "tokenizer and a tiny Qwen3 policy from scratch on CPU, and save it in HF format with PROVENANCE.json.",
        epilog="Example:\n  cleaner bootstrap --out /tmp/policy --steps 200 --corpus-size 500   # a quick one\n\n"
        + EPILOG_OVERRIDES, formatter_class=argparse.RawDescriptionHelpFormatter)
    _add_config_args(p)
    p.add_argument("--out", type=Path, help="output folder (default: rollout.policy)")
    p.add_argument("--steps", type=int, default=3500, help="SFT optimizer steps (batch 8)")
    p.add_argument("--corpus-size", type=int, default=12_000, help="number of transcripts")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=1, help="torch threads (1 is fastest on a shared 2-core box)")
    p.add_argument("--force", action="store_true", help="overwrite an existing policy")
    p.set_defaults(func=cmd_bootstrap)

    p = sub.add_parser(
        "init-policy", help="write a small Qwen3ForCausalLM with the real Qwen3 tokenizer (vocab 151,936)",
        description="A Qwen3-layout checkpoint (real tokenizer, <tool_call>=151657, <think> blocks, Qwen3's chat "
        "template) of small width, briefly SFT'd to emit tool calls; it runs through exactly the code a real "
        "Qwen3 checkpoint does (flows/init_policy.py).",
        epilog="Example:\n  cleaner init-policy --out /tmp/qwen3-tiny && cleaner rollout rollout.policy=/tmp/qwen3-tiny",
        formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, required=True, help="output folder (an HF checkpoint directory)")
    p.add_argument("--random", action="store_true", help="random weights (never emits a tool call)")
    p.add_argument("--retrain", action="store_true", help="rerun the SFT (minutes) instead of the committed weights")
    p.add_argument("--template", choices=TEMPLATE_FAMILIES, default="qwen3",
                   help="chat template family: qwen3 (Qwen3-4B, Instruct-2507's generation prompt) or thinking-2507 "
                   "(opens every assistant turn with <think>, as Qwen3-4B-Thinking-2507)")
    p.set_defaults(func=cmd_init_policy)

    from flows.eval_cmd import add_eval_command  # the rollout stack is imported only when eval runs

    add_eval_command(sub, _add_config_args, EPILOG_OVERRIDES)
    from flows.view_cmd import add_view_command  # the web stack is imported only when view runs

    add_view_command(sub, _add_config_args, EPILOG_OVERRIDES)

    p = sub.add_parser(
        "rollout", help="phase 1 alone: sample trajectories with retries and write a raw shard",
        description="Roll out rollout.tasks_per_iteration tasks x rollout.samples_per_prompt samples from a "
        "checkpoint and commit them as the iteration's raw shard (skipped if already committed).",
        epilog="Example:\n  cleaner rollout --run demo --iteration 0 rollout.samples_per_prompt=8\n\n" + EPILOG_OVERRIDES,
        formatter_class=argparse.RawDescriptionHelpFormatter)
    _add_config_args(p)
    p.add_argument("--run", help="run id (default: flow.run_id)")
    p.add_argument("--iteration", type=int, default=0)
    p.add_argument("--checkpoint", type=Path, help=(
        "policy checkpoint (default: the run's checkpoint of that iteration; rollout.policy for iteration 0)"))
    p.set_defaults(func=cmd_rollout)

    for name, help_text, example in (
        ("purify", "phase 2 alone: purify an iteration's raw shard into purified shards (Beam)",
         "cleaner purify --run demo --iteration 0 --mode saar raw --gamma 0.5"),
        ("replay", "re-purify stored raw shards under other γ / modes, never touching them, and compare",
         "cleaner replay --run demo --iteration 0 --gamma 0.3 0.5 0.7"),
    ):
        p = sub.add_parser(name, help=help_text, description=help_text + ". One partition per (mode, γ) is "
                           "written beside the others; committed partitions are kept. Beam runner: purify.runner "
                           "and purify.beam_options.",
                           epilog=f"Example:\n  {example}\n\n" + EPILOG_OVERRIDES,
                           formatter_class=argparse.RawDescriptionHelpFormatter)
        _add_config_args(p)
        p.add_argument("--run", help="run id (default: flow.run_id)")
        p.add_argument("--iteration", type=int, default=0)
        p.add_argument("--gamma", type=gamma_arg, nargs="+", help="γ values (default: purify.gammas / flow.replay_gammas)")
        p.add_argument("--mode", nargs="+", choices=MODES, help="modes (default: config)")
        p.add_argument("--is-threshold", type=is_threshold_arg, nargs="+", metavar="TAU", help=(
            "mode saar_is (Plan B): τ values, one partition each (default: purify.is_thresholds); with --sweep, "
            "also the importance-ratio histogram and the decisions per τ"))
        if name == "replay":
            p.add_argument("--sweep", action="store_true", help=(
                "γ 0.0–1.0 step 0.05 (or --gamma values) in memory, no partitions written: table, similarity "
                "histogram, example pairs around γ, PNG under runs/RUN/report/; measure: purify.similarity(_on); "
                "with --mode saar_is or --is-threshold: the importance-ratio histogram and decisions per τ"))
        p.set_defaults(func=cmd_purify if name == "purify" else cmd_replay)

    p = sub.add_parser(
        "gc", help="remove a run's old checkpoints and named replay partitions, keeping what it needs",
        description="Keeps the newest --keep-last checkpoints, those given with --keep, any checkpoint an update is "
        "still writing, every raw shard and the partition the run trains on; removes the other checkpoints and the "
        "purified/dead-letter partitions named with --remove-partition in every iteration. Each item goes in one "
        "rename (never half-removed); the catalog is republished. Replays of an iteration whose checkpoint was "
        "removed cannot recompute log-probs (keep it with --keep).",
        epilog="Examples:\n  cleaner gc --run demo --keep-last 2 --dry-run\n  cleaner gc --run demo --keep-last 3 "
        "--keep 10 --remove-partition mode=saar/gamma=0.30 mode=saar_is/tau=0.70\n\n" + EPILOG_OVERRIDES,
        formatter_class=argparse.RawDescriptionHelpFormatter)
    _add_config_args(p)
    p.add_argument("--run", help="run id (default: flow.run_id)")
    p.add_argument("--keep-last", type=int, default=2, help="newest committed checkpoints to keep (≥ 1; default 2)")
    p.add_argument("--keep", type=int, nargs="+", metavar="ITERATION", help="also keep these iterations' checkpoints")
    p.add_argument("--remove-partition", nargs="+", metavar="MODE/THRESHOLD",
                   help="replay partitions to remove from every iteration, as named under purified/ "
                   "(e.g. mode=saar/gamma=0.30); never the one the run trains on")
    p.add_argument("--dry-run", action="store_true", help="print what would be removed and change nothing")
    p.set_defaults(func=cmd_gc)

    p = sub.add_parser(
        "filter", help="a task file of the tasks whose logged pass rate is strictly between two bounds",
        description="Per task of a run, the share of its committed rollouts with a positive reward (from the raw "
        "shards, through the DuckDB catalog: uncommitted shards are never read); tasks with min-pass < pass rate "
        "< max-pass are written as a task file that rollout.tasks accepts. The defaults keep tasks neither "
        "always nor never solved.",
        epilog="Example:\n  cleaner filter --run demo --min-pass 0.1 --max-pass 0.9 --out tasks.parquet\n"
        "  cleaner train rollout.tasks=tasks.parquet flow.run_id=filtered\n\n" + EPILOG_OVERRIDES,
        formatter_class=argparse.RawDescriptionHelpFormatter)
    _add_config_args(p)
    p.add_argument("--run", help="run id (default: flow.run_id)")
    p.add_argument("--iterations", type=int, nargs="+", help="only these iterations (default: all committed)")
    p.add_argument("--min-pass", type=float, default=0.0, help="keep tasks whose pass rate is above this [0]")
    p.add_argument("--max-pass", type=float, default=1.0, help="keep tasks whose pass rate is below this [1]")
    p.add_argument("--out", type=Path, required=True, help="task file to write (Parquet)")
    p.set_defaults(func=cmd_filter)

    p = sub.add_parser(
        "update", help="phase 3 alone: one GRPO update over an iteration's purified shard (OpenRLHF)",
        description="Train checkpoint I on iteration I's purified partition (train.mode, train.gamma) with "
        "OpenRLHF's Actor and PolicyLoss and write checkpoint I+1 (never overwriting one that exists). An "
        "interrupted update resumes from its last finished mini-batch.",
        epilog="Example:\n  cleaner update --run demo --iteration 0 train.lr=5e-5 train.mini_batches=4\n\n"
        + EPILOG_OVERRIDES, formatter_class=argparse.RawDescriptionHelpFormatter)
    _add_config_args(p)
    p.add_argument("--run", help="run id (default: flow.run_id)")
    p.add_argument("--iteration", type=int, default=0)
    p.set_defaults(func=cmd_update)

    return parser


def main(argv: list[str] | None = None) -> int:
    from flows.console import command_prints_errors, quiet_libraries

    quiet_libraries()  # before torch, Beam or DeepSpeed are imported by a subcommand
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
    except Exception as e:  # noqa: BLE001 - user-facing failures get one line, bugs keep their traceback
        if os.environ.get("CLEANER_TRACEBACK"):
            raise
        if isinstance(e, CleanerError):
            message, code = str(e), e.exit_code
        elif isinstance(e, OSError):  # the environment's: a missing file, a full or read-only disk
            message, code = describe_os_error(e), 1
        else:
            raise
        print(f"cleaner {args.command}: {' '.join(message.split())}", file=sys.stderr)
        return code


if __name__ == "__main__":
    sys.exit(main())
