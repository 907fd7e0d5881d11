"""`cleaner import`: another framework's rollouts (ATIF trajectories, TRL completions, verl rollout dumps) as raw
shards of a run of their own, written by the project's own shard writer, so `inspect`, the viewer, `replay` and
`filter` work on them. Each iteration's shard is committed only once every line of every file has been read and
checked; a rerun with the same files and settings finds it committed and says so (idempotent), one with others is
refused. The formats and what is exact: docs/formats.md; the readers: flows/interop/importers.py.
"""

from __future__ import annotations

import argparse
import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from flows.command import command_parser, config_of

FORMATS = ("atif", "trl-completions", "verl-jsonl")


@dataclass
class Imported:
    rows: int = 0
    iterations: dict[int, str] = field(default_factory=dict)  # iteration -> "written" or "already imported"
    token_exact: bool = True
    past_max_positions: int = 0  # rows longer than their sampling checkpoint's max_position_embeddings
    max_positions: int = 0  # that limit (the smallest, when iterations differ)


def _digest(
    files: list[Path], fmt: str, run_id: str, tokenizer: Path | None, iteration: int | None, allow_purify: bool
) -> str:
    """What an import was made of: the files' bytes in order, the format, the tokenizer's, the settings."""
    h = hashlib.blake2b(digest_size=8)
    h.update(json.dumps([fmt, run_id, iteration, allow_purify]).encode())
    for f in files:
        h.update(hashlib.blake2b(Path(f).read_bytes(), digest_size=16).digest())
    if tokenizer is not None and (Path(tokenizer) / "tokenizer.json").is_file():
        h.update(hashlib.blake2b((Path(tokenizer) / "tokenizer.json").read_bytes(), digest_size=16).digest())
    return h.hexdigest()


def _check_row(row: dict[str, Any], where: str, arrow: bool = False, vocab: int | None = None) -> None:
    """A raw row is whole before it is written: a finite reward, an iteration, token ids within the vocabulary
    (`vocab`, when the sampling checkpoint is known) and never below 0, lists that go together of one length, and it
    converts to the data model (pipeline.trajectory) and (`arrow`) to the raw schema, which its batch is converted
    to anyway. What replay, purify and the viewer would otherwise crash on later is refused here."""
    import math

    import pyarrow as pa

    from flows.interop.source import InteropError
    from pipeline.trajectory import trajectory_from_row
    from storage.schemas import RAW

    reward = row.get("reward")
    if isinstance(reward, bool) or not isinstance(reward, (int, float)) or not math.isfinite(reward):
        raise InteropError(
            f"{where}: the reward is {'missing' if reward is None else repr(reward)}: a finite number is needed"
        )
    it = row.get("iteration")
    if isinstance(it, bool) or not isinstance(it, int) or it < 0:
        raise InteropError(f"{where}: the iteration is {it!r}: a whole number, 0 or more")
    turns = [a["turn_ids"] for p in row["positions"] for a in p["attempts"]]
    for name, ids in [("prompt_ids", row["prompt_ids"]), ("lived_ids", row["lived_ids"])] + [
        ("a turn's token ids", t) for t in turns
    ]:
        if ids and (min(ids) < 0 or (vocab is not None and max(ids) >= vocab)):
            bad = min(ids) if min(ids) < 0 else max(ids)
            raise InteropError(
                f"{where}: {name} hold id {bad}, outside the "
                + (f"{vocab:,} ids of the checkpoint that sampled them" if vocab is not None else "token ids (≥ 0)")
            )

    lived = {k: len(row[k]) for k in ("lived_ids", "lived_mask", "lived_logprobs")}
    if len(set(lived.values())) != 1:
        raise InteropError(f"{where}: lived_ids, lived_mask and lived_logprobs differ in length ({lived})")
    for p in row["positions"]:
        for a in p["attempts"] + ([row["final_turn"]] if row["final_turn"] else []):
            if len(a["turn_ids"]) != len(a["logprobs"]):
                raise InteropError(
                    f"{where}: position {p['position_idx']} attempt {a['attempt_idx']}: "
                    f"{len(a['turn_ids'])} token ids but {len(a['logprobs'])} log-probs"
                )
    try:
        trajectory_from_row(row)
        if arrow:
            pa.Table.from_pylist([row], schema=RAW)
    except (TypeError, KeyError, ValueError, pa.ArrowException) as e:
        raise InteropError(
            f"{where}: not a valid raw row ({type(e).__name__}: {' '.join(str(e).split())[:200]})"
        ) from None


