"""`cleaner rollout`, `cleaner purify` and `cleaner update`: one stage of an iteration alone, as the
training flow (flows/training.py) runs it; a stage whose output is committed is kept. Each republishes the
catalog after it committed."""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Iterator

from flows.command import command_parser, config_of
from pipeline.config import CleanerConfig, check_gamma, check_is_threshold
from pipeline.modes import IS_MODES, MODES, SPLICING_MODES
from storage.errors import CleanerError

if TYPE_CHECKING:  # Beam loads with the purify stage, inside the command
    from purifier.stage import VariantResult


def checked(check: Callable[[float], float], symbol: str) -> Callable[[str], float]:
    """An argparse type: the number checked as the config checks it (γ, τ), refused in its own words."""

    def value(text: str) -> float:
        try:
            return check(float(text))
        except ValueError as e:
            raise argparse.ArgumentTypeError(f"invalid {symbol} {text!r}: {e}") from None

    return value


def stage_parser(sub, name: str, help: str, example: str, description: str, func: Callable) -> argparse.ArgumentParser:
    p = command_parser(sub, name, help, f"Example:\n  {example}", description, func=func)
    p.add_argument("--run", help="run id (default: flow.run_id)")
    p.add_argument("--iteration", type=_iteration, default=0, help="the iteration (0, 1, …) [0]")
    return p


def _iteration(text: str) -> int:
    if not text.isdigit():  # -1 looked for iteration=-001
        raise argparse.ArgumentTypeError(f"invalid iteration {text!r}: a whole number ≥ 0")
    return int(text)


def purify_parser(sub, name: str, help: str, example: str, func: Callable) -> argparse.ArgumentParser:
    """purify's and replay's: an iteration, γ values, modes and τ values."""
    p = stage_parser(
        sub,
        name,
        help,
        example,
        help + ". One partition per (mode, γ) is written beside the "
        "others; committed partitions are kept. Beam runner: purify.runner and purify.beam_options.",
        func,
    )
    p.add_argument(
        "--gamma",
        type=checked(check_gamma, "γ"),
        nargs="+",
        help=(f"γ values (default: {'purify.gammas' if name == 'purify' else 'flow.replay_gammas'})"),
    )
    p.add_argument("--mode", nargs="+", choices=MODES, help="modes (default: config)")
    p.add_argument(
        "--is-threshold",
        type=checked(check_is_threshold, "τ"),
        nargs="+",
        metavar="TAU",
        help=(
            "mode saar_is (Plan B): τ values, one partition each (default: purify.is_thresholds)"
            + (
                "; with --sweep, also the importance-ratio histogram and the decisions per τ"
                if name == "replay"
                else ""
            )
        ),
    )
    return p


class ThresholdError(CleanerError, ValueError):
    exit_code = 2  # like argparse's refusals: the command line is wrong


def check_thresholds(modes: list[str] | None, gammas: list[float] | None, taus: list[float] | None) -> None:
    """--gamma and --is-threshold given with --mode: each must apply to one of the modes (else a partition asked
    for would silently not be written)."""
    if not modes:
        return
    for values, option, kinds, what in (
        (gammas, "--gamma", SPLICING_MODES, "γ"),
        (taus, "--is-threshold", IS_MODES, "τ"),
    ):
        if values and not any(m in kinds for m in modes):
            raise ThresholdError(
                f"{option} sets the {what} of mode {' / '.join(kinds)}, and --mode {' '.join(modes)} "
                f"has none: add {kinds[0]} to --mode, or leave {option} out"
            )


@contextlib.contextmanager
def naming_other_settings(cfg: CleanerConfig, run_id: str) -> Iterator[None]:
    """A stage command refused because its output was committed "with other … settings (config hash A, now B)":
    the settings in which this command's config differs from the run's run.json, named (a command run without the
    run's -c file gave two hashes and nothing a user could act on)."""
    try:
        yield
    except CleanerError as e:
        if "config hash" not in str(e):
            raise
        from flows.run_config import config_diffs
        from storage.layout import RunLayout

        run_json = RunLayout(cfg.storage.root, run_id).run_json
        try:
            diffs = config_diffs(json.loads(run_json.read_text()), cfg.model_dump(mode="json"))
        except (OSError, ValueError, KeyError):
            raise e from None
        if not diffs:
            raise
        raise type(e)(
            f"{e}. This command's config differs from the run's ({run_json}): {'; '.join(diffs[:5])}; give the "
            "run's -c file and overrides"
        ) from None


def published(cfg: CleanerConfig, prefix: str = "cleaner") -> None:
    """A command that committed republishes the catalog file too (one warning on stderr if it cannot)."""
    from flows.run_config import publish_catalog

    publish_catalog(cfg, lambda message: print(f"{prefix}: {message}", file=sys.stderr))


