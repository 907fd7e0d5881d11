"""Purified rows → OpenRLHF-shaped training tensors, micro-batched by a token budget.

For a row: sequences = prompt + response; `action_mask[t] = 1` iff sequences[t+1] is a trained
token (OpenRLHF's T−1, shifted-by-one convention); `action_log_probs[t]` is the old policy's
log-prob of sequences[t+1]; the group advantage is broadcast over the action tokens.
"""
from __future__ import annotations

from dataclasses import dataclass, fields

import pyarrow as pa
import torch

from pipeline.trajectory import PurifiedTrajectory


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


TRAINING_COLUMNS = [f.name for f in fields(TrainingRow)]


def training_rows(table: pa.Table) -> list[TrainingRow]:
    """Rows of a purified table holding at least TRAINING_COLUMNS, column by column (no dict per row)."""
    columns = [table[c].to_pylist() for c in TRAINING_COLUMNS]
    return [TrainingRow(*values) for values in zip(*columns)]


@dataclass
class MicroBatch:
    sequences: torch.Tensor  # (B, T) long
    attention_mask: torch.Tensor  # (B, T) long
    action_mask: torch.Tensor  # (B, T-1) float
    old_log_probs: torch.Tensor  # (B, T-1) float
    advantages: torch.Tensor  # (B, T-1) float
    rows: list[str]

    @property
    def num_actions(self) -> int:
        return int(self.action_mask.sum())


def collate(rows: list[TrainingRow | PurifiedTrajectory], pad_id: int) -> MicroBatch:
    width = max(len(r.prompt_ids) + len(r.response_ids) for r in rows)
    b = len(rows)
    seq = torch.full((b, width), pad_id, dtype=torch.long)
    att = torch.zeros((b, width), dtype=torch.long)
    act = torch.zeros((b, width - 1))
    old = torch.zeros((b, width - 1))
    adv = torch.zeros((b, width - 1))
    for i, r in enumerate(rows):
        p, n = len(r.prompt_ids), len(r.response_ids)
        seq[i, : p + n] = torch.tensor(r.prompt_ids + r.response_ids)
        att[i, : p + n] = 1
        act[i, p - 1: p - 1 + n] = torch.tensor(r.loss_mask, dtype=torch.float)
        old[i, p - 1: p - 1 + n] = torch.tensor(r.old_logprobs, dtype=torch.float)
        adv[i, p - 1: p - 1 + n] = float(r.advantage)
    return MicroBatch(seq, att, act, old * act, adv * act, [r.raw_key for r in rows])


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
    return [groups[i: i + size] for i in range(0, len(groups), size)]


def micro_batches(groups: list[list[PurifiedTrajectory]], token_budget: int, pad_id: int) -> list[MicroBatch]:
    """Pack groups into micro-batches whose padded size stays within the budget. Groups go in length
    order, so similar lengths share a micro-batch and little is padded. A group larger than the budget
    is split into runs of rows (a row larger than the budget gets a micro-batch of its own): eight
    8k-token rows are then eight forwards, not one of 64k tokens. The loss is a token mean over the
    whole mini-batch (advantages are already in the rows), so none of this changes the update."""
    def width_of(rows: list[PurifiedTrajectory]) -> int:
        return max(len(r.prompt_ids) + len(r.response_ids) for r in rows)

    packs: list[list[PurifiedTrajectory]] = []
    for g in sorted(groups, key=width_of):
        if width_of(g) * len(g) <= token_budget:
            packs.append(g)
            continue
        run: list[PurifiedTrajectory] = []
        for r in sorted(g, key=lambda r: len(r.prompt_ids) + len(r.response_ids)):
            if run and width_of(run + [r]) * (len(run) + 1) > token_budget:
                packs.append(run)
                run = []
            run.append(r)
        packs.append(run)
    out, current, width = [], [], 0
    for pack in packs:
        new_width = max(width, width_of(pack))
        if current and new_width * (len(current) + len(pack)) > token_budget:
            out.append(collate(current, pad_id))
            current, new_width = [], width_of(pack)
        current += pack
        width = new_width
    if current:
        out.append(collate(current, pad_id))
    return out
