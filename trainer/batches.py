"""Purified rows → OpenRLHF-shaped training tensors, micro-batched by a token budget.

For a row: sequences = prompt + response; `action_mask[t] = 1` iff sequences[t+1] is a trained
token (OpenRLHF's T−1, shifted-by-one convention); `action_log_probs[t]` is the old policy's
log-prob of sequences[t+1]; the group advantage is broadcast over the action tokens. Rows of a
purified shard of version 2 also carry `behaviour_logprobs` (what each token was sampled with): they
become the micro-batch's `rollout_log_probs`, OpenRLHF's name for them (trainer/correction.py).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields

import pyarrow as pa
import torch

from pipeline.trajectory import PurifiedTrajectory

CPU = torch.device("cpu")


@dataclass(frozen=True)
class TrainingRow:
    """What the update reads of a purified row (a PurifiedTrajectory has these fields too, so either
    can be trained on): built straight from the shard's Arrow columns, splices and the rest unread."""

    raw_key: str
    prompt_id: str
    sample_idx: int
    prompt_ids: list[int]
    response_ids: list[int]
    loss_mask: list[int]
    old_logprobs: list[float]
    advantage: float
    behaviour_logprobs: list[float] | None = None  # None: the shard predates them (purified schema version 1)


# what every purified shard holds; BEHAVIOUR_COLUMN is read beside them where the shard has it
TRAINING_COLUMNS = [f.name for f in fields(TrainingRow) if f.name != "behaviour_logprobs"]
BEHAVIOUR_COLUMN = "behaviour_logprobs"


def training_rows(table: pa.Table) -> list[TrainingRow]:
    """Rows of a purified table holding at least TRAINING_COLUMNS (and BEHAVIOUR_COLUMN when it has it),
    column by column (no dict per row)."""
    names = TRAINING_COLUMNS + ([BEHAVIOUR_COLUMN] if BEHAVIOUR_COLUMN in table.column_names else [])
    columns = [table[c].to_pylist() for c in names]
    return [TrainingRow(*values) for values in zip(*columns)]


def behaviour_of(row) -> list[float] | None:
    """A row's behaviour log-probs (a TrainingRow or a PurifiedTrajectory, either version), None when absent
    (a v1 row read as v2 holds null; a PurifiedTrajectory built without them holds an empty list)."""
    value = getattr(row, BEHAVIOUR_COLUMN, None)
    return None if value is None or (not value and row.response_ids) else value


@dataclass
class MicroBatch:
    sequences: torch.Tensor  # (B, T) long
    attention_mask: torch.Tensor  # (B, T) long
    action_mask: torch.Tensor  # (B, T-1) float
    old_log_probs: torch.Tensor  # (B, T-1) float
    advantages: torch.Tensor  # (B, T-1) float
    rows: list[str]
    rollout_log_probs: torch.Tensor | None = None  # (B, T-1) float: behaviour log-probs, None when a row lacks them

    @property
    def num_actions(self) -> int:
        return int(self.action_mask.sum())


def collate(rows: list[TrainingRow | PurifiedTrajectory], pad_id: int, device: torch.device = CPU) -> MicroBatch:
    """The rows as one padded micro-batch on `device`, each tensor made in one copy from host lists."""
    width = max(len(r.prompt_ids) + len(r.response_ids) for r in rows)
    behaviour = [behaviour_of(r) for r in rows]

    def padded(values, fill, dtype):  # per row: (prompt length − 1) fills, the row's values, fills to the width
        return torch.tensor(
            [
                [fill] * (len(r.prompt_ids) - 1) + list(v) + [fill] * (width - len(r.prompt_ids) - len(r.response_ids))
                for r, v in zip(rows, values)
            ],
            dtype=dtype,
            device=device,
        )

    seq = torch.tensor(
        [r.prompt_ids + r.response_ids + [pad_id] * (width - len(r.prompt_ids) - len(r.response_ids)) for r in rows],
        dtype=torch.long,
        device=device,
    )
    att = torch.tensor(
        [
            [1] * (len(r.prompt_ids) + len(r.response_ids)) + [0] * (width - len(r.prompt_ids) - len(r.response_ids))
            for r in rows
        ],
        dtype=torch.long,
        device=device,
    )
    act = padded([r.loss_mask for r in rows], 0.0, torch.float)
    old = padded([r.old_logprobs for r in rows], 0.0, torch.float)
    adv = padded([[float(r.advantage)] * len(r.response_ids) for r in rows], 0.0, torch.float)
    beh = padded(behaviour, 0.0, torch.float) if all(x is not None for x in behaviour) else None
    return MicroBatch(
        sequences=seq,
        attention_mask=att,
        action_mask=act,
        old_log_probs=old * act,
        advantages=adv * act,
        rows=[r.raw_key for r in rows],
        rollout_log_probs=None if beh is None else beh * act,
    )


