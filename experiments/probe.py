"""The mechanism, measured directly : a one-update gradient probe on iteration-0 batches.

Does purification delete the only direct "do not write this" signal raw GRPO has? In raw GRPO a trajectory whose
tool call failed and was retried keeps the failed call in the loss with the trajectory's advantage: a negative one
pushes the bug down, a positive one pushes it up. SAAR (`saar`) splices every failed call out; `mask_failed` keeps it
in the context but trains none of its tokens; `saar_correct` splices only trajectories that end correct.

For each seed s of the finished experiment's `raw` arm, from the iteration-0 raw shard of run raw-s{s} (sampled by the
start policy; read only, nothing is written into the store), this builds seven training partitions with the
project's own purification (purifier/saar.py `purify`, purifier/batch.py `with_advantages` and `recompute_groups`,
purifier/recompute.py `CPURecompute`):

    raw          every failed call trained with its trajectory's advantage (no purification)
    splice_all   every trajectory with a failed call spliced (SAAR, γ = 0.5): asserted equal to purify mode `saar`
    splice_neg   spliced only where the trajectory's GRPO advantage is negative (failed calls under A > 0 stay)
    splice_pos   spliced only where the advantage is positive (≈ saar_correct, whose rule is reward > 0)
    mask_all     every failed-call turn kept in the context with loss mask 0
    mask_neg     masked only under a negative advantage
    mask_pos     masked only under a positive advantage

A failed call is pipeline/kinds.py's (the code ran and failed through the model's fault). The sign is the row's
GRPO advantage in its prompt group (purify.advantage of the run, computed by with_advantages); rows of a group whose
rewards are all equal have advantage 0 and belong to `all` only (their tokens add nothing to the policy gradient,
only to the token-mean's denominator). The masking of a failed-call turn is exactly what `mask_failed` does to a
recovered-and-correct row (asserted row for row against purify mode `mask_failed` there), applied to the rows the
partition selects. Trajectories without a failed call are identical in every partition (asserted).

Each partition is trained by one update from the start policy with the run's frozen train settings (run.json: lr,
epochs, mini-batches, seed, ...) through the project's trainer (trainer/stage.py's `build_trainer` builds the GRPOUpdate
exactly as the local update stage does, then `GRPOUpdate.run` on the rows), on the CPU.

The readout is a fixed bank of labelled first calls from the world's held-out tasks (rollout_gen/world/tasks.py
`eval_tasks` with the run's world settings): for each of N tasks the context of the very first call as the policy
sees it at position 0 (the prompt the rollout renders, `ChatFormat.prompt_ids`, plus the first reasoning the world's
transcripts put before the code, from rollout_gen/world/corpus.py `make_transcript`), the correct first call and,
for each bug type of corpus.BUGS, the same code with that bug injected (`inject_bug`, a fixed rng). An item's log-odds
is log p(bugged call tokens | context) − log p(correct call tokens | context), each summed over the call segment's
tokens (from the <tool_call> marker through the turn's <|im_end|>; pipeline/logprobs.py `score_turn`). The readout
is the bank's mean log-odds; Δ = after the update − before it (the start policy).

Statistics (experiments/contrasts.py): per partition, a t-interval of Δ over the seeds; paired contrasts across seeds
(each partition − raw, and splice − mask for the same sign) with Holm's correction across them.

    PYTHONPATH=$PWD .venv/bin/python -m experiments.probe                  # all 8 seeds, bank of 200 tasks
    PYTHONPATH=$PWD .venv/bin/python -m experiments.probe --seeds 0 --bank 20 --out-json /tmp/p.json --out-md /tmp/p.md
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import math
import random
import subprocess
import sys
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from statistics import mean
from typing import Callable

import pyarrow as pa

REPO = Path(__file__).resolve().parent.parent
EXPERIMENT = REPO / "configs" / "experiments" / "should_i_turn_saar_on.yaml"
OUT = REPO / "docs" / "results"
ARM = "raw"
GAMMA = 0.5  # SAAR's γ (the paper's, and the experiment's saar arms')
ALPHA = 0.05

# name → (which failed calls are dropped, how); drop ∈ none | neg | pos | all, how ∈ splice | mask
PARTITIONS: dict[str, tuple[str, str | None]] = {
    "raw": ("none", None),
    "splice_all": ("all", "splice"),
    "splice_neg": ("neg", "splice"),
    "splice_pos": ("pos", "splice"),
    "mask_all": ("all", "mask"),
    "mask_neg": ("neg", "mask"),
    "mask_pos": ("pos", "mask"),
}
DESCRIPTIONS = {
    "raw": "every failed call trained with its advantage",
    "splice_all": "= saar (γ = 0.5): every failed call spliced out",
    "splice_neg": "failed calls under A < 0 spliced out; those under A > 0 stay",
    "splice_pos": "failed calls under A > 0 spliced out (≈ saar_correct)",
    "mask_all": "every failed-call turn kept in context, loss mask 0",
    "mask_neg": "failed-call turns under A < 0 masked",
    "mask_pos": "failed-call turns under A > 0 masked (≈ mask_failed)",
}
# (arm, baseline, the sign of arm − baseline the explanation predicts: +1 less negative Δ, −1 more negative, 0 none)
# If raw's failed calls under negative advantage are the "do not write this" signal, dropping them leaves the bug's
# log-odds higher after the update (+); dropping only those under positive advantage leaves it lower (−); dropping
# both (all) is predicted + when the negative ones dominate, as the explanation says they do. Splice vs mask for the
# same sign: the explanation predicts nothing (both drop the same failed calls from the loss).
CONTRASTS: list[tuple[str, str, int]] = [
    ("splice_neg", "raw", +1),
    ("mask_neg", "raw", +1),
    ("splice_all", "raw", +1),
    ("mask_all", "raw", +1),
    ("splice_pos", "raw", -1),
    ("mask_pos", "raw", -1),
    ("splice_all", "mask_all", 0),
    ("splice_neg", "mask_neg", 0),
    ("splice_pos", "mask_pos", 0),
]


def _log(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


# ---- the experiment's runs ----------------------------------------------------------------------------------------


def experiment_runs(experiment: Path, root: Path | None, arm: str = ARM) -> tuple[Path, list[int]]:
    """(storage root, the arm's seeds) of an experiment file (experiments/run.py's layout: base overrides, arms)."""
    import yaml

    exp = yaml.safe_load(experiment.read_text())
    if root is None:
        root = REPO / next(o.split("=", 1)[1] for o in exp["base"] if o.startswith("storage.root="))
    return Path(root).resolve(), list(exp["arms"][arm]["seeds"])


def run_config(root: Path, run_id: str):
    """The run's frozen config (run.json), storage.root pointed at `root` and every stage on the CPU."""
    from pipeline.config import RECORD, CleanerConfig, upgrade_frozen
    from storage.layout import RunLayout

    frozen = upgrade_frozen(json.loads(RunLayout(root, run_id).run_json.read_text()))
    cfg = CleanerConfig.model_validate(frozen, context=RECORD)
    cfg.storage.root = root
    cfg.train.device = cfg.purify.device = cfg.rollout.device = "cpu"
    return cfg