def _rows(
    files: list[Path],
    fmt: str,
    run_id: str,
    *,
    chat,
    tokenizer: Path | None,
    iteration: int | None,
    root: Path,
):
    """(iteration, raw row, token-exact, where, the checkpoint it records as its sampler or None) per source line,
    in file order."""
    from flows.interop import atif as atif_format
    from flows.interop import importers
    from flows.interop.source import InteropError
    from rollout_gen.tasks import stable_id
    from storage.layout import resolve_recorded

    samples: dict[tuple[int, str], int] = {}
    trajectory_ids: dict[str, str] = {}  # another framework's ATIF trajectory_id -> where it was read
    verl_steps: dict[int, tuple[object, str]] = {}  # iteration -> (the verl training step of its rows, first read at)

    def next_sample(it: int, prompt_id: str) -> int:
        n = samples.get((it, prompt_id), 0)
        samples[(it, prompt_id)] = n + 1
        return n

    def need_chat(where: str):
        if chat is None:
            raise InteropError(
                f"{where}: {fmt} is text: name the tokenizer to re-tokenize it with (--tokenizer "
                "CHECKPOINT, e.g. the policy that sampled it)"
            )
        return chat

    for path in files:
        for where, doc in importers.documents(path):
            if fmt == "atif":
                traj, version = importers.validated_atif(doc, where)
                if atif_format.is_cleaner_raw(doc):
                    if chat is not None:
                        importers.check_tokenizer(doc, chat, tokenizer, where)
                    row = atif_format.raw_row(doc, run_id, where)
                    recorded = ((doc.get("agent") or {}).get("extra") or {}).get(atif_format.KEY, {}).get("checkpoint")
                    found = resolve_recorded(root, recorded) if isinstance(recorded, str) and recorded else None
                    if iteration is not None:
                        row["iteration"] = iteration
                    yield (
                        row["iteration"],
                        row,
                        atif_format.raw_is_token_exact(doc),
                        where,
                        found if found is not None and found.is_dir() else None,
                    )
                    continue
                if (traj.extra or {}).get(atif_format.KEY, {}).get("format") == atif_format.PURIFIED_FORMAT:
                    raise InteropError(
                        f"{where}: a purified trajectory (export's purified/); import the raw ones "
                        "(raw/*.jsonl): purified rows are rebuilt from them by `cleaner replay`"
                    )
                if version < atif_format.TOKEN_IDS_SINCE and chat is None:
                    need_chat(f"{where} (ATIF v{version[0]}.{version[1]}, before token ids)")
                if chat is not None:
                    importers.check_tokenizer(doc, chat, tokenizer, where)
                if traj.trajectory_id:
                    if traj.trajectory_id in trajectory_ids:
                        raise InteropError(
                            f"{where}: trajectory_id {traj.trajectory_id!r} was already read at "
                            f"{trajectory_ids[traj.trajectory_id]} (a file named twice, or one trajectory twice)"
                        )
                    trajectory_ids[traj.trajectory_id] = where
                prompt_ids, turns, exact, last = importers.atif_turns(traj, chat, where)
                users = [s.message for s in traj.steps if s.source == "user" and isinstance(s.message, str)]
                question = users[0] if users else ""
                if prompt_ids is None:
                    prompt_ids = importers.prompt_ids_of(need_chat(where), [{"role": "user", "content": question}])
                extra = traj.extra or {}
                source = str(extra.get("data_source") or traj.agent.name)
                prompt_id = stable_id(source, question)
                it = 0 if iteration is None else iteration
                row = importers.raw_row(
                    run_id=run_id,
                    iteration=it,
                    prompt_id=prompt_id,
                    sample_idx=next_sample(it, prompt_id),
                    policy_version=traj.agent.model_name or traj.agent.name,
                    source=source,
                    question=question,
                    ground_truth=str(extra.get("ground_truth") or ""),
                    reward=_reward(extra.get("reward"), where, "extra.reward"),
                    prompt_ids=list(prompt_ids),
                    turns=turns,
                    chat=chat,
                    final_text=last,
                )
                yield it, row, exact, where, None
                continue
            chat_ = need_chat(where)
            it = 0 if iteration is None else iteration
            if fmt == "trl-completions":
                if "prompt" not in doc or "completion" not in doc:
                    missing = "prompt" if "prompt" not in doc else "completion"
                    raise InteropError(f"{where}: no field {missing!r} (a TRL prompt-completion row has both)")
                question, prompt_messages = importers.question_of(doc["prompt"], where)
                completion = doc["completion"]
                if isinstance(completion, str):
                    importers.check_markup(completion, chat_, where, "completion")
                    completion = [{"role": "assistant", "content": completion}]
                if not isinstance(completion, list):
                    raise InteropError(
                        f"{where}: field 'completion' is a {type(completion).__name__}, expected text or messages"
                    )
                prompt_ids = importers.prompt_ids_of(chat_, prompt_messages)
                reward, truth = doc.get("reward"), doc.get("ground_truth", doc.get("answer", ""))
                source = str(doc.get("data_source") or "trl")
            else:
                for name in ("input", "output"):
                    if not isinstance(doc.get(name), str):
                        raise InteropError(
                            f"{where}: field {name!r} "
                            + ("is missing" if name not in doc else f"is a {type(doc[name]).__name__}, expected text")
                            + " (verl's rollout "
                            "dump has input, output, gts, score, step)"
                        )
                step = doc.get("step")
                first = verl_steps.setdefault(it, (step, where))
                if first[0] != step:  # one training step's rows were sampled by one policy
                    raise InteropError(
                        f"{where}: verl step {step!r}, but iteration {it}'s rows so far are step {first[0]!r} "
                        f"({first[1]}): rows of two training steps were sampled by two policies; import each step's "
                        "dump into its own --iteration"
                    )
                importers.check_markup(doc["output"], chat_, where)
                question = importers.rendered_question(doc["input"])
                completion = importers.split_rendered(doc["output"])
                prompt_ids = (
                    chat_.encode(importers.without_left_padding(doc["input"], chat_))
                    if importers.renders_special_tokens(doc["input"])
                    else importers.prompt_ids_of(chat_, [{"role": "user", "content": question}])
                )
                reward, truth = doc.get("score", doc.get("reward")), doc.get("gts", doc.get("ground_truth", ""))
                source = str(doc.get("data_source") or "verl")
            reward = _reward(reward, where, "'reward'" if fmt == "trl-completions" else "'score' (or 'reward')")
            if truth is None:  # verl's gts: null
                truth = ""
            turns, last = importers.text_turns(completion, chat_, where)
            prompt_id = stable_id(source, question)
            row = importers.raw_row(
                run_id=run_id,
                iteration=it,
                prompt_id=prompt_id,
                sample_idx=next_sample(it, prompt_id),
                policy_version="imported",
                source=source,
                question=question,
                ground_truth=truth if isinstance(truth, str) else json.dumps(truth),
                reward=reward,
                prompt_ids=prompt_ids,
                turns=turns,
                chat=chat_,
                final_text=last,
            )
            yield it, row, False, where, None