def run_rollout(args: argparse.Namespace) -> int:
    from rollout_gen.stage import plan_rollout, run_rollout_plan

    cfg = config_of(args)
    # the flow's plan: the run's checkpoint of the iteration unless --checkpoint; a committed shard is checked
    with naming_other_settings(cfg, args.run or cfg.flow.run_id):
        plan = plan_rollout(cfg, args.run or cfg.flow.run_id, args.iteration, args.checkpoint)
    done = plan.kept is not None
    if not done:  # the tokenizer, the weights and the sandbox take seconds before the first trajectory
        print(
            f"[rollout it {args.iteration}] loading {plan.checkpoint} and starting the sandbox …",
            file=sys.stderr,
            flush=True,
        )
    manifest = run_rollout_plan(cfg, plan)
    published(cfg)
    too_long = manifest.extra.get("prompt_too_long", 0)
    past = manifest.extra.get("past_max_positions", 0)
    if past and not done:
        from pipeline.engines.vllm_server import model_max_len
        from rollout_gen.stage import past_positions_note

        print(f"[rollout it {args.iteration}] {past_positions_note(past, model_max_len(plan.checkpoint))}")
    print(
        f"raw shard: {manifest.rows} trajectories, mean reward {manifest.extra.get('mean_reward', float('nan')):.3f}"
        + (
            f"; {too_long} trajectories were not rolled out: their prompts are longer than rollout.max_prompt_tokens "
            f"({cfg.rollout.max_prompt_tokens})"
            if too_long
            else ""
        )
        + (" — kept (already committed)" if done else "")
    )
    return 0


def run_purify(args: argparse.Namespace) -> int:
    from pipeline.variants import describe, plan_variants
    from purifier.stage import run_purify_stage

    cfg = config_of(args)
    check_thresholds(args.mode, args.gamma, args.is_threshold)
    variants = plan_variants(cfg, args.mode, args.gamma, args.is_threshold)  # nothing asked: as the flow
    print(
        f"[purify it {args.iteration}] {describe(variants)} on Beam ({cfg.purify.runner}) …",
        file=sys.stderr,
        flush=True,
    )
    with naming_other_settings(cfg, args.run or cfg.flow.run_id):
        results = run_purify_stage(cfg, args.run or cfg.flow.run_id, args.iteration, variants)
    published(cfg)
    print_partitions(results)
    return 0


def print_partitions(results: list[VariantResult]) -> None:
    """One line per partition a purify stage ran: its rows and dead letters, written or kept."""
    for r in results:  # named as its folder is (a measure other than the default is part of it)
        state = "kept (already committed)" if r.skipped else "written"
        print(f"{r.variant.partition}: {r.rows} rows, {r.dead} dead letters — {state}")


def run_update(args: argparse.Namespace) -> int:
    from flows.console import working
    from trainer.stage import plan_update, run_update_plan

    cfg = config_of(args)
    with working(f"[update it {args.iteration}] loading the trainer (torch, OpenRLHF)"):
        with naming_other_settings(cfg, args.run or cfg.flow.run_id):
            plan = plan_update(cfg, args.run or cfg.flow.run_id, args.iteration)  # the flow's plan, gc'd ones too
    target = run_update_plan(cfg, plan)
    published(cfg)
    print(f"checkpoint: {target}" + (" — kept (already committed)" if plan.kept else ""))
    return 0


def add_parser(sub) -> None:
    p = stage_parser(
        sub,
        "rollout",
        "phase 1 alone: sample trajectories with retries and write a raw shard",
        "cleaner rollout --run demo --iteration 0 rollout.samples_per_prompt=8",
        "Roll out rollout.tasks_per_iteration tasks x rollout.samples_per_prompt samples from a "
        "checkpoint and commit them as the iteration's raw shard (skipped if already committed).",
        run_rollout,
    )
    p.add_argument(
        "--checkpoint",
        type=Path,
        help=("policy checkpoint (default: the run's checkpoint of that iteration; rollout.policy for iteration 0)"),
    )
    purify_parser(
        sub,
        "purify",
        "phase 2 alone: purify an iteration's raw shard into purified shards (Beam)",
        "cleaner purify --run demo --iteration 0 --mode saar raw --gamma 0.5",
        run_purify,
    )
    stage_parser(
        sub,
        "update",
        "phase 3 alone: one GRPO update over an iteration's purified shard (OpenRLHF)",
        "cleaner update --run demo --iteration 0 train.lr=5e-5 train.mini_batches=4",
        "Train checkpoint I on iteration I's purified partition (train.mode at train.gamma, or at "
        "train.tau for saar_is) with "
        "OpenRLHF's Actor and PolicyLoss and write checkpoint I+1 (never overwriting one that exists). "
        "An interrupted update resumes from its last finished mini-batch.",
        run_update,
    )