# ---- the partitions ------------------------------------------------------------------------------------------------


def has_failed_call(t) -> bool:
    from pipeline.kinds import failed_call

    return any(failed_call(a) for p in t.positions for a in p.attempts)


def raw_turn_spans(t) -> list[tuple[int, object, int, int]]:
    """(position, attempt, start, end) of every assistant turn in the raw sequence of `t` (purify mode `raw`'s layout:
    each attempt's turn then its feedback, a truncated position without its last feedback, then the final turn)."""
    spans, at = [], 0
    for p in t.positions:
        last_feedback = [] if p.outcome == "truncated" else p.attempts[-1].feedback_ids
        for i, a in enumerate(p.attempts):
            spans.append((p.position_idx, a, at, at + len(a.turn_ids)))
            at += len(a.turn_ids) + len(a.feedback_ids if i < len(p.attempts) - 1 else last_feedback)
    if t.final_turn is not None:
        spans.append((len(t.positions), t.final_turn, at, at + len(t.final_turn.turn_ids)))
    return spans


def masked(t, raw_row):
    """`raw_row` (purify mode raw of `t`) with every failed-call turn given loss mask 0, as mode `mask_failed` does to
    a recovered-and-correct row (checked against it by `check_partitions`)."""
    from pipeline.kinds import failed_call

    spans = raw_turn_spans(t)
    for _, a, s, e in spans:  # the layout is the raw row's, token for token
        assert raw_row.response_ids[s:e] == list(a.turn_ids), f"{t.key}: raw layout differs at {s}"
    mask = list(raw_row.loss_mask)
    for _, a, s, e in spans:
        if failed_call(a):
            mask[s:e] = [0] * (e - s)
    return dataclasses.replace(raw_row, loss_mask=mask)


def failed_call_tokens(t, row, masked_row: bool) -> int:
    """Failed-call tokens a purified row trains (the catalog's failed_call_advantage rule: a failed attempt's call
    segment, from call_start, stays unless a later retry at its position was spliced over it or its turn is masked)."""
    from pipeline.kinds import failed_call

    if sum(row.loss_mask) == 0:
        return 0
    n = 0
    for p in t.positions:
        for a in p.attempts:
            if not failed_call(a) or masked_row:
                continue
            if any(s.position_idx == p.position_idx and s.attempt_idx > a.attempt_idx for s in row.splices):
                continue
            n += len(a.turn_ids) - max(a.call_start, 0)
    return n


def sign_of(advantage: float) -> str:
    return "neg" if advantage < 0 else "pos" if advantage > 0 else "zero"


@dataclass
class Built:
    """One seed's partitions before recompute: PURIFIED tables (advantages set), and what they hold."""

    tables: dict[str, pa.Table]
    advantage: dict[str, float]  # raw_key → GRPO advantage
    failed_rows: dict[str, int]  # trajectories with a failed call, by advantage sign (neg, pos, zero)
    counts: dict[str, dict]  # partition → trained tokens, failed-call tokens trained under A < 0 / A > 0, rows dropped
    dead: list[str]  # raw rows purify() refused (left out of every partition, as the stage's dead letters are)
    trajectories: list


def build_partitions(cfg, raw_table: pa.Table, decode: Callable[[list[int]], str]) -> Built:
    """The seven partitions of one raw shard (PARTITIONS), each with its GRPO advantages."""
    from pipeline.modes import live_measure
    from pipeline.trajectory import purified_to_row, trajectory_from_row
    from purifier.batch import with_advantages
    from purifier.saar import PurifyError, purify
    from storage.schemas import PURIFIED

    measure = live_measure(cfg.rollout.saar)
    estimator, dynamic = cfg.purify.advantage, cfg.purify.dynamic_filter
    trajs, dead, raw_rows = [], [], {}
    for row in raw_table.to_pylist():
        t = trajectory_from_row(row)
        try:
            raw_rows[t.key] = purify(t, GAMMA, "raw", decode, measure)
            trajs.append(t)
        except PurifyError as e:
            dead.append(f"{t.key}: {e}")
    raw_adv, _ = with_advantages(
        pa.Table.from_pylist([purified_to_row(raw_rows[t.key]) for t in trajs], schema=PURIFIED), estimator, dynamic
    )
    advantage = dict(zip(raw_adv["raw_key"].to_pylist(), raw_adv["advantage"].to_pylist()))
    failed_rows = Counter({"neg": 0, "pos": 0, "zero": 0})
    rows: dict[str, list] = {name: [] for name in PARTITIONS}
    counts = {
        name: {"trained_tokens": 0, "failed_call_tokens_neg": 0, "failed_call_tokens_pos": 0} for name in PARTITIONS
    }
    for t in trajs:
        if t.key not in advantage:  # a group dynamic filtering dropped: trained by no partition
            continue
        raw_row, sign = raw_rows[t.key], sign_of(advantage[t.key])
        failed = has_failed_call(t)
        failed_rows[sign] += failed
        spliced = purify(t, GAMMA, "saar", decode, measure) if failed else None
        mask = masked(t, raw_row) if failed else None
        for name, (drop, how) in PARTITIONS.items():
            chosen = failed and (drop == "all" or drop == sign)
            row = (spliced if how == "splice" else mask) if chosen else raw_row
            rows[name].append(row)
            c = counts[name]
            c["trained_tokens"] += sum(row.loss_mask)
            if sign != "zero":
                c[f"failed_call_tokens_{sign}"] += failed_call_tokens(t, row, chosen and how == "mask")
    tables = {}
    for name, rs in rows.items():
        table, _ = with_advantages(
            pa.Table.from_pylist([purified_to_row(r) for r in rs], schema=PURIFIED), estimator, dynamic
        )
        assert dict(zip(table["raw_key"].to_pylist(), table["advantage"].to_pylist())) == advantage, name
        tables[name] = table
    return Built(tables, advantage, dict(failed_rows), counts, dead, trajs)


