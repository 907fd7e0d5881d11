"""`cleaner export`: a run's purified data (or its raw trajectories) in another framework's format, with a dataset
card: TRL's SFT layouts (pre-tokenized, token-exact; or conversational), ATIF trajectories, verl's RL prompt
Parquet. Rows are read and written a row group at a time (memory bounded by a batch, not a run), into a staging
folder renamed to --out at the end: --out is whole or absent. The formats: docs/formats.md; the pure core per
format: flows/interop/.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass, field
from pathlib import Path

from flows.command import command_parser, config_of

FORMATS = ("trl-sft", "trl-messages", "atif", "verl")


@dataclass
class Exported:
    rows: int = 0
    files: list[Path] = field(default_factory=list)
    bytes: int = 0


# what an SFT user must know of a GRPO partition's rows (a card note of both TRL exports)
EVERY_REWARD = (
    "Rows of every reward are here, failed answers included, as GRPO trains them with their advantage. Supervised "
    "fine-tuning imitates every row it is given: to imitate successes only, keep rows with reward > 0 "
    "(`ds.filter(lambda r: r['reward'] > 0)`)."
)


def default_partition(root: Path, run_id: str, cfg) -> str:
    """The partition the run's update trains on (run.json's train.mode and its threshold, else the config's)."""
    from pipeline.config import upgrade_frozen
    from pipeline.modes import IS_MODES, Variant
    from storage.layout import RunLayout

    train = {"mode": cfg.train.mode, "gamma": cfg.train.gamma, "tau": cfg.train.tau}
    run_json = RunLayout(root, run_id).run_json
    if run_json.is_file():
        frozen = upgrade_frozen(json.loads(run_json.read_text())).get("train", {})
        train.update({k: v for k, v in frozen.items() if k in train})
    return Variant.of(train["mode"], train["tau"] if train["mode"] in IS_MODES else train["gamma"]).partition


def _live_measure(root: Path, run_id: str, raw_manifest):
    """The similarity measure the rows' live splices were decided with: the raw manifest's record of rollout.saar,
    else run.json's, else the default one."""
    from pipeline.similarity import DEFAULT_MEASURE, Measure
    from storage.layout import RunLayout

    saar = raw_manifest.extra.get("saar")
    run_json = RunLayout(root, run_id).run_json
    if not isinstance(saar, dict) and run_json.is_file():
        saar = json.loads(run_json.read_text()).get("rollout", {}).get("saar", {})
    if not isinstance(saar, dict):
        return DEFAULT_MEASURE
    return Measure(saar.get("similarity", DEFAULT_MEASURE.similarity), saar.get("similarity_on", DEFAULT_MEASURE.on))


def _provenance(root: Path, sel, partition_text: str | None) -> dict[str, str]:
    versions = sorted({str(s.manifest.extra.get("policy_version", "unknown")) for s in sel.raw})
    checkpoints = sorted({s.manifest.inputs[0] for s in sel.raw if s.manifest.inputs})  # as the store records them
    out = {"run": sel.run_id, "iterations": ", ".join(str(s.iteration) for s in sel.raw)}
    if sel.partition is not None:
        out["partition"] = f"`{sel.partition.path}`: {sel.partition.describe()}"
    out["policy versions (weights' hash)"] = ", ".join(versions)
    out["sampled by"] = ", ".join(checkpoints) or "unknown"
    return out


def _questions(shard) -> dict[str, str]:
    """raw key -> question of a raw shard, its parts validated (once) and only those columns decoded."""
    import pyarrow.parquet as pq

    from pipeline.trajectory import row_key
    from storage.shards import check_part

    out = {}
    for part in shard.manifest.parts:
        check_part(shard.directory, part, shard.schema)
        t = pq.read_table(
            shard.directory / part.name, columns=["run_id", "iteration", "prompt_id", "sample_idx", "question"]
        )
        for r in t.to_pylist():
            out[row_key(r["run_id"], r["iteration"], r["prompt_id"], r["sample_idx"])] = r["question"]
    return out


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("cleaner")
    except PackageNotFoundError:  # a checkout on PYTHONPATH, not installed
        return "unknown"


