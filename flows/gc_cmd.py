"""`cleaner gc`: keep a long run's store to what it needs (storage/retention.py decides and removes)."""

from __future__ import annotations

import argparse
import difflib
import json

from flows.command import command_parser, config_of
from flows.stage_cmds import published
from pipeline.config import RECORD, CleanerConfig, upgrade_frozen
from pipeline.modes import partition_threshold, partition_measure
from storage.layout import RunLayout
from storage.staging import clean_stale
from storage.retention import empty_trash, partitions_of, plan, remove


def run_partitions(cfg: CleanerConfig, run_id: str) -> set[str]:
    """The partitions (mode=…/gamma=…) the run's own flow writes and trains on, from its frozen config
    (run.json): a resumed or continued run would purify them again, with checkpoints gc may have removed."""
    from pipeline.modes import IS_MODES, live_measure

    layout = RunLayout(cfg.storage.root, run_id)
    if layout.run_json.is_file():
        frozen = upgrade_frozen(json.loads(layout.run_json.read_text()))
        cfg = CleanerConfig.model_validate(
            {**cfg.model_dump(mode="json"), **{k: v for k, v in frozen.items() if k in ("purify", "train", "rollout")}},
            context=RECORD,
        )
    p, t = cfg.purify, cfg.train
    measure = live_measure(cfg.rollout.saar)
    wanted = {
        (m, v)
        for m in [*p.modes, t.mode]
        for v in ([*p.is_thresholds, t.tau] if m in IS_MODES else [*p.gammas, t.gamma])
    }
    folders = (
        layout.purified_dir(0, mode, partition_threshold(mode, value), partition_measure(mode, measure))
        for mode, value in wanted
    )
    return {f"{folder.parent.name}/{folder.name}" for folder in folders}


def folder_of(name: str) -> str:
    """A --remove-partition name as the writer names the folder (gamma=0.5 is gamma=0.50: it was taken for a
    partition the run did not have, and gc went on with its other removals)."""
    from flows.interop.source import InteropError, parse_partition

    try:
        return parse_partition(name).path
    except InteropError:
        return name  # storage.retention.plan refuses it, naming the form


def run(args: argparse.Namespace) -> int:
    cfg = config_of(args)
    run_id, dry_run = args.run or cfg.flow.run_id, args.dry_run
    partitions = [folder_of(name) for name in args.remove_partition or []]
    items = plan(
        cfg.storage.root,
        run_id,
        args.keep_last,
        tuple(args.keep or []),
        tuple(partitions),
        run_partitions(cfg, run_id) if partitions else set(),
    )
    present = partitions_of(cfg.storage.root, run_id)
    for name in partitions:  # a typo, or removed by an earlier gc (a rerun): said, not an error
        if name not in present:
            close = difflib.get_close_matches(name, present, n=1)
            print(
                f"no iteration of run {run_id!r} has partition {name}"
                + (f" (did you mean {close[0]}?)" if close else "")
                + f" (its partitions: {', '.join(present) or 'none'}): nothing to remove for it"
            )
    total = sum(i.bytes for i in items)
    verb = "would remove" if dry_run else "removing"
    for item in items:
        print(f"{verb} {item.what} {item.path} ({item.bytes / 2**20:.1f} MiB)")
    if not dry_run:
        empty_trash(cfg.storage.root)  # what a gc killed mid-way left
        from purifier.stage import STAGING  # (imports Beam: not at the command line's start)

        for staging in RunLayout(cfg.storage.root, run_id).run_dir.glob(f"iteration=*/{STAGING}"):
            clean_stale(staging, "purify")  # a killed purify's; the next purify of that iteration would remove it
        for item in items:
            remove(cfg.storage.root, item)
        published(cfg, "cleaner gc")
    print(
        f"{'would free' if dry_run else 'freed'} {total / 2**20:.1f} MiB in {len(items)} item(s)"
        + (" (dry run: nothing changed)" if dry_run else "")
    )
    return 0


def add_parser(sub) -> None:
    p = command_parser(
        sub,
        "gc",
        "remove a run's old checkpoints and named replay partitions, keeping what it needs",
        "Examples:\n  cleaner gc --run demo --keep-last 2 --dry-run\n  cleaner gc --run demo --keep-last 3 "
        "--keep 10 --remove-partition mode=saar/gamma=0.30 mode=saar_is/tau=0.70",
        "Keeps the newest --keep-last checkpoints, those given with --keep, any checkpoint an update is still "
        "writing, every raw shard and the partition the run trains on; removes the other checkpoints and the "
        "purified/dead-letter partitions named with --remove-partition in every iteration. Each item goes in one "
        "rename (never half-removed); the catalog is republished. Replays of an iteration whose checkpoint was "
        "removed cannot recompute log-probs (keep it with --keep).",
        func=run,
    )
    p.add_argument("--run", help="run id (default: flow.run_id)")
    p.add_argument("--keep-last", type=int, default=2, help="newest committed checkpoints to keep (≥ 1; default 2)")
    p.add_argument("--keep", type=int, nargs="+", metavar="ITERATION", help="also keep these iterations' checkpoints")
    p.add_argument(
        "--remove-partition",
        nargs="+",
        metavar="MODE/THRESHOLD",
        help="replay partitions to remove from every iteration, as named under purified/ "
        "(e.g. mode=saar/gamma=0.30); never the one the run trains on",
    )
    p.add_argument("--dry-run", action="store_true", help="print what would be removed and change nothing")