def _rows_by_key(table: pa.Table, drop: tuple[str, ...] = ()) -> dict[str, dict]:
    return {r["raw_key"]: {k: v for k, v in r.items() if k not in drop} for r in table.to_pylist()}


def same(a, b, tol: float = 0.0, where: str = "") -> float:
    """Largest |a − b| over the floats of two nested rows (NaN equals NaN); AssertionError naming the field where
    anything else differs or a float differs by more than `tol`."""
    if isinstance(a, float) or isinstance(b, float):
        assert isinstance(a, (int, float)) and isinstance(b, (int, float)), f"{where}: {a!r} vs {b!r}"
        if math.isnan(a) and math.isnan(b):
            return 0.0
        gap = abs(a - b)
        assert gap <= tol, f"{where}: {a!r} vs {b!r}"
        return gap
    if isinstance(a, dict) and isinstance(b, dict):
        assert a.keys() == b.keys(), f"{where}: fields {sorted(a.keys() ^ b.keys())}"
        return max((same(a[k], b[k], tol, f"{where}.{k}") for k in a), default=0.0)
    if isinstance(a, list) and isinstance(b, list):
        assert len(a) == len(b), f"{where}: {len(a)} vs {len(b)} items"
        return max((same(x, y, tol, f"{where}[{i}]") for i, (x, y) in enumerate(zip(a, b))), default=0.0)
    assert a == b, f"{where}: {a!r} vs {b!r}"
    return 0.0


def _same_samples(a: pa.Table, b: pa.Table) -> bool:
    """Two raw shards hold the same samples: equal rows but for the run id and the tool calls' wall times."""

    def strip(t: pa.Table) -> list[dict]:
        rows = t.drop_columns(["run_id"]).to_pylist()
        for row in rows:
            for p in row["positions"]:
                for a in p["attempts"]:
                    if a["result"] is not None:
                        a["result"]["duration_s"] = 0.0
        return rows

    try:
        same(strip(a), strip(b))
    except AssertionError:
        return False
    return True


def _same_rows(mine: pa.Table, theirs: pa.Table, tol: float = 0.0, aside: tuple[str, ...] = ()) -> float:
    """Two purified tables hold the same rows, matched by (prompt, sample), run ids, row keys and `aside` aside."""

    def keyed(t: pa.Table) -> dict:
        return {
            (r["prompt_id"], r["sample_idx"]): {k: v for k, v in r.items() if k not in ("run_id", "raw_key", *aside)}
            for r in t.to_pylist()
        }

    return same(keyed(mine), keyed(theirs), tol, "rows")


def check_partitions(cfg, raw_table: pa.Table, built: Built, decode) -> dict:
    """The invariants, by assertion: splice_all is what the purify stage's batch path gives in mode `saar` (γ = 0.5),
    raw what it gives in mode `raw`; mask_all's rows are `mask_failed`'s wherever that mode masks (recovered and
    correct rows); rows without a failed call are the same in every partition; each sign-selective partition drops
    the failed calls of its sign only. Returns what was checked, with counts."""
    from pipeline.modes import Variant, live_measure
    from pipeline.kinds import trajectory_kind
    from purifier.batch import purify_batch, with_advantages

    measure = live_measure(cfg.rollout.saar)
    variants = [Variant.of("saar", GAMMA, measure), Variant.of("raw"), Variant.of("mask_failed")]
    stage = purify_batch(raw_table, variants, decode)
    for v in variants:
        assert len(stage[v][1]) == len(built.dead), f"{v}: dead letters {stage[v][1]} vs {built.dead}"
    estimator, dynamic = cfg.purify.advantage, cfg.purify.dynamic_filter
    # `mode` and `gamma` name the variant a row was purified as (a row kept raw in a splice partition says raw, 0.0):
    # neither is read by the update; every other field is compared
    meta = ("mode", "gamma")
    want = {v.mode: _rows_by_key(with_advantages(stage[v][0], estimator, dynamic)[0], meta) for v in variants}
    got = {name: _rows_by_key(table, meta) for name, table in built.tables.items()}
    same(got["splice_all"], want["saar"], where="splice_all vs purify mode saar")
    same(got["raw"], want["raw"], where="raw vs purify mode raw")
    mask_checked = 0
    for t in built.trajectories:
        if t.key not in built.advantage:
            continue
        if has_failed_call(t) and t.reward > 0 and trajectory_kind(t) == "recovered":
            same(got["mask_all"][t.key], want["mask_failed"][t.key], where=f"{t.key}: mask_all vs mode mask_failed")
            mask_checked += 1
        sign = sign_of(built.advantage[t.key])
        for name, (drop, how) in PARTITIONS.items():
            row = got[name][t.key]
            if not has_failed_call(t) or drop == "none" or (drop in ("neg", "pos") and drop != sign):
                same(row, got["raw"][t.key], where=f"{t.key}: {name} must keep this row raw")
            else:
                same(row, got[f"{how}_all"][t.key], where=f"{t.key}: {name} must drop this row's failed calls")
    # the failed calls each sign-selective partition still trains: exactly those of the other sign
    c = built.counts
    for how in ("splice", "mask"):
        assert c[f"{how}_neg"]["failed_call_tokens_neg"] == c[f"{how}_all"]["failed_call_tokens_neg"]
        assert c[f"{how}_neg"]["failed_call_tokens_pos"] == c["raw"]["failed_call_tokens_pos"]
        assert c[f"{how}_pos"]["failed_call_tokens_pos"] == c[f"{how}_all"]["failed_call_tokens_pos"]
        assert c[f"{how}_pos"]["failed_call_tokens_neg"] == c["raw"]["failed_call_tokens_neg"]
    assert c["mask_all"]["failed_call_tokens_neg"] == c["mask_all"]["failed_call_tokens_pos"] == 0
    return {"splice_all_is_saar": True, "raw_is_raw": True, "mask_rows_checked_against_mask_failed": mask_checked}