def _parquet_export(sel, staging: Path, build, schema, batch_rows: int) -> Exported:
    import pyarrow.parquet as pq

    done = Exported()
    (staging / "data").mkdir()
    for raw, shard in zip(sel.raw, sel.purified):
        path = staging / "data" / f"iteration-{shard.iteration:04d}.parquet"
        with pq.ParquetWriter(str(path), schema, compression="zstd") as writer:
            for batch in shard.batches(batch_rows):
                rows = build(raw, batch)
                writer.write_table(rows)
                done.rows += rows.num_rows
        done.files.append(path)
    return done


def token_exact(manifest) -> bool:
    """Whether a raw shard holds the ids its policy sampled: not a re-tokenized import's (its manifest says so)."""
    return manifest.extra.get("token_exact") is not False


RETOKENIZED = (
    "no: the run was imported from text and re-tokenized (its ids are a tokenizer's encoding, not what a policy "
    "sampled; its log-probs are unknown, 0). Imported again, it stays `token_exact: false`."
)


def _atif_export(root: Path, sel, staging: Path, batch_rows: int) -> Exported:
    import atif

    from flows.interop import atif as atif_format
    from flows.interop.source import decoder_of, sampling_checkpoint
    from pipeline.trajectory import trajectory_from_row
    from purifier.saar import purify

    done = Exported()

    def write(path: Path, docs) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(path, "w") as f:
            for doc in docs:
                # the atif package's models check every document before it is written
                f.write(json.dumps(atif.Trajectory.model_validate(doc).to_json_dict()) + "\n")
                done.rows += 1
        done.files.append(path)

    purified = {s.iteration: s for s in sel.purified}
    for shard in sel.raw:
        checkpoint = sampling_checkpoint(root, shard.manifest)
        decode = decoder_of(checkpoint)
        # where the checkpoint is on this machine (an import elsewhere names its own with --tokenizer)
        where = (
            str(checkpoint.resolve())
            if checkpoint is not None and checkpoint.is_dir()
            else (shard.manifest.inputs[0] if shard.manifest.inputs else None)
        )
        agent = atif_format.agent_of(str(shard.manifest.extra.get("policy_version", "unknown")), where, _version())
        raw_file = Path("raw") / f"iteration-{shard.iteration:04d}.jsonl"
        measure = _live_measure(root, sel.run_id, shard.manifest)

        exact = token_exact(shard.manifest)

        def raw_docs(shard=shard, decode=decode, agent=agent, measure=measure, exact=exact):
            for batch in shard.batches(batch_rows):
                for row in batch.to_pylist():
                    splices = None
                    if decode is not None and any(len(p["attempts"]) > 1 for p in row["positions"]):
                        lived = purify(
                            trajectory_from_row(row), row["gamma_live"], "saar", lambda ids: decode([ids])[0], measure
                        )
                        splices = {
                            (s.position_idx, s.attempt_idx): {"splice_kind": s.kind, "similarity": s.similarity}
                            for s in lived.splices
                        }
                    yield atif_format.raw_trajectory(row, decode, agent, splices, exact)

        write(staging / raw_file, raw_docs())
        if shard.iteration in purified:
            part = purified[shard.iteration]
            questions = _questions(shard)

            def purified_docs(part=part, decode=decode, agent=agent, questions=questions, raw_file=raw_file):
                for batch in part.batches(batch_rows):
                    for row in batch.to_pylist():
                        yield atif_format.purified_trajectory(
                            row, questions[row["raw_key"]], decode, agent, sel.partition.path, raw_file.as_posix()
                        )

            write(staging / "purified" / sel.partition.path / f"iteration-{shard.iteration:04d}.jsonl", purified_docs())
    return done


