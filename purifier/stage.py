"""Phase 2 as a stage: one iteration's raw shard → one purified partition per variant (pipeline.modes.Variant).

Partitions already committed with the same inputs and settings are skipped, so a rerun after a
crash redoes only what is missing, and a replay under a new γ never touches the raw shard or the
partitions beside it.
"""
from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import shutil
import uuid
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable

import pyarrow.parquet as pq

from pipeline.config import PURIFY_MODE_SETTINGS, PURIFY_REPLAY_SETTINGS, CleanerConfig, roc_group_size
from storage.errors import CleanerError, os_error
from purifier import beam_pipeline
from purifier.commit import sorted_chunks
from pipeline.modes import IS_MODES, SPLICING_MODES, Variant, live_measure
from pipeline.similarity import Measure
from storage.layout import RunLayout, record_path, resolve_recorded
from storage.schemas import DEAD_LETTER, PURIFIED, RAW
from storage.checkpoints import check_checkpoint
from storage.shards import (ShardError, ShardMissing, ShardWriter, committed_manifest, is_committed, read_manifest,
                            write_shard)

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
    def gamma(self) -> float:
        return self.variant.threshold


def purify_config_hash(cfg: CleanerConfig, variant: Variant, raw_hash: str) -> str:
    """What a partition was purified with: the same record for every variant (its partition path names the mode,
    threshold and measure). Partitions committed by a cleaner before this record (issue 28) hash otherwise: the
    stage refuses them in one line that says how to re-purify (`_committed_otherwise`)."""
    settings = cfg.purify.model_dump(mode="json", exclude=PURIFY_REPLAY_SETTINGS | PURIFY_MODE_SETTINGS)
    # PURIFY_MODE_SETTINGS change one mode's partitions and no other's
    mode_settings = {"roc_group_size": roc_group_size(cfg)} if variant.mode == "roc" else {}
    record = {"purify": settings, "temperature": cfg.rollout.temperature, "variant": variant.partition,
              "mode_settings": mode_settings, "raw": raw_hash}
    data = json.dumps(record, sort_keys=True)
    return hashlib.blake2b(data.encode(), digest_size=8).hexdigest()


def _check_staged(staging: Path, variant: Variant, kind: str, counters: dict[str, int], rows: int) -> None:
    """The rows the pipeline wrote for one variant and kind checked against its own count of them (a file sink
    that lost a file would otherwise look like fewer rows)."""
    expected = counters.get(beam_pipeline.row_counter(variant, kind), 0)
    if rows != expected:
        raise StagingMismatch(f"{staging}: {rows} staged rows for {beam_pipeline.destination(variant, kind)}, but "
                              f"the pipeline produced {expected}; nothing was committed")


def _committed_otherwise(out: Path, dead: Path, iteration: int, run_id: str, wanted: str) -> ShardError:
    """A committed partition is never overwritten; one with another config hash was purified with other settings
    (or by a cleaner before issue 28, whose hash left out what defaults were): re-purify it by hand."""
    return ShardError(f"{out}: committed with other purify settings or by an earlier cleaner (config hash "
                      f"{read_manifest(out).config_hash}, now {wanted}); to purify it again remove {out} and {dead}, "
                      f"then run `cleaner purify --run {run_id} --iteration {iteration}`, or use a new flow.run_id")


def _partition_dirs(layout: RunLayout, iteration: int, variant: Variant) -> tuple[Path, Path]:
    """A variant's purified partition and its dead letters."""
    where = (iteration, variant.mode, variant.threshold, variant.measure_key)
    return layout.purified_dir(*where), layout.dead_letter_dir(*where)


def _clean_stale_staging(staging_root: Path) -> None:
    """Remove what purifications that are no longer running left in `.staging/` (a SIGKILL runs no
    `finally`). A running purification holds an exclusive flock on its `purify-ID.lock`, and the kernel
    drops that lock when the process dies, however it dies; a folder whose lock can be taken is stale."""
    if not staging_root.is_dir():
        return
    for entry in sorted(staging_root.glob("purify-*")):
        name = entry.name.removesuffix(".lock")
        lock = staging_root / f"{name}.lock"
        try:
            fd = os.open(lock, os.O_RDWR | os.O_CREAT, 0o644)
        except FileNotFoundError:
            continue  # removed meanwhile by another cleaner
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)  # alive: not ours to touch
            continue
        try:
            shutil.rmtree(staging_root / name, ignore_errors=True)
            lock.unlink(missing_ok=True)
        finally:
            os.close(fd)
    _remove_if_empty(staging_root)


def _remove_if_empty(folder: Path) -> None:
    with contextlib.suppress(OSError):  # not empty (another purification is running) or already gone
        folder.rmdir()


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
    raise UnknownRunner(f"purify.runner={name}: Beam knows no such runner; use dask (Beam's DaskRunner on a Dask "
                        f"cluster) or one of {', '.join(sorted(known.values()))}")


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
    return type(e).__module__.split(".")[0] == "distributed" or isinstance(
        e, (beam_pipeline.RunLost, TimeoutError, ConnectionError)) or (type(e) is OSError and e.errno is None)


