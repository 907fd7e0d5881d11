"""`cleaner gc`: keep a long run's store to what it needs (storage/retention.py decides and removes)."""
from __future__ import annotations

import json
import sys

from pipeline.config import CleanerConfig
from pipeline.modes import partition_gamma, partition_measure
from storage.layout import RunLayout
from storage.retention import empty_trash, plan, remove


def run_partitions(cfg: CleanerConfig, run_id: str) -> set[str]:
    """The partitions (mode=…/gamma=…) the run's own flow writes and trains on, from its frozen config
    (run.json): a resumed or continued run would purify them again, with checkpoints gc may have removed."""
    from pipeline.config import CleanerConfig as Config
    from pipeline.modes import IS_MODES, purify_measure

    layout = RunLayout(cfg.storage.root, run_id)
    if layout.run_json.is_file():
        frozen = json.loads(layout.run_json.read_text())
        cfg = Config.model_validate({**cfg.model_dump(mode="json"), **{k: v for k, v in frozen.items()
                                                                        if k in ("purify", "train", "rollout")}})
    p, t = cfg.purify, cfg.train
    measure = purify_measure(cfg.rollout.saar, p.similarity, p.similarity_on)
    wanted = {(m, v) for m in [*p.modes, t.mode] for v in (p.is_thresholds if m in IS_MODES else [*p.gammas, t.gamma])}
    out = set()
    for mode, value in wanted:
        folder = layout.purified_dir(0, mode, partition_gamma(mode, value), partition_measure(mode, measure))
        out.add(f"{folder.parent.name}/{folder.name}")
    return out


def run_gc(cfg: CleanerConfig, run_id: str, keep_last: int, keep: list[int], partitions: list[str],
           dry_run: bool) -> int:
    items = plan(cfg.storage.root, run_id, keep_last, tuple(keep), tuple(partitions),
                 run_partitions(cfg, run_id) if partitions else set())
    total = sum(i.bytes for i in items)
    verb = "would remove" if dry_run else "removing"
    for item in items:
        print(f"{verb} {item.what} {item.path} ({item.bytes / 2**20:.1f} MiB)")
    if not dry_run:
        empty_trash(cfg.storage.root)  # what a gc killed mid-way left
        for item in items:
            remove(cfg.storage.root, item)
        from storage.catalog import publish_quietly

        publish_quietly(cfg.storage.root, cfg.storage.root / cfg.storage.catalog,
                        lambda m: print(f"cleaner gc: {m}", file=sys.stderr))
    print(f"{'would free' if dry_run else 'freed'} {total / 2**20:.1f} MiB in {len(items)} item(s)"
          + (" (dry run: nothing changed)" if dry_run else ""))
    return 0