def run_export(
    cfg,
    run_id: str | None,
    iterations: list[int] | None,
    partition: str | None,
    fmt: str,
    out: Path,
    *,
    tasks: Path | None = None,
    batch_rows: int | None = None,
) -> Exported:
    """Write the export into --out (staged, renamed at the end); returns what was written."""
    from flows.interop import dataset_card, trl
    from flows.interop.source import (
        BATCH_ROWS,
        ROWWISE_BATCH_ROWS,
        InteropError,
        check_out_dir,
        decoder_of,
        parse_partition,
        sampling_checkpoint,
        select,
        staged_output,
    )

    root = Path(cfg.storage.root)
    batch_rows = batch_rows or (BATCH_ROWS if fmt == "trl-sft" else ROWWISE_BATCH_ROWS)
    if fmt not in FORMATS:
        raise InteropError(f"--format {fmt}: expected one of {', '.join(FORMATS)}")
    check_out_dir(out)  # before reading anything: a folder in use is refused at once
    if fmt == "verl" and partition is not None:  # it exported the prompts as if --partition were not there
        raise InteropError("--partition is not read by --format verl: it exports the run's prompts, one row per task")
    if fmt == "verl":
        return _verl_export(cfg, run_id, iterations, tasks, out)
    if tasks is not None:
        raise InteropError("--tasks is read by --format verl only")
    if fmt in ("trl-sft", "trl-messages") and partition is None:
        partition = default_partition(root, run_id, cfg)
    sel = select(root, run_id, iterations, parse_partition(partition) if partition else None)
    provenance = _provenance(root, sel, partition)
    exact = all(token_exact(shard.manifest) for shard in sel.raw)
    with staged_output(out) as staging:
        if fmt == "atif":
            done = _atif_export(root, sel, staging, batch_rows)
            card = dataset_card.Card(
                title=f"cleaner run {sel.run_id}: ATIF trajectories",
                format="ATIF v1.8 (JSON Lines, one trajectory a line)",
                summary="One ATIF trajectory per raw row (raw/), each attempt and retry a step with its "
                "sampled token ids and log-probs"
                + (", and one per purified row (purified/), pointing at its raw trajectory" if sel.partition else "")
                + ". `cleaner import --format atif` reads them back exactly.",
                data_files={},
                columns={},
                provenance=provenance,
                token_exact=exact or RETOKENIZED,
                notes=[
                    "`datasets` cannot load ATIF documents as a table (their steps differ in shape): read each "
                    "line with `atif.Trajectory.model_validate_json`."
                ],
            )
        elif fmt == "trl-sft":
            done = _parquet_export(sel, staging, lambda raw, batch: trl.sft_table(batch), trl.SFT_SCHEMA, batch_rows)
            card = dataset_card.Card(
                title=f"cleaner run {sel.run_id}: purified trajectories for TRL SFT (pre-tokenized)",
                format="TRL SFT, pre-tokenized (input_ids + labels + completion_mask)",
                summary=(
                    "Each row is one purified trajectory: its prompt and response token ids as the policy sampled "
                    "and the partition trains them. TRL's SFTTrainer (whatever its completion_only_loss) and "
                    "transformers' Trainer train exactly the tokens whose label is not -100 (completion_mask 1)."
                ),
                data_files={"default": "data/*.parquet"},
                token_exact=exact or RETOKENIZED,
                columns={c: trl.COLUMN_DOCS[c] for c in trl.SFT_SCHEMA.names},
                provenance=provenance,
                notes=[EVERY_REWARD],
            )
        else:
            questions: dict[int, dict[str, str]] = {}  # the current iteration's only

            def build(raw, batch):
                if raw.iteration not in questions:
                    questions.clear()
                    questions[raw.iteration] = _questions(raw)
                return trl.messages_table(batch, questions[raw.iteration], decoders[raw.iteration])

            decoders = {}
            for raw in sel.raw:
                decoders[raw.iteration] = decoder_of(sampling_checkpoint(root, raw.manifest))
                if decoders[raw.iteration] is None:
                    raise InteropError(
                        f"{raw.directory}: the checkpoint that sampled it has no tokenizer.json, and "
                        "trl-messages is text; export trl-sft (token ids) instead"
                    )
            done = _parquet_export(sel, staging, build, trl.MESSAGES_SCHEMA, batch_rows)
            card = dataset_card.Card(
                title=f"cleaner run {sel.run_id}: purified trajectories for TRL SFT (conversational)",
                format="TRL SFT, conversational (messages + tools)",
                summary=(
                    "Each row is one purified trajectory as a conversation: the question, each assistant turn with "
                    "its tool call, each tool response. A trainer renders and tokenizes it with its own template."
                ),
                data_files={"default": "data/*.parquet"},
                token_exact=False,
                columns={c: trl.COLUMN_DOCS[c] for c in trl.MESSAGES_SCHEMA.names},
                provenance=provenance,
                notes=[
                    "A turn the partition masks (mask_failed) is an assistant message like any other: the "
                    "per-token loss mask is kept only by trl-sft.",
                    "A trainer renders the messages with its own chat template: one that ignores `tool_calls` "
                    "drops every call (`trl.chat_template_utils.supports_tool_calling(tokenizer)` says whether "
                    "yours renders them; Qwen3's does).",
                    EVERY_REWARD,
                ],
            )
        (staging / "README.md").write_text(card.render())
    done.files = [out / f.relative_to(staging) for f in done.files] + [out / "README.md"]
    done.bytes = sum(f.stat().st_size for f in done.files)
    return done