def recomputed(tables: dict[str, pa.Table], backend) -> dict[str, pa.Table]:
    """Old log-probs of the tokens a splice moved, recomputed with the start policy (the purify stage's GroupStage)."""
    from purifier.batch import SORT, recompute_groups

    return {name: recompute_groups(t, backend).sort_by(SORT) for name, t in tables.items()}


# ---- one update --------------------------------------------------------------------------------------------------


def one_update(cfg, source: Path, table: pa.Table, raw_manifest):
    """The start policy after one update on `table` (a PURIFIED table), as the local update stage trains it: the
    policy and GRPOUpdate made by trainer/stage.py's `build_trainer`, then `GRPOUpdate.run` on the rows. Returns (model,
    step metrics)."""
    from trainer.batches import training_rows
    from trainer.grpo import UpdateProgress
    from trainer.inputs import UpdateInputs
    from trainer.stage import build_trainer

    rows = training_rows(table)
    inputs = UpdateInputs(
        target=Path("/nonexistent"), src=source, part=Path("/nonexistent"), manifest=None, rows=rows,
        raw_manifest=raw_manifest, metrics_dir=Path("/nonexistent"),
    )  # fmt: skip
    model, update = build_trainer(cfg, inputs, lambda line: None)
    progress = update.run(rows, model.config.pad_token_id or 0, UpdateProgress())
    return model.eval(), progress.metrics


# ---- the readout: labelled first calls -------------------------------------------------------------------------


@dataclass(frozen=True)
class BankItem:
    task: str  # the held-out question
    bug: str  # one of rollout_gen.world.corpus.BUGS
    context: list[int]  # prompt + the first turn up to its call segment
    correct: list[int]  # the correct call segment through <|im_end|>
    bugged: list[int]  # the same call with the bug injected


class _Succeeds:
    """Stands in for the sandbox pool in `make_transcript`: the bank only needs the first turn's text, and every
    call succeeds (bug_rate 0), so nothing runs."""

    def run(self, code: str):
        from pipeline.trajectory import ToolResult

        return ToolResult("success", "Tool call success\nstdout: 0")


def build_bank(chat, world, n: int) -> list[BankItem]:
    """For each of the first `n` held-out tasks of `world`, one item per bug type (module docstring)."""
    from pipeline.chat import CALL_OPEN, IM_END, parse_tool_call, render_tool_call
    from rollout_gen.world.corpus import BUGS, inject_bug, make_transcript
    from rollout_gen.world.tasks import eval_tasks

    tasks = eval_tasks(world)
    if n > len(tasks):
        raise SystemExit(
            f"--bank {n}: the world has {len(tasks)} held-out tasks (world.eval_size); ask for at most that"
        )
    items = []
    for i, task in enumerate(tasks[:n]):
        first = make_transcript(task, random.Random(f"probe-bank-{i}"), _Succeeds(), bug_rate=0.0).segments[0][0]
        reasoning = first[: first.index("\n" + CALL_OPEN)]
        code = parse_tool_call(first).code
        assert first == f"{reasoning}\n{render_tool_call(code)}{IM_END}", first
        prompt = chat.prompt_ids(task.question)
        good = chat.encode(first)
        cs = chat.call_start(good)
        assert cs > 0, first
        for bug in BUGS:
            wrong_code = inject_bug(code, bug, random.Random(f"probe-bank-{i}-{bug}"))
            assert wrong_code != code, (code, bug)
            bad = chat.encode(f"{reasoning}\n{render_tool_call(wrong_code)}{IM_END}")
            assert chat.call_start(bad) == cs and bad[:cs] == good[:cs], (first, bug)
            items.append(BankItem(task.question, bug, prompt + good[:cs], good[cs:], bad[cs:]))
    return items


def log_odds(model, items: list[BankItem], temperature: float = 1.0) -> list[float]:
    """Per item: log p(bugged call | context) − log p(correct call | context), summed over the call's tokens."""
    from pipeline.logprobs import score_turn, split_causal_lm

    body, head = split_causal_lm(model)
    memo: dict[tuple, float] = {}

    def logp(context: list[int], turn: list[int]) -> float:
        key = (tuple(context), tuple(turn))
        if key not in memo:
            memo[key] = float(sum(score_turn(body, head, context, turn, temperature)))
        return memo[key]

    return [logp(it.context, it.bugged) - logp(it.context, it.correct) for it in items]


def readout(model, items: list[BankItem], temperature: float) -> dict:
    from rollout_gen.world.corpus import BUGS

    values = log_odds(model, items, temperature)
    by_bug = {
        b: mean(v for v, it in zip(values, items) if it.bug == b) for b in BUGS if any(it.bug == b for it in items)
    }
    return {"mean": mean(values), "by_bug": by_bug}


# ---- one seed ------------------------------------------------------------------------------------------------------


def _weights_diff(model, checkpoint: Path) -> float | None:
    """Largest |Δ| between the model's weights and a checkpoint's (None when the checkpoint is absent)."""
    from safetensors.torch import load_file

    files = sorted(Path(checkpoint).glob("*.safetensors"))
    if not files:
        return None
    stored = {k: v for f in files for k, v in load_file(f).items()}
    own = model.state_dict()
    return max(float((own[k].float() - v.float()).abs().max()) for k, v in stored.items() if k in own)