def _reward(value: object, where: str, field: str) -> float:
    """A row's reward as a number; a missing one is refused (stored as 0 it would be a reward the trajectory never
    had: one a GRPO group would rank it by)."""
    from flows.interop.source import InteropError

    if value is None:
        raise InteropError(f"{where}: no reward (field {field}): a trajectory is imported with the reward it had")
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        raise InteropError(f"{where}: field {field} is a {type(value).__name__}, expected a number")
    return float(value)


def run_import(
    cfg,
    files: list[Path],
    fmt: str,
    run_id: str,
    *,
    tokenizer: Path | None = None,
    iteration: int | None = None,
    allow_purify: bool = False,
    batch_rows: int = 16,
) -> Imported:
    """Write the raw shards; returns what was imported (or found already imported). Rows are held `batch_rows` per
    iteration at a time (as Python objects: ~3 MiB a row at 8,192 tokens), then written to the open part."""
    import pyarrow as pa

    from flows.interop.source import InteropError
    from pipeline.chat import load_chat
    from pipeline.engines.vllm_server import checkpoint_config, model_max_len
    from pipeline.trajectory import row_key
    from storage.errors import check_writable_root
    from storage.layout import RunLayout, record_path
    from storage.schemas import RAW
    from storage.shards import CommittedMeanwhile, ShardWriter, read_manifest

    if fmt not in FORMATS:
        raise InteropError(f"--format {fmt}: expected one of {', '.join(FORMATS)}")
    root = Path(cfg.storage.root)
    layout = RunLayout(root, run_id)
    files = [Path(f) for f in files]
    for n, f in enumerate(files):
        if not f.is_file():
            raise InteropError(f"{f}: " + ("is a folder, not a file" if f.is_dir() else "does not exist"))
        if any(f.resolve() == g.resolve() for g in files[:n]):  # its rows would be imported twice
            raise InteropError(f"{f}: named twice")
    check_writable_root(root)
    if layout.run_json.is_file() or (layout.run_dir / "checkpoints").is_dir():
        raise InteropError(
            f"run {run_id} under {root} is a training run (it has "
            f"{'run.json' if layout.run_json.is_file() else 'checkpoints'}): its iterations are its own rollouts; "
            "import into a new --run"
        )
    chat = load_chat(Path(tokenizer)) if tokenizer is not None else None
    config_hash = _digest(files, fmt, run_id, tokenizer, iteration, allow_purify)
    # per iteration, the checkpoint that sampled it (a raw shard records one): what cleaner ATIF names, else
    # --tokenizer; replay and purify recompute with it
    checkpoint_of: dict[int, Path | None] = {}
    vocab_of: dict[Path | None, int | None] = {}

    def vocab(checkpoint: Path | None) -> int | None:
        """The ids a row's checkpoint can read: its config's vocab_size, else its tokenizer's; None: not known."""
        if checkpoint not in vocab_of:
            config = (checkpoint_config(checkpoint) if checkpoint is not None else None) or {}
            size = config.get("vocab_size") if isinstance(config, dict) else None
            if not isinstance(size, int) or size <= 0:
                size = len(chat.tokenizer) if chat is not None else None
            vocab_of[checkpoint] = size
        return vocab_of[checkpoint]

    positions_of: dict[Path | None, int] = {}
    past: dict[int, int] = {}

    def max_positions(checkpoint: Path | None) -> int:
        if checkpoint not in positions_of:
            positions_of[checkpoint] = model_max_len(checkpoint) if checkpoint is not None else 0
        return positions_of[checkpoint]

    writers: dict[int, ShardWriter | None] = {}  # None: already imported with these files and settings
    pending: dict[int, list[tuple[dict[str, Any], str]]] = {}
    exact: dict[int, bool] = {}
    seen: dict[str, str] = {}
    versions: dict[int, set[str]] = {}
    done = Imported()

    def writer_for(it: int) -> ShardWriter | None:
        if it not in writers:
            out = layout.raw_dir(it)
            committed = read_manifest(out)
            if committed is not None and committed.config_hash != config_hash:
                made = committed.extra.get("source_format") or "a rollout"
                raise InteropError(
                    f"{out}: already holds a raw shard ({made}, config {committed.config_hash}) that "
                    "other files or settings made; import into a new --run (raw shards are never "
                    "overwritten)"
                )
            checkpoint = checkpoint_of.get(it)
            try:
                writers[it] = (
                    None
                    if committed is not None
                    else ShardWriter(
                        out,
                        RAW,
                        config_hash,
                        inputs=[record_path(root, checkpoint)] if checkpoint else [],
                        rows_per_part=cfg.storage.rows_per_part,
                        compression=cfg.storage.compression,
                    )
                )
            except CommittedMeanwhile:  # the same import, run twice at once: the other's shard is kept
                writers[it] = None
        return writers[it]

    def flush(it: int) -> None:
        w = writer_for(it)
        if w is not None and pending.get(it):
            try:
                table = pa.Table.from_pylist([row for row, _ in pending[it]], schema=RAW)
            except (pa.ArrowException, TypeError, ValueError):
                for row, where in pending[it]:  # the row at fault, named
                    _check_row(row, where, arrow=True)
                raise
            w.write(table)
        pending[it] = []

    try:
        for it, row, row_exact, where, sampler in _rows(
            files, fmt, run_id, chat=chat, tokenizer=tokenizer, iteration=iteration, root=root
        ):
            sampler = sampler or (Path(tokenizer) if tokenizer is not None else None)
            if it in checkpoint_of and checkpoint_of[it] != sampler:
                raise InteropError(
                    f"{where}: sampled by {sampler or 'an unnamed checkpoint'}, but iteration {it}'s earlier rows by "
                    f"{checkpoint_of[it] or 'an unnamed checkpoint'}: an iteration is sampled by one policy (import "
                    "each into its own --iteration)"
                )
            checkpoint_of[it] = sampler
            _check_row(row, where, vocab=vocab(sampler))
            limit = max_positions(sampler)
            if limit and len(row["prompt_ids"]) + len(row["lived_ids"] or []) > limit:
                past[it] = past.get(it, 0) + 1
                done.past_max_positions += 1
                done.max_positions = min(done.max_positions or limit, limit)
            key = row_key(row["run_id"], row["iteration"], row["prompt_id"], row["sample_idx"])
            if key in seen:
                raise InteropError(
                    f"{where}: trajectory {key} is already imported from {seen[key]} (a file named "
                    "twice, or two trajectories with one id)"
                )
            seen[key] = where
            exact[it] = exact.get(it, True) and row_exact
            versions.setdefault(it, set()).add(row["policy_version"])
            pending.setdefault(it, []).append((row, where))
            done.rows += 1
            if len(pending[it]) >= batch_rows:
                flush(it)
        if not done.rows:
            raise InteropError(f"{', '.join(map(str, files))}: no trajectory to import")
        for it in sorted(pending):
            flush(it)
            w = writers[it]
            if w is None:
                done.iterations[it] = "already imported"
                continue
            w.commit(
                {
                    "source_format": fmt,
                    "token_exact": exact[it],
                    "imported_from": [str(f.resolve()) for f in files],  # wherever the command ran
                    "purify_allowed": bool(allow_purify),
                    "policy_version": ", ".join(sorted(versions[it])),
                    "past_max_positions": past.get(it, 0),
                }
            )
            done.iterations[it] = "written"
        done.token_exact = all(exact.values())
    except BaseException:
        for w in writers.values():
            if w is not None and not w._committed:
                w.abort()
        raise
    return done


