"""Phase 2 as a stage: one iteration's raw shard → one purified partition per variant (pipeline.modes.Variant), as
plan (`plan_purify`) → purify on Beam into a staging area → commit each partition.

Partitions already committed from the same inputs are kept, so a rerun after a crash redoes only what is missing, and
a replay under a new γ never touches the raw shard or the partitions beside it.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Callable

import pyarrow.parquet as pq

from pipeline.config import PURIFY_MODE_SETTINGS, PURIFY_REPLAY_SETTINGS, CleanerConfig, roc_group_size
from storage.errors import CleanerError, os_error
from purifier import beam_pipeline
from purifier.commit import sorted_chunks
from pipeline.modes import Variant
from pipeline.variants import plan_variants
from storage.layout import RunLayout, missing_run, record_path, resolve_recorded
from storage.schemas import DEAD_LETTER, PURIFIED, RAW
from storage.checkpoints import check_checkpoint
from storage.identity import StageIdentity, check_committed, stage_identity
from storage.shards import (
    CommittedMeanwhile,
    Manifest,
    ShardError,
    ShardMissing,
    ShardWriter,
    committed_manifest,
    is_committed,
    read_manifest,
    write_shard,
)
from storage.staging import staging_area

STAGING = ".staging"


class DeadLetterOverflow(CleanerError, RuntimeError):
    """More raw rows than allowed could not be purified; nothing was committed for that variant."""


class StagingMismatch(CleanerError, RuntimeError):
    """The staged files hold other row counts than the pipeline produced; nothing was committed."""


class DaskRunFailed(CleanerError, RuntimeError):
    """The Dask cluster could not be reached or lost the run (workers gone); nothing was committed."""


@dataclass
class VariantResult:
    variant: Variant
    rows: int
    dead: int
    skipped: bool

    @property
    def mode(self) -> str:
        return self.variant.mode

    @property
    def threshold(self) -> float:
        """What names the partition: γ (splicing modes), τ (importance-ratio modes), else 0."""
        return self.variant.threshold


def purify_identity(cfg: CleanerConfig, variant: Variant, raw_hash: str) -> StageIdentity:
    """What a partition holds depends on: the purify settings (not those that choose where or which partitions are
    written: PURIFY_REPLAY_SETTINGS), the sampling temperature, the variant (its partition path), the settings of its
    mode alone (PURIFY_MODE_SETTINGS: no other mode's partitions change with them) and the raw shard's identity."""

    def record(c: CleanerConfig) -> dict:
        settings = c.purify.model_dump(mode="json", exclude=PURIFY_REPLAY_SETTINGS | PURIFY_MODE_SETTINGS)
        mode_settings = {"roc_group_size": roc_group_size(c)} if variant.mode == "roc" else {}
        return {
            "purify": settings,
            "temperature": c.rollout.temperature,
            "variant": variant.partition,
            "mode_settings": mode_settings,
            "raw": raw_hash,
        }

    return stage_identity(cfg, record)


def _check_staged(staging: Path, variant: Variant, kind: str, counters: dict[str, int], rows: int) -> None:
    """The rows the pipeline wrote for one variant and kind checked against its own count of them (a file sink
    that lost a file would otherwise look like fewer rows)."""
    expected = counters.get(beam_pipeline.row_counter(variant, kind), 0)
    if rows != expected:
        raise StagingMismatch(
            f"{staging}: {rows} staged rows for {beam_pipeline.destination(variant, kind)}, but "
            f"the pipeline produced {expected}; nothing was committed"
        )


def _partition_dirs(layout: RunLayout, iteration: int, variant: Variant) -> tuple[Path, Path]:
    """A variant's purified partition and its dead letters."""
    where = (iteration, variant.mode, variant.threshold, variant.measure_key)
    return layout.purified_dir(*where), layout.dead_letter_dir(*where)


def _in_chain(e: BaseException | None, match: Callable[[BaseException], bool]) -> BaseException | None:
    """The first exception of `e`'s chain that `match`es: Beam re-raises a DoFn's failure as another type,
    keeping the chain."""
    seen = set()
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        if match(e):
            return e
        e = e.__cause__ or e.__context__
    return None


class UnknownRunner(CleanerError, ValueError):
    exit_code = 2  # a setting, as a config error is


def _known_runner(name: str) -> str:
    """`name` when Beam knows it (its name, with or without 'Runner', any case, or a dotted class path)."""
    from apache_beam.options.pipeline_options import StandardOptions

    known = {path.rsplit(".", 1)[-1].lower(): path.rsplit(".", 1)[-1] for path in StandardOptions.ALL_KNOWN_RUNNERS}
    if "." in name or name.lower() in known or name.lower() + "runner" in known:
        return name
    raise UnknownRunner(
        f"purify.runner={name}: Beam knows no such runner; use dask (Beam's DaskRunner on a Dask "
        f"cluster) or one of {', '.join(sorted(known.values()))}"
    )


def beam_runner(cfg: CleanerConfig) -> tuple[str, list[str]]:
    """The Beam runner and options of `purify.runner`: "dask" is Beam's DaskRunner on the scheduler at
    purify.dask_address (None: the local cluster of `cleaner cluster start` for this storage root)."""
    p = cfg.purify
    if p.runner.lower() not in ("dask", "daskrunner"):
        return _known_runner(p.runner), list(p.beam_options)
    from purifier.dask_cluster import cluster_dir, running_address

    address = p.dask_address or running_address(cluster_dir(cfg.storage.root))
    options = [f"--dask_client_address={address}", "--dask_connection_timeout=10"]
    if not any(o.startswith(("--dask_npartitions", "--dask_partition_size")) for o in p.beam_options):
        # one raw part per Dask partition: the parts are what the read and the purify steps run in parallel
        options.append("--dask_partition_size=1")
    return beam_pipeline.DASK_RUNNER, [*options, *p.beam_options]


def check_runner(cfg: CleanerConfig) -> None:
    """purify.runner can run, checked before a flow's first rollout: a runner Beam does not know, purify.runner=dask
    with no local cluster, or a purify.dask_address nobody answers at were found only at the first purify, after
    minutes of rollout. One line each (the address is only dialled: Dask's own handshake comes at the purify)."""
    import socket
    from urllib.parse import urlsplit

    from purifier.dask_cluster import ClusterError

    runner, options = beam_runner(cfg)
    if runner != beam_pipeline.DASK_RUNNER or not cfg.purify.dask_address:
        return
    where = urlsplit(
        cfg.purify.dask_address if "://" in cfg.purify.dask_address else f"tcp://{cfg.purify.dask_address}"
    )
    try:
        with socket.create_connection((where.hostname, where.port or 8786), timeout=3):
            pass
    except (OSError, ValueError) as e:
        raise ClusterError(
            f"purify.dask_address={cfg.purify.dask_address}: no Dask scheduler answers there "
            f"({getattr(e, 'strerror', None) or e}); start it, or check the address"
        ) from None


def _vllm_urls(cfg: CleanerConfig, checkpoint: Path) -> list[str]:
    """purify.recompute=vllm: the rollout's vLLM servers (started here, in the driver, when cleaner runs them), so
    every Beam worker scores on the same ones."""
    if cfg.purify.recompute != "vllm":
        return []
    from pipeline.engines.vllm import vllm_urls

    return vllm_urls(cfg.rollout, checkpoint)


def _is_dask_failure(e: BaseException) -> bool:
    """The cluster's own failure (a worker lost too often, the scheduler gone or not answering), as opposed to
    an error raised by the pipeline's code, which keeps its traceback."""
    return (
        type(e).__module__.split(".")[0] == "distributed"
        or isinstance(e, (beam_pipeline.RunLost, TimeoutError, ConnectionError))
        or (type(e) is OSError and e.errno is None)
    )


def _run_pipeline(job: beam_pipeline.PurifyJob) -> dict[str, int]:
    staging, runner, options = Path(job.staging), job.runner, job.beam_options
    try:
        return beam_pipeline.run(job)
    except Exception as e:  # noqa: BLE001 - only environment failures are translated; the rest propagate
        lost = _in_chain(e, _is_dask_failure) if runner == beam_pipeline.DASK_RUNNER else None
        if lost is not None:
            address = next((o.split("=", 1)[1] for o in options if o.startswith("--dask_client_address=")), "?")
            what = " ".join(str(lost).split()) or "no details"
            raise DaskRunFailed(
                f"purification on the Dask cluster at {address} failed ({type(lost).__name__}: "
                f"{what[:300]}); nothing was committed; check `cleaner cluster status` and the "
                "workers' logs, then rerun"
            ) from None
        if isinstance(e, CleanerError):
            raise
        if _in_chain(e, lambda c: isinstance(c, KeyboardInterrupt) or str(c).startswith("KeyboardInterrupt [while")):
            # Ctrl-C reached Beam's worker: its runner re-raises it as RuntimeError('KeyboardInterrupt [while
            # running ...]'); it is the user's Ctrl-C (nothing is committed: the staging is cleaned on the rerun)
            raise KeyboardInterrupt from None
        cause = _in_chain(e, lambda c: isinstance(c, OSError) and c.errno is not None)  # the OSError behind it
        if cause is None:
            raise
        raise os_error(cause, f"purification staging in {staging}") from None


@dataclass(frozen=True)
class PurifyPlan:
    """A purification of one iteration, decided before Beam starts: the partitions kept as committed, and the
    variants to purify from the raw shard (each with the identity its partitions will record), on which runner."""

    layout: RunLayout
    iteration: int
    raw: Manifest
    checkpoint: Path  # the policy that sampled the raw shard: tokenizer and recompute
    kept: tuple[VariantResult, ...]
    todo: tuple[tuple[Variant, str], ...]
    runner: str = ""
    runner_options: tuple[str, ...] = ()

    @property
    def raw_dir(self) -> Path:
        return self.layout.raw_dir(self.iteration)

    @property
    def staging_root(self) -> Path:
        return self.layout.iteration_dir(self.iteration) / STAGING


def _purifiable_raw(layout: RunLayout, iteration: int) -> Manifest:
    """The iteration's committed raw shard (schema version, no stray parts; its parts are checked in Beam)."""
    raw_dir = layout.raw_dir(iteration)
    if read_manifest(raw_dir) is None:
        missing = missing_run(layout.root, layout.run_id)  # a mistyped run or root: not a rollout to run first
        if missing:
            raise ShardMissing(missing)
        raise ShardMissing(f"{raw_dir}: no committed raw shard for iteration {iteration} (run the rollout first)")
    raw = committed_manifest(raw_dir, RAW)
    if raw.extra.get("token_exact") is False and not raw.extra.get("purify_allowed"):
        # an import re-tokenized from text (flows/import_cmd.py): its boundaries and log-probs are not the sampled ones
        raise ShardError(
            f"{raw_dir}: imported from {raw.extra.get('source_format', 'text')} and re-tokenized "
            "(token_exact: false in its manifest): its token boundaries are not the sampled ones, so it "
            "is not purified for training; import it again into a new run with `cleaner import "
            "--allow-purify` to purify it anyway"
        )
    return raw


def _committed_partition(
    layout: RunLayout, iteration: int, variant: Variant, identity: StageIdentity
) -> Manifest | None:
    """A variant's partition committed from the same inputs (None: not committed yet)."""
    out, dead = _partition_dirs(layout, iteration, variant)
    done = read_manifest(out)
    if done is not None:
        check_committed(
            out,
            done.config_hash,
            identity,
            made_with="with other purify settings",
            remedy=f"to purify it again remove {out} and {dead}, then run `cleaner purify --run "
            f"{layout.run_id} --iteration {iteration}`, or use a new flow.run_id",
        )
    return done


def _ready_to_purify(cfg: CleanerConfig, plan: PurifyPlan) -> PurifyPlan:
    """What purifying needs, before anything is written: a runner Beam knows (and a local Dask cluster for dask), a
    whole checkpoint for a recompute, the device of a recompute that runs in this process."""
    runner, options = beam_runner(cfg)
    if cfg.purify.recompute in ("cpu", "vllm"):
        check_checkpoint(plan.checkpoint)  # a truncated checkpoint: one line here, not a traceback in a Beam worker
    if cfg.purify.recompute == "cpu" and runner.lower() in ("fnapirunner", "directrunner"):
        from pipeline.devices import resolve_device

        resolve_device(cfg.purify.device, "purify.device")
    return replace(plan, runner=runner, runner_options=tuple(options))


def plan_purify(
    cfg: CleanerConfig,
    run_id: str,
    iteration: int,
    variants: list[Variant] | None = None,
    checkpoint: Path | None = None,
) -> PurifyPlan:
    """Every check of a purification before Beam starts: the raw shard is committed and may be purified; each
    variant's partition is kept (committed from the same inputs), refused (from other inputs) or to purify; what
    purifying needs is there. `cfg`'s storage.root must be absolute (run_purify_stage)."""
    layout = RunLayout(cfg.storage.root, run_id)
    raw = _purifiable_raw(layout, iteration)
    checkpoint = Path(
        checkpoint or (resolve_recorded(cfg.storage.root, raw.inputs[0]) if raw.inputs else cfg.rollout.policy)
    )
    kept, todo = [], []
    for variant in variants or plan_variants(cfg):
        identity = purify_identity(cfg, variant, raw.config_hash)
        done = _committed_partition(layout, iteration, variant, identity)
        if done is None:
            todo.append((variant, identity.value))
        else:
            kept.append(VariantResult(variant, done.rows, done.extra.get("dead", 0), True))
    plan = PurifyPlan(layout, iteration, raw, checkpoint, tuple(kept), tuple(todo))
    return _ready_to_purify(cfg, plan) if todo else plan


def _job(cfg: CleanerConfig, plan: PurifyPlan, staging: Path) -> beam_pipeline.PurifyJob:
    checkpoint = str(plan.checkpoint)
    return beam_pipeline.PurifyJob(
        raw_parts=tuple((str(plan.raw_dir), asdict(p)) for p in plan.raw.parts),
        variants=tuple(v for v, _ in plan.todo),
        staging=str(staging),
        tokenizer_dir=checkpoint,
        estimator=cfg.purify.advantage,
        dynamic_filter=cfg.purify.dynamic_filter,
        recompute=cfg.purify.recompute,
        checkpoint=checkpoint,
        temperature=cfg.rollout.temperature,
        sglang_url=cfg.rollout.sglang_url,
        vllm_urls=tuple(_vllm_urls(cfg, plan.checkpoint)),
        roc_group_size=roc_group_size(cfg),
        runner=plan.runner,
        beam_options=plan.runner_options,
        device=cfg.purify.device,
    )


def _refuse_invalid_parts(raw_dir: Path, staging: Path, counters: dict[str, int]) -> None:
    """A raw part that failed validation in Beam (size, crc32, schema, rows) refuses the whole shard."""
    invalid = sorted(staging.glob(beam_pipeline.INVALID_DESTINATION + "-*.parquet"))
    if invalid or counters.get("invalid_parts"):
        reasons = sorted(r for f in invalid for r in pq.read_table(f).column("reason").to_pylist())
        raise ShardError(reasons[0] if reasons else f"{raw_dir}: a raw part failed validation; nothing was committed")


def _commit(
    cfg: CleanerConfig, plan: PurifyPlan, staging: Path, counters: dict[str, int], variant: Variant, identity: str
) -> VariantResult:
    """One variant's staged rows checked against the pipeline's counts, its dead letters committed, then its
    partition, a chunk (one row group) at a time in the order of one sort of all its rows."""
    files = sorted(staging.glob(f"{beam_pipeline.destination(variant, 'purified')}-*.parquet"))  # one per bucket
    _check_staged(staging, variant, "purified", counters, sum(pq.read_metadata(f).num_rows for f in files))
    dead = beam_pipeline.read_staged(staging, beam_pipeline.destination(variant, "dead"))
    _check_staged(staging, variant, "dead", counters, dead.num_rows)
    dead = dead.sort_by([("raw_key", "ascending")])
    out, dead_dir = _partition_dirs(plan.layout, plan.iteration, variant)
    inputs = [record_path(cfg.storage.root, plan.raw_dir / "_MANIFEST.json")]
    if not is_committed(dead_dir):
        write_shard(dead_dir, dead, DEAD_LETTER, identity, inputs=inputs)
    if dead.num_rows / max(1, plan.raw.rows) > cfg.purify.max_dead_letter_fraction:
        reasons = "; ".join(sorted(set(dead.column("reason").to_pylist()))[:3])
        raise DeadLetterOverflow(
            f"{plan.raw_dir}: {dead.num_rows}/{plan.raw.rows} rows could not be purified for {variant} "
            f"(limit {cfg.purify.max_dead_letter_fraction:.0%}); see {dead_dir}. First reasons: {reasons}"
        )
    extra = {
        "dead": dead.num_rows,
        "filtered_groups": counters.get(beam_pipeline.row_counter(variant, "filtered_groups"), 0),
        "checkpoint": record_path(cfg.storage.root, plan.checkpoint),
    }
    try:
        with ShardWriter(
            out,
            PURIFIED,
            identity,
            inputs=inputs,
            rows_per_part=cfg.storage.rows_per_part,
            compression=cfg.storage.compression,
        ) as writer:
            for chunk in sorted_chunks(files):
                writer.write(chunk)
            manifest = writer.commit(extra)
    except CommittedMeanwhile as e:  # another process purified the same variant of the same rows first: kept
        return VariantResult(variant, e.manifest.rows, e.manifest.extra.get("dead", 0), True)
    return VariantResult(variant, manifest.rows, dead.num_rows, False)


def run_purify_plan(cfg: CleanerConfig, plan: PurifyPlan) -> list[VariantResult]:
    """The planned purification: the pipeline into a staging area, then each variant's partition committed; the
    partitions kept first, as planned."""
    if not plan.todo:
        return list(plan.kept)
    try:
        with staging_area(plan.staging_root, "purify") as staging:
            counters = _run_pipeline(_job(cfg, plan, staging))
            _refuse_invalid_parts(plan.raw_dir, staging, counters)
            return [
                *plan.kept,
                *(_commit(cfg, plan, staging, counters, variant, identity) for variant, identity in plan.todo),
            ]
    except OSError as e:  # committing: a full or read-only disk is one line, and the partition is not written
        raise os_error(e, f"writing the purified shards of {plan.raw_dir.parent}") from None


def run_purify_stage(
    cfg: CleanerConfig,
    run_id: str,
    iteration: int,
    variants: list[Variant] | None = None,
    checkpoint: Path | None = None,
) -> list[VariantResult]:
    """Purify iteration `iteration`'s raw shard into `variants` (default: the flow's, pipeline.variants.plan_variants):
    plan, purify, commit."""
    if not Path(cfg.storage.root).is_absolute():  # Beam's workers (Dask's: other processes, other directories)
        cfg = cfg.model_copy(deep=True)  # must find every path the job names where this process does
        cfg.storage.root = Path(cfg.storage.root).resolve()
    return run_purify_plan(cfg, plan_purify(cfg, run_id, iteration, variants, checkpoint))