def probe_seed(
    cfg, run_id: str, bank: list[BankItem], before: dict | None = None, sibling_saar: str | None = None
) -> dict:
    """One seed: the partitions of run_id's iteration-0 raw shard, checked; one update each; the readout after each.
    `sibling_saar`: a run sharing this raw shard that trained on mode saar (its stored partition is compared with
    splice_all after recompute)."""
    import torch

    from pipeline.chat import load_chat
    from pipeline.policy_model import load_causal_lm
    from purifier.recompute import CPURecompute
    from storage.layout import RunLayout
    from storage.schemas import PURIFIED, RAW
    from storage.shards import read_manifest, read_shard
    from trainer.inputs import update_source

    t0 = time.perf_counter()
    root = Path(cfg.storage.root)
    layout = RunLayout(root, run_id)
    raw_dir = layout.raw_dir(0)
    raw_table = read_shard(raw_dir, RAW)  # read only: validated in memory, nothing recorded beside it
    raw_manifest = read_manifest(raw_dir)
    source = update_source(cfg, run_id, 0)  # the policy that sampled iteration 0, as its raw shard records it
    chat = load_chat(source, cfg.rollout.chat_template_kwargs)
    torch.set_num_threads(max(1, cfg.rollout.engine_tuning.threads))
    built = build_partitions(cfg, raw_table, chat.decode)
    checks = check_partitions(cfg, raw_table, built, chat.decode)
    backend = CPURecompute(source, cfg.rollout.temperature, threads=cfg.rollout.engine_tuning.threads, device="cpu")
    tables = recomputed(built.tables, backend)
    stored = layout.purified_dir(0, "raw", 0.0)
    if stored.is_dir():  # the run's own raw partition (written by the Beam stage) is this raw partition
        checks["raw_equals_run_partition"] = {"max_float_gap": _same_rows(tables["raw"], read_shard(stored, PURIFIED))}
    sibling_checked = False
    if sibling_saar:  # a run whose iteration-0 raw rows are these (run ids aside) and that purified them as saar
        sib = RunLayout(root, sibling_saar)
        part = sib.purified_dir(0, "saar", GAMMA)
        if read_manifest(sib.raw_dir(0)) is not None and part.is_dir():
            if _same_samples(raw_table, read_shard(sib.raw_dir(0), RAW)):
                # mode and gamma aside: splice_all keeps rows without a failed call as purify mode raw made them
                gap = _same_rows(tables["splice_all"], read_shard(part, PURIFIED), 1e-4, ("mode", "gamma"))
                checks[f"splice_all_equals_{sibling_saar}_saar_partition"] = {"max_float_gap": gap}
                sibling_checked = True
    del backend
    if before is None:
        model = load_causal_lm(source, attn_implementation=cfg.train.attn_implementation).eval()
        before = readout(model, bank, cfg.rollout.temperature)
    out = {
        "run_id": run_id,
        "start_policy": str(source),
        "raw_rows": raw_table.num_rows,
        "dead_letters": built.dead,
        "failed_trajectories": built.failed_rows,
        # the GRPO signal of the batch: rows (and prompt groups) whose advantage is not 0
        "signal": {
            "rows": sum(a != 0 for a in built.advantage.values()),
            "groups": len({k.rsplit("/", 1)[0] for k, a in built.advantage.items() if a != 0}),
            "groups_total": len({k.rsplit("/", 1)[0] for k in built.advantage}),
        },
        "checks": checks,
        "before": before,
        "partitions": {},
    }
    for name, table in tables.items():
        t1 = time.perf_counter()
        model, metrics = one_update(cfg, source, table, raw_manifest)
        after = readout(model, bank, cfg.rollout.temperature)
        entry = {
            **built.counts[name],
            "rows": table.num_rows,
            "optimizer_steps": len(metrics),
            "update_loss": [m.loss for m in metrics],
            "after": after,
            "delta": after["mean"] - before["mean"],
            "delta_by_bug": {b: after["by_bug"][b] - before["by_bug"][b] for b in after["by_bug"]},
            "seconds": time.perf_counter() - t1,
        }
        if name == "raw":  # the run's own update of this partition: checkpoint 1 of run_id
            entry["max_weight_gap_to_run_checkpoint_1"] = _weights_diff(model, layout.checkpoint_dir(1))
        if name == "splice_all" and sibling_checked:  # the sibling's own update of its saar partition
            entry[f"max_weight_gap_to_{sibling_saar}_checkpoint_1"] = _weights_diff(
                model, RunLayout(root, sibling_saar).checkpoint_dir(1)
            )
        out["partitions"][name] = entry
        _log(f"[probe] {run_id} {name}: Δ log-odds {entry['delta']:+.4f} ({entry['seconds']:.1f} s)")
    out["seconds"] = time.perf_counter() - t0
    return out


# ---- statistics and the page ------------------------------------------------------------------------------------


def analyse(seeds: dict[int, dict]) -> dict:
    """Per partition a t-interval of Δ over seeds; the declared contrasts paired across seeds, Holm-adjusted."""
    from experiments.contrasts import holm, paired_t

    per = {}
    for name in PARTITIONS:
        s = paired_t({seed: r["partitions"][name]["delta"] for seed, r in seeds.items()}, ALPHA)
        per[name] = {"mean": s.mean, "se": s.se, "low": s.low, "high": s.high, "n": s.n, "p_zero": s.p}
    stats = []
    for arm, base, _ in CONTRASTS:
        diffs = {seed: r["partitions"][arm]["delta"] - r["partitions"][base]["delta"] for seed, r in seeds.items()}
        stats.append(paired_t(diffs, ALPHA))
    adjusted = holm([s.p for s in stats])
    contrasts = []
    for (arm, base, predicted), s, p in zip(CONTRASTS, stats, adjusted):
        contrasts.append(
            {
                "arm": arm,
                "baseline": base,
                "predicted_sign": predicted,
                "diffs": {str(k): v for k, v in s.diffs.items()},
                "identical_seeds": [k for k, v in s.diffs.items() if v == 0.0],
                "mean": s.mean,
                "se": s.se,
                "low": s.low,
                "high": s.high,
                "n": s.n,
                "p": s.p,
                "p_holm": p,
                "verdict": verdict(predicted, s.mean, p, s.n),
            }
        )
    return {"partitions": per, "contrasts": contrasts}


def verdict(predicted: int, m: float, p_holm: float, n: int) -> str:
    if n < 2 or p_holm != p_holm:
        return "not estimable"
    if p_holm >= ALPHA:
        return "left open"
    if predicted == 0:
        return "differs (no prediction)"
    return "confirmed" if (m > 0) == (predicted > 0) else "refuted"