def groups_of(rows: list[PurifiedTrajectory]) -> list[list[PurifiedTrajectory]]:
    groups: dict[str, list[PurifiedTrajectory]] = {}
    for r in sorted(rows, key=lambda r: (r.prompt_id, r.sample_idx)):
        groups.setdefault(r.prompt_id, []).append(r)
    return list(groups.values())


def mini_batches(rows: list[PurifiedTrajectory], n: int) -> list[list[list[PurifiedTrajectory]]]:
    """Split whole groups into n mini-batches (fewer when there are fewer groups)."""
    groups = groups_of(rows)
    n = max(1, min(n, len(groups)))
    size = -(-len(groups) // n)
    return [groups[i : i + size] for i in range(0, len(groups), size)]


# What packing rows into micro-batches minimises: a micro-batch of n rows padded to width w costs
# n·w·(1 + w / ATTENTION_WIDTH) + MICRO_BATCH_COST "tokens". ATTENTION_WIDTH: the width at which a row's
# attention (∝ w²) costs about what the rest of its forward does (∝ w) on the tiny policy on CPU;
# MICRO_BATCH_COST: one more forward and backward's fixed cost, in padded tokens.
ATTENTION_WIDTH = 1024
MICRO_BATCH_COST = 256


def _length(row) -> int:
    return len(row.prompt_ids) + len(row.response_ids)


def pack_rows(rows: list, token_budget: int) -> list[list]:
    """The rows sorted by length (stable) and cut into consecutive runs of least total cost (above), each run's
    padded size within the budget (a row longer than the budget alone). Exact by dynamic programming; each
    run looks back at most budget / width rows, so this is linear in the rows for a fixed budget."""
    rows = sorted(rows, key=_length)
    lengths = [_length(r) for r in rows]
    best = [0.0] + [math.inf] * len(rows)
    cut = [0] * (len(rows) + 1)
    for j in range(1, len(rows) + 1):
        w = lengths[j - 1]  # the widest row of any run ending at j
        for i in range(j - 1, -1, -1):
            k = j - i
            if k > 1 and k * w > token_budget:
                break
            cost = best[i] + k * w * (1 + w / ATTENTION_WIDTH) + MICRO_BATCH_COST
            if cost < best[j]:
                best[j], cut[j] = cost, i
    runs, j = [], len(rows)
    while j > 0:
        runs.append(rows[cut[j] : j])
        j = cut[j]
    return runs[::-1]


def trained_rows(groups: list[list[PurifiedTrajectory]]) -> list[list[PurifiedTrajectory]]:
    """The groups' rows that train a token. A row none of whose tokens is trained (a prompt too long to roll out,
    a voided turn) adds nothing to the token-mean loss, yet was forwarded whole: a 35,021-token prompt held an
    update for minutes. When no row trains a token, the shortest stays, so the step runs as before (a zero step)."""
    kept = [[r for r in g if any(r.loss_mask)] for g in groups]
    if any(kept):
        return [g for g in kept if g]
    rows = [r for g in groups for r in g]
    return [[min(rows, key=_length)]] if rows else []


def micro_batches(
    groups: list[list[PurifiedTrajectory]], token_budget: int, pad_id: int, device: torch.device = CPU
) -> list[MicroBatch]:
    """Pack the rows of whole groups into micro-batches whose padded size stays within the budget. Rows, not
    groups, are packed, by length (pack_rows): a group whose one row is 650 tokens long and the rest 100 no
    longer pads three rows to 650, and a long row stops costing its micro-batch-mates attention over its width
    (the trainer benchmark's batch: 15,320 padded tokens for 7,911 real as groups, 8,344 as rows). A row
    larger than the budget gets a micro-batch of its own. The loss is a token mean over the whole mini-batch
    (advantages are already in the rows), so none of this changes the update beyond float summation order."""
    return [collate(run, pad_id, device) for run in pack_rows([r for g in groups for r in g], token_budget)]
