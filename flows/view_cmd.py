"""`cleaner view`: a local web app over the storage root's committed shards (flows/viewer/): runs → iterations →
trajectory table → one trajectory with its purified variants aligned, the run's report, and a read-only SQL box.
The web stack is imported inside the command, so building the command line stays fast."""

from __future__ import annotations

import argparse

from flows.command import command_parser, config_of, port_type


def run(args: argparse.Namespace) -> int:
    from flows.stage_cmds import published
    from flows.viewer.serve import serve

    cfg = config_of(args)
    # a copied or moved store's catalog refuses to read (its views name the original's files): the index and run
    # pages were 503s there; published here, as `cleaner inspect` does (one warning where the root is read-only)
    if cfg.storage.root.is_dir():  # (a root that is not one is refused by serve, in its own words)
        published(cfg, "cleaner view")
    return serve(cfg.storage.root, cfg.storage.root / cfg.storage.catalog, host=args.host, port=args.port)


def add_parser(sub) -> None:
    p = command_parser(
        sub,
        "view",
        "browse runs, trajectories and their purified variants in a local web app",
        "Examples:\n  cleaner view\n  cleaner view --port 8800 -c configs/demo.yaml\n"
        "  cleaner view storage.root=workspace/experiments",
        "Serve a web app on 127.0.0.1 (prints the URL) over the storage root, reading only committed "
        "shards, so it works while a flow writes: runs, iterations, a trajectory table with filters (kind, error "
        "label, partition, spliced, reward, advantage sign, text), one trajectory's attempt tree beside every "
        "purified variant aligned at token level (kept, removed and inserted spans, loss mask, advantage, behaviour "
        "vs recomputed log-probs as colour), the run's report (`cleaner report`), and a SQL box on a read-only "
        "connection that cannot read files outside the storage root. Text is decoded with the run's own tokenizer.",
        func=run,
    )
    p.add_argument(
        "--host",
        default="127.0.0.1",
        help="address to listen on [127.0.0.1]; anything but a loopback address exposes every run to "
        "the network (a warning says so)",
    )
    p.add_argument("--port", type=port_type(free=True), default=8765, help="port [8765]; 0 picks a free one")