def _verl_export(cfg, run_id: str | None, iterations: list[int] | None, tasks: Path | None, out: Path) -> Exported:
    import pyarrow.parquet as pq

    from flows.interop import dataset_card, verl
    from flows.interop.source import staged_output

    if tasks is not None:
        from rollout_gen.tasks import load_task_parquet

        task_rows = load_task_parquet(tasks)  # a file that is not a task file: one line, before anything is read
        extra = {}
        names = pq.read_schema(tasks).names
        if "pass_rate" in names:  # `cleaner filter`'s task file: keep what the filter saw
            for r in pq.read_table(
                tasks, columns=[c for c in ("prompt", "pass_rate", "rollouts") if c in names]
            ).to_pylist():
                users = [m["content"] for m in r["prompt"] or [] if m.get("role") == "user"]
                if users:
                    extra[users[-1]] = {"pass_rate": r.get("pass_rate"), "rollouts": r.get("rollouts")}
        rows = [
            verl.PromptRow(
                prompt_id=t.prompt_id,
                data_source=t.source,
                question=t.question,
                ground_truth=t.ground_truth,
                ability=t.kind,
                **extra.get(t.question, {}),
            )
            for t in task_rows
        ]
        provenance = {"task file": str(tasks)}
    else:
        from flows.filter_cmd import pass_rates
        from rollout_gen.tasks import code_tests_problem

        rows = [
            verl.PromptRow(
                prompt_id=r["prompt_id"],
                data_source=r["data_source"],
                question=r["question"],
                ground_truth=r["ground_truth"],
                ability="code" if code_tests_problem(r["ground_truth"]) == "" else "math",
                pass_rate=r["pass_rate"],
                rollouts=r["rollouts"],
            )
            for r in pass_rates(Path(cfg.storage.root), run_id, iterations)
        ]
        provenance = {
            "run": run_id,
            "iterations": "all committed" if iterations is None else ", ".join(map(str, iterations)),
        }
    with staged_output(out) as staging:
        (staging / "data").mkdir()
        import yaml

        pq.write_table(verl.table(rows), staging / "data" / "train.parquet", compression="zstd")
        (staging / "tool_config.yaml").write_text(yaml.safe_dump(verl.tool_config(), sort_keys=False))
        card = dataset_card.Card(
            title="RL prompts for verl" + (f" from cleaner run {run_id}" if tasks is None else ""),
            format="verl RL prompt Parquet",
            summary=(
                "One row per task, as verl's data preprocessing writes them for its tool agent loop: "
                "point `data.train_files` at data/train.parquet, and the multi-turn rollout at the code tool "
                "(`data.return_raw_chat=True actor_rollout_ref.rollout.multi_turn.enable=True "
                "actor_rollout_ref.rollout.multi_turn.tool_config_path=tool_config.yaml`; the tool runs on verl's "
                f"Sandbox Fusion tool, whose `sandbox_fusion_url` there is a local server's, {verl.SANDBOX_URL}: "
                "set yours). Each prompt is cleaner's system prompt and the question; the tool's schema is the one "
                "cleaner's rollouts show the model. verl's default reward picks a scorer by "
                "`data_source` and knows only its own benchmarks' names: for other sources (cleaner's world, your "
                "own tasks) give it one with `custom_reward_function.path` that reads `reward_model.ground_truth`."
            ),
            data_files={"default": "data/*.parquet"},
            columns=verl.COLUMN_DOCS,
            provenance=provenance,
            token_exact=None,
        )
        (staging / "README.md").write_text(card.render())
    files = [out / "data" / "train.parquet", out / "tool_config.yaml", out / "README.md"]
    return Exported(len(rows), files, sum(f.stat().st_size for f in files))