def _f(v: float, fmt: str = "+.4f") -> str:
    return "—" if v is None or v != v else format(v, fmt)


def _p(v: float) -> str:
    return "—" if v != v else ("< 0.001" if v < 0.001 else f"{v:.3f}")


def page(result: dict) -> str:
    a, seeds = result["analysis"], result["seeds"]
    s_list = sorted(seeds, key=int)
    before = seeds[s_list[0]]["before"]["mean"]
    lines = [
        '# Gradient probe: does purification delete raw GRPO\'s "do not write this" signal?',
        "",
        "Generated by `python -m experiments.probe` (issue 46, item 4; the method is the module's docstring). "
        f"Code {result['commit'][:12]}"
        + (" with uncommitted changes" if result["worktree_dirty"] else "")
        + f" (experiments/probe.py sha256 {result['probe_sha256'][:12]}); {result['wall_s'] / 60:.1f} min on "
        f"{result['threads']} CPU thread(s).",
        "",
        f"One GRPO update from the start policy (`{Path(result['start_policy']).name}`) on each partition of the "
        f"iteration-0 raw shard of runs {result['arm']}-s{{{', '.join(s_list)}}} of `{result['experiment']}` "
        f"(64 trajectories each; the run's train settings: lr {result['train']['lr']:g}, {result['train']['epochs']} "
        f"epochs × {result['train']['mini_batches']} mini-batches, train seed = run seed). Readout: the mean log-odds "
        f"of an injected bug against the correct first call over a bank of {result['bank_tasks']} held-out tasks × "
        f"{len(result['bugs'])} bug types = {result['bank_items']} items; start policy {before:+.3f} nats. "
        "Δ = after − before (negative: the update made the bug less likely relative to the correct call).",
        "",
        "## Δ log-odds per partition",
        "",
        "| partition | what is dropped | mean Δ | 95% t-interval over seeds | n seeds | per seed |",
        "|---|---|---|---|---|---|",
    ]
    for name in PARTITIONS:
        r = a["partitions"][name]
        per_seed = ", ".join(f"s{s} {seeds[s]['partitions'][name]['delta']:+.4f}" for s in s_list)
        lines.append(
            f"| {name} | {DESCRIPTIONS[name]} | {_f(r['mean'])} | [{_f(r['low'])}, {_f(r['high'])}] | {r['n']} | "
            f"{per_seed} |"
        )
    lines += [
        "",
        "## What each partition trains (per seed)",
        "",
        "Trajectories with a failed call by the sign of their GRPO advantage (neg / pos / zero: a group whose rewards "
        "are all equal), and per partition the trained tokens and the failed-call tokens (call segments) trained under "
        "A < 0 / A > 0.",
        "",
        "| seed | rows (groups) with A ≠ 0 | failed-call trajectories neg / pos / zero | "
        + " | ".join(f"{name}: tokens, failed neg/pos" for name in PARTITIONS)
        + " |",
        "|---|---|---|" + "---|" * len(PARTITIONS),
    ]
    for s in s_list:
        r = seeds[s]
        f = r["failed_trajectories"]
        cells = [
            f"{p['trained_tokens']}, {p['failed_call_tokens_neg']}/{p['failed_call_tokens_pos']}"
            for p in (r["partitions"][name] for name in PARTITIONS)
        ]
        g = r["signal"]
        lines.append(
            f"| {s} | {g['rows']} ({g['groups']} of {g['groups_total']}) | {f['neg']} / {f['pos']} / {f['zero']} | "
            + " | ".join(cells)
            + " |"
        )
    lines += [
        "",
        "## Contrasts (paired across seeds, Holm across all nine)",
        "",
        "Predicted: the sign of arm − baseline the explanation predicts (+: a less negative Δ than the baseline).",
        "",
        "| contrast | predicted | n | seeds with Δ = baseline's | mean ± s.e. | 95% t-interval | p | p (Holm) "
        "| verdict |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for c in a["contrasts"]:
        pred = {1: "+", -1: "−", 0: "none"}[c["predicted_sign"]]
        lines.append(
            f"| {c['arm']} − {c['baseline']} | {pred} | {c['n']} | {c['identical_seeds'] or '—'} | "
            f"{_f(c['mean'])} ± {_f(c['se'], '.4f')} | [{_f(c['low'])}, {_f(c['high'])}] | {_p(c['p'])} | "
            f"{_p(c['p_holm'])} | {c['verdict']} |"
        )
    lines += ["", "## Verdict", "", *result["verdict_text"], "", "## Caveats", "", *caveats(result)]
    lines += ["", "## Checks", "", *result["checks_text"], ""]
    return "\n".join(lines)


def verdict_text(result: dict) -> list[str]:
    a = result["analysis"]
    by = {(c["arm"], c["baseline"]): c for c in a["contrasts"]}

    def say(arm: str, base: str) -> str:
        c = by[(arm, base)]
        word = {"+": "less negative", "−": "more negative"}.get(
            {1: "+", -1: "−", 0: ""}[c["predicted_sign"]], "different"
        )
        head = {
            "confirmed": "Confirmed",
            "refuted": "Refuted",
            "left open": "Left open",
            "differs (no prediction)": "Different",
            "not estimable": "Not estimable",
        }[c["verdict"]]
        return (
            f"- {head}: {arm} − {base} (predicted {word} than {base}) = {c['mean']:+.4f} nats, 95% t-interval "
            f"[{_f(c['low'])}, {_f(c['high'])}], Holm p {_p(c['p_holm'])}, n = {c['n']} seeds"
            + (
                f" (the same Δ as {base}, to the last bit, in seeds {c['identical_seeds']}: no row the two train "
                "differently carries a gradient there)"
                if c["identical_seeds"]
                else ""
            )
            + "."
        )

    raw = a["partitions"]["raw"]
    out = [
        f"Raw's own update moves the bug's log-odds by {raw['mean']:+.4f} nats (95% t-interval [{_f(raw['low'])}, "
        f"{_f(raw['high'])}], n = {raw['n']} seeds). The explanation predicts that dropping the failed calls trained "
        "under a negative advantage leaves the bug more likely than raw does, and dropping only those under a positive "
        "advantage leaves it least likely:",
        "",
    ]
    out += [say(arm, base) for arm, base, pred in CONTRASTS if pred != 0]
    out += ["", "Splicing against masking the same failed calls (no prediction):", ""]
    out += [say(arm, base) for arm, base, pred in CONTRASTS if pred == 0]
    confirmed = [c for c in a["contrasts"] if c["predicted_sign"] and c["verdict"] == "confirmed"]
    refuted = [c for c in a["contrasts"] if c["predicted_sign"] and c["verdict"] == "refuted"]
    overall = (
        "refuted by at least one predicted contrast"
        if refuted
        else "confirmed by every predicted contrast"
        if len(confirmed) == sum(1 for *_, p in CONTRASTS if p)
        else "confirmed by some predicted contrasts and left open by the others"
        if confirmed
        else "left open: no predicted contrast is established at the family-wise 5% level"
    )
    f = result["failed_totals"]
    out += [
        "",
        f"Overall, the explanation is {overall}. Across the {len(result['seeds'])} iteration-0 shards, "
        f"{sum(r['signal']['rows'] for r in result['seeds'].values())} of "
        f"{sum(r['raw_rows'] for r in result['seeds'].values())} trajectories have a non-zero GRPO advantage; "
        f"{f['neg']} trajectories with a failed call had a negative advantage, {f['pos']} a positive one and "
        f"{f['zero']} an advantage of 0 (every sample of their prompt got the same reward): the signal the "
        "explanation names is carried by few trajectories per batch, and the ones with advantage 0 carry no "
        "policy gradient at all.",
    ]
    return out


def caveats(result: dict) -> list[str]:
    seeds = result["seeds"]
    same_as_raw = {
        name: [int(s) for s, r in seeds.items() if r["partitions"][name]["delta"] == r["partitions"]["raw"]["delta"]]
        for name in PARTITIONS
        if name != "raw"
    }
    f, t = result["failed_totals"], result["train"]["settings"]
    steps = sorted({r["partitions"]["raw"]["optimizer_steps"] for r in seeds.values()})
    steps = steps[0] if len(steps) == 1 else steps
    return [
        "- Partitions whose update equals raw's to the last bit in a seed: "
        + "; ".join(f"{name} in seeds {v}" for name, v in same_as_raw.items() if v)
        + ". None of the rows they change there carries a non-zero advantage or shares a mini-batch (whose token "
        "count normalises the loss) with one; their difference from raw is exactly 0 and counts as an observation in "
        "the contrasts."
        + "".join(
            f" In seed {s} no row has a non-zero advantage (every prompt group's samples got one reward): every "
            f"partition's update there is AdamW's weight decay alone (Δ {r['partitions']['raw']['delta']:+.1e})."
            for s, r in sorted(seeds.items(), key=lambda kv: int(kv[0]))
            if r["signal"]["rows"] == 0
        ),
        f"- The *_all partitions also drop the failed calls of the {f['zero']} trajectories whose advantage is 0: they "
        "carry no policy gradient, but leaving their tokens out shrinks the token-mean's denominator, which rescales "
        "the gradient against grad-clip and AdamW's moments. The *_neg and *_pos partitions differ from raw only in "
        "rows with a non-zero advantage.",
        "- splice_pos is not saar_correct: saar_correct splices every row with reward > 0, including rows of groups "
        "whose samples all ended correct (advantage 0); splice_pos splices only rows with a positive advantage. "
        "Likewise mask_pos is not mask_failed (which masks recovered-and-correct rows only).",
        "- Splicing differs from masking beyond the loss: a spliced retry is trained in the clean context, as if it "
        "were the first call, while a masked failed call stays in the context its retry is trained after. "
        "splice − mask for the same sign measures that.",
        f"- One update (the run's {t['epochs']} epochs × {t['mini_batches']} mini-batches = {steps} AdamW steps, "
        f"warm-up {t['warmup_steps']}) of iteration 0 only; the "
        "experiment's arms then diverge over 20 iterations of their own rollouts. The bank's bugs are the world "
        "corpus's bug types on its code styles, in the corpus's first-call reasoning, not the policy's own failures.",
    ]


def checks_text(result: dict) -> list[str]:
    seeds = result["seeds"]
    lines = []
    for s in sorted(seeds, key=int):
        r = seeds[s]
        c = r["checks"]
        gap = r["partitions"]["raw"].get("max_weight_gap_to_run_checkpoint_1")
        lines.append(
            f"- seed {s}: splice_all = purify mode saar and raw = purify mode raw row for row (batch path); "
            f"{c['mask_rows_checked_against_mask_failed']} recovered-and-correct rows of mask_all = mode mask_failed; "
            + ("raw = the run's stored raw partition; " if c.get("raw_equals_run_partition") else "")
            + "".join(
                f"splice_all = {k.split('_equals_')[1].removesuffix('_saar_partition')}'s stored saar partition "
                f"(floats within {v['max_float_gap']:.1e}); "
                for k, v in c.items()
                if k.startswith("splice_all_equals_")
            )
            + (
                f"the raw update's weights vs the run's checkpoint 1: max |Δ| {gap:.2e}"
                if gap is not None
                else "the run's checkpoint 1 is absent"
            )
            + "".join(
                f"; the splice_all update's weights vs {k[len('max_weight_gap_to_') :].split('_checkpoint')[0]}'s"
                f" checkpoint 1: max |Δ| {v:.2e}"
                for k, v in r["partitions"]["splice_all"].items()
                if k.startswith("max_weight_gap_to_") and v is not None
            )
            + (f"; dead letters {r['dead_letters']}" if r["dead_letters"] else "")
            + "."
        )
    return lines


def _shown(path: Path) -> str:
    path = path.resolve()
    return str(path.relative_to(REPO)) if path.is_relative_to(REPO) else str(path)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m experiments.probe",
        description=(
            "A one-update gradient probe of purification: does purification delete raw GRPO's\n"
            "direct 'do not write this' signal (failed calls trained under a negative advantage)?\n\n"
            "From each seed's iteration-0 raw shard of the experiment's raw arm (read only: nothing is written into\n"
            "the store), seven partitions are built with the project's purification code:\n"
            "  raw                       every failed call trained with its trajectory's GRPO advantage\n"
            "  splice_all / _neg / _pos  failed calls spliced out (SAAR, gamma 0.5) in every trajectory with one /\n"
            "                            only where the advantage is negative / only where it is positive\n"
            "  mask_all / _neg / _pos    failed-call turns kept in the context with loss mask 0, same selections\n"
            "(splice_all is asserted equal to purify mode saar; mask rows to mode mask_failed where it masks).\n"
            "Each partition trains one update from the start policy with the run's frozen train settings (CPU).\n\n"
            "Readout: a bank of labelled first calls from the world's held-out tasks (--bank tasks x 4 bug types):\n"
            "log-odds = log p(bugged call | ctx) - log p(correct call | ctx), ctx = prompt + first reasoning, summed\n"
            "over the call's tokens; the bank's mean before (start policy) and after each update, delta = after -\n"
            "before. Output: per partition the mean delta with a t-interval over seeds, and paired contrasts across\n"
            "seeds (each partition - raw, splice - mask per sign) with Holm's correction (experiments/contrasts.py)."
        ),
        epilog="Example (one seed, a small bank, outputs elsewhere):\n"
        "  nice -n 5 python -m experiments.probe --seeds 0 --bank 20 --out-json /tmp/p.json --out-md /tmp/p.md",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--experiment", type=Path, default=EXPERIMENT, help="experiment file (default %(default)s)")
    parser.add_argument("--root", type=Path, help="its storage root (default: the file's storage.root)")
    parser.add_argument("--arm", default=ARM, help="the arm whose runs' iteration-0 shards are probed (default raw)")
    parser.add_argument("--seeds", type=int, nargs="+", help="seeds to probe (default: every seed of the arm)")
    parser.add_argument("--bank", type=int, default=200, help="held-out tasks in the readout bank (default 200)")
    parser.add_argument(
        "--out-json", type=Path, default=OUT / "gradient_probe.json", help="every number (default %(default)s)"
    )
    parser.add_argument("--out-md", type=Path, default=OUT / "gradient_probe.md", help="the page (default %(default)s)")
    args = parser.parse_args(argv)

    t0 = time.perf_counter()
    root, all_seeds = experiment_runs(args.experiment, args.root, args.arm)
    seeds = args.seeds if args.seeds is not None else all_seeds
    from pipeline.chat import load_chat
    from rollout_gen.world.corpus import BUGS

    first = run_config(root, f"{args.arm}-s{seeds[0]}")
    from trainer.inputs import update_source

    chat = load_chat(update_source(first, f"{args.arm}-s{seeds[0]}", 0), first.rollout.chat_template_kwargs)
    bank = build_bank(chat, first.world, args.bank)
    _log(f"[probe] root {root}; seeds {seeds}; bank {args.bank} tasks × {len(BUGS)} bugs = {len(bank)} items")
    results, before = {}, None
    for seed in seeds:
        run_id = f"{args.arm}-s{seed}"
        cfg = run_config(root, run_id)
        assert cfg.world == first.world, f"{run_id}: another world than {args.arm}-s{seeds[0]}"
        sibling = f"saar_lived_raw-s{seed}"
        r = probe_seed(cfg, run_id, bank, before, sibling if (root / "runs" / sibling).is_dir() else None)
        before = r["before"]  # every seed starts from the same policy (asserted below): one readout before
        results[str(seed)] = {
            **r,
            "train": {k: getattr(cfg.train, k) for k in ("lr", "epochs", "mini_batches", "seed")},
        }
        _log(f"[probe] {run_id} done in {r['seconds']:.0f} s")
    starts = {r["start_policy"] for r in results.values()}
    assert len(starts) == 1, f"the seeds start from different policies: {sorted(starts)}"
    analysis = analyse({int(s): r for s, r in results.items()})
    totals = Counter()
    for r in results.values():
        totals.update(r["failed_trajectories"])
    commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True, text=True).stdout.strip()
    dirty = bool(subprocess.run(["git", "status", "--porcelain"], cwd=REPO, capture_output=True, text=True).stdout)
    result = {
        "question": "issue 46, item 4: does purification delete raw GRPO's direct 'do not write this' signal?",
        "commit": commit,
        "worktree_dirty": dirty,
        "probe_sha256": hashlib.sha256(Path(__file__).read_bytes()).hexdigest(),
        "experiment": _shown(args.experiment),
        "root": str(root),
        "arm": args.arm,
        "seed_list": seeds,
        "gamma": GAMMA,
        "alpha": ALPHA,
        "bank_tasks": args.bank,
        "bank_items": len(bank),
        "bugs": list(BUGS),
        "readout": "mean over items of sum log p(bugged call tokens | ctx) - sum log p(correct call tokens | ctx); "
        "ctx = prompt + first reasoning; call tokens from <tool_call> through <|im_end|>",
        "start_policy": results[str(seeds[0])]["start_policy"],
        "train": results[str(seeds[0])]["train"] | {"settings": first.train.model_dump(mode="json")},
        "purify": first.purify.model_dump(mode="json"),
        "world": first.world.model_dump(mode="json"),
        "threads": first.rollout.engine_tuning.threads,
        "partitions": {k: {"drop": d, "how": h, "description": DESCRIPTIONS[k]} for k, (d, h) in PARTITIONS.items()},
        "contrasts_declared": [{"arm": a, "baseline": b, "predicted_sign": p} for a, b, p in CONTRASTS],
        "failed_totals": dict(totals),
        "seeds": results,
        "analysis": analysis,
    }
    result["wall_s"] = time.perf_counter() - t0
    result["verdict_text"] = verdict_text(result)
    result["checks_text"] = checks_text(result)
    args.out_json.parent.mkdir(parents=True, exist_ok=True)
    args.out_json.write_text(json.dumps(result, indent=1, default=str) + "\n")
    args.out_md.write_text(page(result))
    _log(f"[probe] wrote {args.out_json} and {args.out_md} after {result['wall_s']:.0f} s")
    print("\n".join(result["verdict_text"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