def _run_pipeline(job: beam_pipeline.PurifyJob) -> dict[str, int]:
    staging, runner, options = Path(job.staging), job.runner, job.beam_options
    try:
        return beam_pipeline.run(job)
    except Exception as e:  # noqa: BLE001 - only environment failures are translated; the rest propagate
        lost = _in_chain(e, _is_dask_failure) if runner == beam_pipeline.DASK_RUNNER else None
        if lost is not None:
            address = next((o.split("=", 1)[1] for o in options if o.startswith("--dask_client_address=")), "?")
            what = " ".join(str(lost).split()) or "no details"
            raise DaskRunFailed(f"purification on the Dask cluster at {address} failed ({type(lost).__name__}: "
                                f"{what[:300]}); nothing was committed; check `cleaner cluster status` and the "
                                "workers' logs, then rerun") from None
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


def wanted_variants(modes: list[str], gammas: list[float], is_thresholds: list[float],
                    measure: Measure) -> list[Variant]:
    """The partitions asked for: each γ for the similarity modes, each τ for the importance-ratio modes,
    one partition for the others; the splicing modes under `measure`."""
    return list(dict.fromkeys(Variant.of(m, v, measure) for m in modes
                              for v in (is_thresholds if m in IS_MODES else gammas)))


def configured_variants(cfg: CleanerConfig) -> tuple[list[str], list[float], list[float]]:
    """(modes, γ, τ) a training flow purifies, and `cleaner purify` without --mode, --gamma or --is-threshold:
    purify.modes at purify.gammas / purify.is_thresholds, and the partition the update trains on (train.mode at
    train.gamma, which is a τ for an importance-ratio mode)."""
    trains_tau = cfg.train.mode in IS_MODES
    return (list(dict.fromkeys([*cfg.purify.modes, cfg.train.mode])),
            list(dict.fromkeys([*cfg.purify.gammas, *([] if trains_tau else [cfg.train.gamma])])),
            list(dict.fromkeys([*cfg.purify.is_thresholds, *([cfg.train.gamma] if trains_tau else [])])))


def describe_asked(modes: list[str], gammas: list[float], is_thresholds: list[float]) -> str:
    """What is asked, as the stages log it: γ for the modes that splice by similarity, τ for the importance-ratio
    modes, nothing for the others (e.g. 'saar γ 0.3 0.5, raw, saar_is τ 0.5')."""
    def values(name: str, vs: list[float]) -> str:
        return f" {name} " + " ".join(f"{v:g}" for v in vs)
    return ", ".join(m + (values("τ", is_thresholds) if m in IS_MODES else values("γ", gammas) if m in SPLICING_MODES
                          else "") for m in modes)