def run(args: argparse.Namespace) -> int:
    cfg = config_of(args)
    run_id = args.run or cfg.flow.run_id
    done = run_export(
        cfg,
        run_id,
        iterations=args.iteration,
        partition=args.partition,
        fmt=args.format,
        out=args.out,
        tasks=args.tasks,
    )
    print(
        f"exported {done.rows} rows"
        + ("" if args.format == "verl" and args.tasks else f" of run {run_id}")
        + f" as {args.format} to {args.out} ({len(done.files)} files, {done.bytes / 2**20:.1f} MiB)"
    )
    return 0


def add_parser(sub) -> None:
    p = command_parser(
        sub,
        "export",
        "a run's purified data (or raw trajectories) as TRL SFT, ATIF or verl data with a dataset card",
        "Examples:\n  cleaner export --run demo --partition mode=saar/gamma=0.50 --format trl-sft --out sft/\n"
        "  cleaner export --run demo --iteration 3 --format atif --out atif/\n"
        "  cleaner filter --run demo --out tasks.parquet && cleaner export --format verl --tasks tasks.parquet "
        "--out verl/",
        "Formats: trl-sft (input_ids + labels + completion_mask, token-exact: TRL trains exactly the partition's loss "
        "mask), "
        "trl-messages (messages with tool calls, tool messages and the tools' JSON schema; text), atif (one ATIF "
        "trajectory per raw row, and per purified row with --partition; token ids and log-probs in step metrics; "
        "`cleaner import --format atif` reads it back exactly), verl (RL prompt Parquet from --tasks FILE, e.g. "
        "`cleaner filter`'s, or from the run's tasks with their pass rates). Beside the data, README.md: a dataset "
        "card whose configs let datasets.load_dataset(OUT) read the Parquet formats offline. --out must be new or "
        "empty; it is written whole or not at all. docs/formats.md says what each format keeps and loses.",
        func=run,
    )
    p.add_argument("--run", help="run id (default: flow.run_id)")
    p.add_argument("--iteration", type=int, nargs="+", help="only these iterations (default: every committed one)")
    p.add_argument(
        "--partition",
        help="purified partition, e.g. mode=saar/gamma=0.50 (trl formats: default the "
        "partition train.mode/train.gamma trains on; atif: also export the purified trajectories)",
    )
    p.add_argument("--format", required=True, choices=FORMATS, help="what to write")
    p.add_argument("--out", type=Path, required=True, help="folder to write (new or empty)")
    p.add_argument(
        "--tasks",
        type=Path,
        help="--format verl: a task file (cleaner filter's, or any rollout.tasks layout) instead of the run's tasks",
    )