def run(args: argparse.Namespace) -> int:
    from flows.stage_cmds import published

    cfg = config_of(args)
    done = run_import(
        cfg,
        args.files,
        args.format,
        args.run,
        tokenizer=args.tokenizer,
        iteration=args.iteration,
        allow_purify=args.allow_purify,
    )
    what = ", ".join(f"iteration {i} {state}" for i, state in sorted(done.iterations.items()))
    exact = (
        "token-exact"
        if done.token_exact
        else (
            "re-tokenized (token_exact: false; purifying it is "
            + ("allowed" if args.allow_purify else "refused unless imported with --allow-purify")
            + ")"
        )
    )
    print(f"imported {done.rows} trajectories into run {args.run} ({what}); {exact}")
    if done.past_max_positions:
        from rollout_gen.stage import past_positions_note

        print(past_positions_note(done.past_max_positions, done.max_positions, rolled_out=False))
    if any(state == "written" for state in done.iterations.values()):
        published(cfg)
    return 0


def _iteration(text: str) -> int:
    try:
        n = int(text)
    except ValueError:
        n = -1
    if n < 0:
        raise argparse.ArgumentTypeError(f"invalid iteration {text!r}: a whole number, 0 or more")
    return n


def add_parser(sub) -> None:
    p = command_parser(
        sub,
        "import",
        "another framework's rollouts (ATIF, TRL completions, verl dumps) as raw shards of a new run",
        "Examples:\n  cleaner import --format atif out/raw/*.jsonl --run atif-copy\n"
        "  cleaner import --format verl-jsonl rollouts/0.jsonl --run from-verl --tokenizer policies/tiny-tool-policy",
        "Each trajectory becomes a raw row (a failed tool call followed by the model's next call is an in-context "
        "retry), committed with the project's raw writer, so inspect, view, replay and filter read the run. ATIF "
        "with token ids and log-probs (v1.3+; cleaner's own export exactly) keeps them; text sources (trl-completions,"
        " verl-jsonl) are re-tokenized with --tokenizer and marked token_exact: false in the manifest, and "
        "purifying them is refused unless --allow-purify (their token boundaries are not the sampled ones). A "
        "rerun with the same files is a no-op; docs/formats.md.",
        func=run,
        positionals=lambda p: p.add_argument(
            "files", nargs="+", type=Path, metavar="FILE", help=".jsonl (one object a line) or .json files"
        ),
    )
    p.add_argument("--format", required=True, choices=FORMATS, help="what the files are")
    p.add_argument("--run", required=True, help="the run to import into (its own: raw shards are never overwritten)")
    p.add_argument(
        "--tokenizer",
        type=Path,
        help="checkpoint folder whose tokenizer re-tokenizes text (required for "
        "text sources) or checks ATIF ids; recorded as the policy that sampled the rows",
    )
    p.add_argument(
        "--iteration",
        type=_iteration,
        help="iteration to import into (default: cleaner ATIF keeps its own, other sources 0)",
    )
    p.add_argument(
        "--allow-purify",
        action="store_true",
        help="let `cleaner purify`/`replay` purify a re-tokenized "
        "import (its token boundaries and log-probs are not the sampled ones)",
    )