def run_purify_stage(cfg: CleanerConfig, run_id: str, iteration: int, modes: list[str] | None = None,
                     gammas: list[float] | None = None, checkpoint: Path | None = None,
                     is_thresholds: list[float] | None = None) -> list[VariantResult]:
    if not Path(cfg.storage.root).is_absolute():  # Beam's workers (Dask's: other processes, other directories)
        cfg = cfg.model_copy(deep=True)          # must find every path the job names where this process does
        cfg.storage.root = Path(cfg.storage.root).resolve()
    layout = RunLayout(cfg.storage.root, run_id)
    raw_dir = layout.raw_dir(iteration)
    if read_manifest(raw_dir) is None:
        if not layout.run_dir.is_dir():  # a mistyped run or root: not a rollout to run first
            runs = sorted(p.name for p in layout.run_dir.parent.glob("*") if p.is_dir())
            raise ShardMissing(f"run {run_id!r} does not exist under {cfg.storage.root} (runs there: "
                               f"{', '.join(runs) or 'none'}; check --run and storage.root)")
        raise ShardMissing(f"{raw_dir}: no committed raw shard for iteration {iteration} (run the rollout first)")
    raw_manifest = committed_manifest(raw_dir, RAW)  # schema version, no stray parts; parts are checked in Beam
    if raw_manifest.extra.get("token_exact") is False and not raw_manifest.extra.get("purify_allowed"):
        # an import re-tokenized from text (flows/import_cmd.py): its boundaries and log-probs are not the sampled ones
        raise ShardError(f"{raw_dir}: imported from {raw_manifest.extra.get('source_format', 'text')} and re-tokenized "
                         "(token_exact: false in its manifest): its token boundaries are not the sampled ones, so it is "
                         "not purified for training; import it again into a new run with `cleaner import "
                         "--allow-purify` to purify it anyway")
    checkpoint = Path(checkpoint or (resolve_recorded(cfg.storage.root, raw_manifest.inputs[0]) if raw_manifest.inputs
                                     else cfg.rollout.policy))
    staging_root = layout.iteration_dir(iteration) / STAGING
    _clean_stale_staging(staging_root)
    modes = modes or cfg.purify.modes
    gammas = gammas or cfg.purify.gammas
    variants, results = [], []
    measure = live_measure(cfg.rollout.saar)  # a replay under another measure overrides rollout.saar
    for variant in wanted_variants(modes, gammas, is_thresholds or cfg.purify.is_thresholds, measure):
        h = purify_config_hash(cfg, variant, raw_manifest.config_hash)
        out, dead_dir = _partition_dirs(layout, iteration, variant)
        if is_committed(out, h):
            m = read_manifest(out)
            results.append(VariantResult(variant, m.rows, m.extra.get("dead", 0), True))
        elif is_committed(out):
            raise _committed_otherwise(out, dead_dir, iteration, run_id, h)
        else:
            variants.append((variant, h))
    if not variants:
        return results
    runner, runner_options = beam_runner(cfg)  # no local Dask cluster: one line before anything is written
    if cfg.purify.recompute in ("cpu", "vllm"):
        check_checkpoint(checkpoint)  # a truncated checkpoint: one line here, not a traceback in a Beam worker
    if cfg.purify.recompute == "cpu" and runner.lower() in ("fnapirunner", "directrunner"):
        from pipeline.devices import resolve_device  # the recompute runs in this process: one line here too

        resolve_device(cfg.purify.device, "purify.device")
    staging_name = f"purify-{uuid.uuid4().hex[:8]}"
    staging = staging_root / staging_name
    staging_root.mkdir(parents=True, exist_ok=True)
    lock = os.open(staging_root / f"{staging_name}.lock", os.O_RDWR | os.O_CREAT, 0o644)
    fcntl.flock(lock, fcntl.LOCK_EX)  # held while this purification lives; see _clean_stale_staging
    try:
        staging.mkdir()  # before the pipeline runs: an unfinished purification leaves a trace
        raw_parts = [(str(raw_dir), asdict(p)) for p in raw_manifest.parts]
        counters = _run_pipeline(beam_pipeline.PurifyJob(
            raw_parts=tuple(raw_parts), variants=tuple(v for v, _ in variants), staging=str(staging),
            tokenizer_dir=str(checkpoint), estimator=cfg.purify.advantage, dynamic_filter=cfg.purify.dynamic_filter,
            recompute=cfg.purify.recompute, checkpoint=str(checkpoint), temperature=cfg.rollout.temperature,
            sglang_url=cfg.rollout.sglang_url, vllm_urls=tuple(_vllm_urls(cfg, checkpoint)),
            roc_group_size=roc_group_size(cfg), runner=runner, beam_options=tuple(runner_options),
            device=cfg.purify.device))
        invalid = sorted(staging.glob(beam_pipeline.INVALID_DESTINATION + "-*.parquet"))
        if invalid or counters.get("invalid_parts"):
            reasons = sorted(r for f in invalid for r in pq.read_table(f).column("reason").to_pylist())
            raise ShardError(reasons[0] if reasons else f"{raw_dir}: a raw part failed validation; nothing was "
                             "committed")
        inputs = [record_path(cfg.storage.root, raw_dir / "_MANIFEST.json")]
        for variant, h in variants:
            # one sorted file per bucket, merged a chunk at a time below
            files = sorted(staging.glob(f"{beam_pipeline.destination(variant, 'purified')}-*.parquet"))
            _check_staged(staging, variant, "purified", counters, sum(pq.read_metadata(f).num_rows for f in files))
            dead = beam_pipeline.read_staged(staging, beam_pipeline.destination(variant, "dead"))
            _check_staged(staging, variant, "dead", counters, dead.num_rows)
            dead = dead.sort_by([("raw_key", "ascending")])
            fraction = dead.num_rows / max(1, raw_manifest.rows)
            out, dead_dir = _partition_dirs(layout, iteration, variant)
            if not is_committed(dead_dir):
                write_shard(dead_dir, dead, DEAD_LETTER, h, inputs=inputs)
            if fraction > cfg.purify.max_dead_letter_fraction:
                reasons = "; ".join(sorted(set(dead.column("reason").to_pylist()))[:3])
                raise DeadLetterOverflow(
                    f"{raw_dir}: {dead.num_rows}/{raw_manifest.rows} rows could not be purified for {variant} "
                    f"(limit {cfg.purify.max_dead_letter_fraction:.0%}); see {dead_dir}. First reasons: {reasons}")
            extra = {"dead": dead.num_rows, "filtered_groups": counters.get(beam_pipeline.row_counter(variant, "filtered_groups"), 0),
                     "checkpoint": record_path(cfg.storage.root, checkpoint)}
            # committed a chunk (one row group) at a time, in the order of one sort of all its rows
            with ShardWriter(out, PURIFIED, h, inputs=inputs, rows_per_part=cfg.storage.rows_per_part,
                             compression=cfg.storage.compression) as writer:
                for chunk in sorted_chunks(files):
                    writer.write(chunk)
                manifest = writer.commit(extra)
            results.append(VariantResult(variant, manifest.rows, dead.num_rows, False))
    except OSError as e:  # committing: a full or read-only disk is one line, and the partition is not written
        raise os_error(e, f"writing the purified shards of {raw_dir.parent}") from None
    finally:
        shutil.rmtree(staging, ignore_errors=True)
        (staging_root / f"{staging_name}.lock").unlink(missing_ok=True)
        os.close(lock)
        _remove_if_empty(staging_root)
    return results
