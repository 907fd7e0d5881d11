"""`cleaner replay`: re-purify an iteration's stored raw shard under other γ or modes (written as
partitions beside the others), or `--sweep` a γ grid in memory, and print what a person needs to choose
γ: decisions per γ against the lived ones and the reference measure's, tokens removed/recomputed, the
similarity histogram with the γ cuts, example pairs around each γ, and a PNG under the run's report/;
and whether to purify at all: the premise table (flows/premise.py) with the token-level hypothesis's prediction.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from flows.command import config_of
from flows.console import working
from flows.stage_cmds import check_thresholds, published, purify_parser
from pipeline.config import RECORD, CleanerConfig, SaarConfig
from pipeline.modes import IS_MODES, live_measure
from pipeline.similarity import REFERENCE_MEASURE


def lived_saar(run_json: Path, raw_extra: dict) -> SaarConfig | None:
    """The SAAR settings the run lived with: run.json's, else those its raw shard's manifest recorded; None when
    neither says (a run without run.json whose shard predates the record): the command line's are not the lived."""
    if run_json.is_file():
        saar = json.loads(run_json.read_text()).get("rollout", {}).get("saar", {})
    elif isinstance(raw_extra.get("saar"), dict):
        saar = raw_extra["saar"]
    else:
        return None
    return SaarConfig.model_validate({k: v for k, v in saar.items() if k in SaarConfig.model_fields}, context=RECORD)


def print_is_replay(
    console,
    raws,
    taus: list[float],
    decode,
    checkpoint: Path,
    cfg: CleanerConfig,
    histogram: bool,
    lived_tau: float | None = None,
) -> None:
    """saar_is (Plan B) at each τ: rollbacks replaced and appended, compared with the τ the run lived with (a run
    whose rollbacks were decided by importance ratio live), else with τ = 0.5; and the importance-ratio histogram."""
    from rich.table import Table

    from purifier.recompute import CPURecompute, SGLangRecompute, VLLMRecompute
    from purifier.replay import log_histogram_lines, replay_is

    console.print(f"scoring the rollbacks with {checkpoint} (purify.recompute={cfg.purify.recompute}) …")
    if cfg.purify.recompute == "sglang":
        backend = SGLangRecompute(cfg.rollout.sglang_url, cfg.rollout.temperature)
    elif cfg.purify.recompute == "vllm":
        from pipeline.engines.vllm import vllm_urls

        backend = VLLMRecompute(vllm_urls(cfg.rollout, checkpoint), checkpoint, cfg.rollout.temperature)
    else:
        backend = CPURecompute(checkpoint, cfg.rollout.temperature, device=cfg.purify.device)
    reference = lived_tau if lived_tau is not None else 0.5
    stats, log_ratios = replay_is(raws, taus, decode, backend.score, reference_tau=reference)
    table = Table(
        title=f"saar_is (Plan B): a retry replaces its failed turn when IS ≥ τ, else both stay; "
        f"{len(log_ratios)} importance ratios computed over the τ (each rollback in the context earlier decisions "
        "built, so one whose context differs between τ is scored in each)"
    )
    for col in (
        "τ",
        "rollbacks",
        "replaced",
        "appended",
        "tokens removed",
        f"≠ lived τ={reference:g}" if lived_tau is not None else f"≠ τ={reference:g}",
    ):
        table.add_column(col, justify="right")
    for s in stats:
        table.add_row(
            f"{s.tau:g}", *map(str, (s.rollbacks, s.replaced, s.appended, s.tokens_removed, s.differ_from_reference))
        )
    console.print(table)
    if histogram:
        console.print("importance ratio π(retry | without the failed turn) / π_b(retry | as sampled), per rollback:")
        for line in log_histogram_lines(log_ratios, taus):
            console.print(line, highlight=False)


def run_replay(
    cfg: CleanerConfig,
    run_id: str,
    iteration: int,
    *,
    gammas: list[float] | None = None,
    modes: list[str] | None = None,
    sweep: bool = False,
    taus: list[float] | None = None,
) -> int:
    """Replay iteration `iteration` of run `run_id`: partitions for the γ (`gammas`, default flow.replay_gammas) of the
    splicing modes and the τ (`taus`) of the importance-ratio modes among `modes` (default: implied by what is
    given), written beside the others, or with `sweep` a grid of γ in memory; then the tables."""
    from rich.console import Console
    from rich.table import Table

    from pipeline.chat import load_chat
    from pipeline.trajectory import trajectory_from_row
    from purifier.replay import (
        candidates,
        diff_window,
        examples_around,
        histogram_lines,
        plot,
        replay_stats,
        sweep_gammas,
        sweep_taus,
        with_retries,
    )
    from flows.stage_cmds import print_partitions
    from pipeline.variants import describe, implied_modes, plan_variants
    from purifier.stage import run_purify_stage
    from storage.errors import CheckpointError
    from storage.layout import RunLayout, resolve_recorded
    from storage.schemas import RAW
    from storage.shards import read_manifest, read_shard

    layout = RunLayout(cfg.storage.root, run_id)
    raw_manifest = read_manifest(layout.raw_dir(iteration))
    # (no raw shard: the purify stage, or the read below, says so in its words)
    sampled_by = resolve_recorded(cfg.storage.root, raw_manifest.inputs[0]) if raw_manifest is not None else None
    gone = sampled_by is not None and not sampled_by.is_dir()
    if gone and (layout.run_dir / "checkpoints").resolve() in sampled_by.resolve().parents:
        raise CheckpointError(
            f"{sampled_by}, the checkpoint that sampled iteration {iteration}, is gone (removed by "
            "`cleaner gc`?): replay needs its tokenizer, and its weights to recompute log-probs; "
            f"keep the checkpoints of iterations you will replay (`cleaner gc --keep {iteration}`)"
        )
    modes = modes or implied_modes(["saar"], gammas, taus)
    gammas = gammas or (sweep_gammas() if sweep else cfg.flow.replay_gammas)
    if not sweep:  # partitions for the asked γ / τ; a sweep stays in memory (21 partitions would be clutter)
        variants = plan_variants(cfg, modes, gammas, taus)
        with working(
            f"[replay {run_id} it {iteration}] purifying {describe(variants)} beside the committed "
            f"partitions on Beam ({cfg.purify.runner})"
        ):
            results = run_purify_stage(cfg, run_id, iteration, variants)
        print_partitions(results)
    with working(
        f"[replay {run_id} it {iteration}] reading the raw shard and the tokenizer of the policy that sampled it"
    ):
        raw_dir = layout.raw_dir(iteration)
        raws = [trajectory_from_row(r) for r in read_shard(raw_dir, RAW).to_pylist()]
        chat = load_chat(sampled_by or resolve_recorded(cfg.storage.root, read_manifest(raw_dir).inputs[0]))
    recorded = lived_saar(layout.run_json, raw_manifest.extra if raw_manifest is not None else {})
    known = recorded is not None
    saar = recorded or cfg.rollout.saar
    live, measure = live_measure(saar), live_measure(cfg.rollout.saar)  # as lived vs as replayed now
    # a run whose rollbacks were decided live by importance ratio lived no γ: its τ table compares with its τ
    by_importance = known and saar.rollback == "importance" and saar.live_mode == "purified"
    lived = (
        f"lived by importance ratio at τ_live={saar.is_threshold:g} (not by similarity: compare with the saar_is table)"
        if by_importance
        else f"lived with {live.key} at γ_live={saar.gamma_live:g}"
        if known
        else "lived settings unknown (no run.json, and the raw shard does not record them)"
    )
    console = Console(width=None if sys.stdout.isatty() else 220)  # pipes and logs get whole columns
    # the γ table when γ was asked for (or a splicing mode, or a sweep): τ alone printed it at flow.replay_gammas,
    # partitions nobody asked for
    if sweep or any(m not in IS_MODES for m in modes):
        with working(
            f"[replay {run_id} it {iteration}] deciding the splices of {len(with_retries(raws))} trajectories "
            f"at {len(gammas)} γ"
        ):
            stats = [replay_stats(raws, g, chat.decode, measure, live) for g in gammas]
        table = Table(
            title=f"replay of {run_id} iteration {iteration}: {len(raws)} raw trajectories, "
            f"{len(with_retries(raws))} with retries; measure {measure.key}, {lived}"
        )
        for col in (
            "γ",
            "positions",
            "shallow",
            "deep",
            "tokens removed",
            "tokens recomputed",
            "≠ lived",
            f"≠ {REFERENCE_MEASURE.key}",
        ):
            table.add_column(col, justify="right")
        for s in stats:
            table.add_row(
                f"{s.gamma:g}",
                *map(
                    str,
                    (
                        s.positions,
                        s.shallow,
                        s.deep,
                        s.tokens_removed,
                        s.tokens_recomputed,
                        s.differ_from_live if known and not by_importance else "–",
                        s.differ_from_reference,
                    ),
                ),
            )
        console.print(table)
        console.print(
            "positions: positions with a spliced retry; shallow + deep: the splices (a position retried more "
            "than once has one per retry); tokens recomputed: trained tokens whose context changed, so their "
            "old log-prob is recomputed; ≠ lived: splices decided otherwise than the rollout did ("
            + (
                "none: it decided by importance ratio"
                if by_importance
                else f"γ_live={saar.gamma_live:g}, {live.key}"
                if known
                else "unknown: the run did not record how it lived"
            )
            + f"); ≠ {REFERENCE_MEASURE.key}: otherwise than the reference measure "
            f"at the same γ",
            style="italic",
            highlight=False,
            markup=False,
        )
        if sweep:  # the γ histogram, examples and plot with the γ table, before any τ output
            cands = candidates(raws, chat.decode, measure, live)
            console.print(f"similarity ({measure.key}) of the {len(cands)} splice candidates as lived:")
            marks = sorted({0.3, 0.5, 0.7, 0.9, saar.gamma_live})
            for line in histogram_lines([c.similarity for c in cands], marks):
                console.print(line, highlight=False)
            for g in marks:
                for kind, c in examples_around(cands, g):
                    old, new = diff_window(c.old_call, c.new_call)
                    console.print(
                        f"γ={g:g} {kind:7s} sim={c.similarity:.3f} {c.key} pos {c.position_idx}\n"
                        f"    old: {old}\n    new: {new}",
                        highlight=False,
                        markup=False,
                    )
            png = plot(
                layout.run_dir / "report" / f"replay-iteration={iteration:04d}-{measure.key}.png",
                cands,
                stats,
                saar.gamma_live if known and not by_importance else None,  # no lived γ to draw or compare with
                f"{run_id} iteration {iteration} ({measure.key})",
            )
            print(f"plot: {png}")  # one line whatever the terminal width: a path to copy
    if taus or (sweep and any(m in IS_MODES for m in modes)) or by_importance:
        print_is_replay(
            console,
            raws,
            taus or (sweep_taus() if sweep else [saar.is_threshold]),
            chat.decode,
            sampled_by,
            cfg,
            histogram=sweep,
            lived_tau=saar.is_threshold if by_importance else None,
        )
    from flows.premise import print_premise
    from storage.catalog import Catalog

    with Catalog(cfg.storage.root) as cat:  # in memory: the partitions just written, nothing else touched
        print_premise(console, cat, run_id, iteration)
    return 0


def run(args: argparse.Namespace) -> int:
    cfg = config_of(args)
    check_thresholds(args.mode, args.gamma, args.is_threshold)
    code = run_replay(
        cfg,
        args.run or cfg.flow.run_id,
        args.iteration,
        gammas=args.gamma,
        modes=args.mode,
        sweep=args.sweep,
        taus=args.is_threshold,
    )
    published(cfg)
    return code


def add_parser(sub) -> None:
    p = purify_parser(
        sub,
        "replay",
        "re-purify stored raw shards under other γ / modes, never touching them, and compare",
        "cleaner replay --run demo --iteration 0 --gamma 0.3 0.5 0.7",
        run,
    )
    p.add_argument(
        "--sweep",
        action="store_true",
        help=(
            "γ 0.0–1.0 step 0.05 (or --gamma values) in memory, no partitions written: table, similarity "
            "histogram, example pairs around γ, PNG under runs/RUN/report/; measure: rollout.saar.similarity(_on); "
            "with --mode saar_is or --is-threshold: the importance-ratio histogram and decisions per τ"
        ),
    )
