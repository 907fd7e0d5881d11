"""Negative-sample DPO on tool calls (Open-CLEANER's `use_dpo_on_tool_calls`, `dpo_beta`,
`dpo_max_adjustment_ratio`, off by default: the paper's appendix reports it destabilised training).

Pairs need no extra rollout: the raw shard keeps, at every position where a retry recovered, each failed
call attempt and the working retry. A pair is (chosen: the working retry's turn, rejected: a failed
attempt's turn), both scored after the context C the position's first attempt was sampled in (the prefix
of the lived sequence, checked against that attempt's context fingerprint; a position whose prefix does not
match is skipped), on their call segments only (turn_ids[call_start:], the reference's tool-call token
range). Each turn is scored with its own reasoning, as a deep splice would train it.

The reference (verl/trainer/ppo/ray_trainer.py, `apply_dpo_advantage_adjustment`) does not add a loss: it
adds to every call token's advantage the gradient of a length-normalised, reference-free DPO loss,
-log σ(β·Δ) with Δ = mean log π(chosen call) − mean log π(rejected call), that is β·σ(−β·Δ)/n on each of the
chosen call's n tokens and minus β·σ(−β·Δ)/n' on the rejected call's n', each capped at
`dpo_max_adjustment_ratio` in absolute value. Here the same gradient is an optional side loss of the update,
normalised like the policy loss (the mini-batch's trained tokens N, times the ranks, as OpenRLHF's token
mean): with c = min(β·σ(−β·Δ)/n, cap) and c' = min(β·σ(−β·Δ)/n', cap) computed with the current policy and
held constant (detached),

    side loss = (ranks / N) · Σ_pairs [ −c · Σ_{t∈chosen call} log π(t) + c' · Σ_{t∈rejected call} log π(t) ]

whose gradient is the capped DPO gradient, the reference's advantage adjustment on a policy-gradient loss
at ratio 1. The update logs the DPO loss itself (mean over pairs of −log σ(β·Δ)), the pairs and the share
of them whose chosen-side weight was capped. Pairs belong to the prompt group of their trajectory: a
mini-batch trains the pairs of its groups, a rank those of the groups it holds.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from pipeline.kinds import failed_call
from pipeline.trajectory import Attempt, attempt_from_row, fingerprint, row_key
from storage.schemas import RAW
from storage.shards import read_shard

RAW_COLUMNS = ["run_id", "iteration", "prompt_id", "sample_idx", "prompt_ids", "lived_ids", "positions"]


@dataclass(frozen=True)
class CallPair:
    prompt_id: str
    raw_key: str
    position_idx: int
    context: list[int]  # C: what the position's first attempt was sampled after (prompt included)
    chosen: list[int]  # the working retry's turn
    chosen_call: int  # where its call segment starts
    rejected: list[int]  # a failed attempt's turn
    rejected_call: int


@dataclass
class PairRow:
    """A pair member in the shape the micro-batcher takes (trainer.batches.collate)."""

    raw_key: str
    prompt_ids: list[int]
    response_ids: list[int]
    loss_mask: list[int]
    old_logprobs: list[float]
    advantage: float = 0.0


def _works(a: Attempt) -> bool:
    return a.result is not None and a.result.status == "success" and a.call_start >= 0


def pairs_of(row: dict) -> tuple[list[CallPair], int]:
    """(pairs, positions skipped because the lived prefix is not the recorded context) of one raw row
    (a dict with RAW_COLUMNS)."""
    lived = row["prompt_ids"] + (row["lived_ids"] or [])
    key = row_key(row["run_id"], row["iteration"], row["prompt_id"], row["sample_idx"])
    pairs, skipped = [], 0
    for p in row["positions"]:
        attempts = [attempt_from_row(a) for a in p["attempts"]]
        winners = [i for i, a in enumerate(attempts) if i > 0 and _works(a)]
        if not winners:
            continue
        win = attempts[winners[-1]]
        losers = [a for a in attempts[: winners[-1]] if failed_call(a) and a.call_start >= 0]
        first = attempts[0]
        context = lived[: first.context_len]
        if len(context) != first.context_len or fingerprint(context) != first.context_fingerprint:
            skipped += 1
            continue
        pairs += [
            CallPair(
                prompt_id=row["prompt_id"],
                raw_key=key,
                position_idx=p["position_idx"],
                context=context,
                chosen=list(win.turn_ids),
                chosen_call=win.call_start,
                rejected=list(a.turn_ids),
                rejected_call=a.call_start,
            )
            for a in losers
        ]
    return pairs, skipped


def read_pairs(raw_dir: Path) -> tuple[list[CallPair], int]:
    """Every tool-call pair of an iteration's raw shard, and the positions skipped."""
    found = [pairs_of(row) for row in read_shard(raw_dir, RAW, columns=RAW_COLUMNS).to_pylist()]
    return [p for pairs, _ in found for p in pairs], sum(skipped for _, skipped in found)


def pair_rows(pairs: list[CallPair]) -> list[PairRow]:
    """Two rows per pair, keyed `i/chosen` and `i/rejected`, trained only on their call segments."""
    out = []
    for i, p in enumerate(pairs):
        for side, turn, call in (("chosen", p.chosen, p.chosen_call), ("rejected", p.rejected, p.rejected_call)):
            out.append(
                PairRow(f"{i}/{side}", p.context, turn, [0] * call + [1] * (len(turn) - call), [0.0] * len(turn))
            )
    return out


@dataclass
class DPOWeights:
    chosen: torch.Tensor  # (P,) c: weight of each chosen call's summed log-prob
    rejected: torch.Tensor  # (P,) c'
    loss: float  # mean over pairs of −log σ(β·Δ): the DPO loss itself
    capped: float  # share of pairs whose chosen-side weight hit the cap


def dpo_weights(
    chosen_mean: torch.Tensor,
    rejected_mean: torch.Tensor,
    chosen_n: torch.Tensor,
    rejected_n: torch.Tensor,
    beta: float,
    cap: float,
) -> DPOWeights:
    """The reference's per-token adjustment from the pairs' mean call log-probs (detached)."""
    delta = chosen_mean - rejected_mean
    grad = beta * torch.sigmoid(-beta * delta)  # −∂(−log σ(βΔ))/∂Δ
    raw_w, raw_l = grad / chosen_n, grad / rejected_n
    return DPOWeights(
        raw_w.clamp(max=cap),
        raw_l.clamp(max=cap),
        float(-torch.nn.functional.logsigmoid(beta * delta).mean()) if len(delta) else 0.0,
        float((raw_w > cap).float().mean()) if len(delta) else 0.0,
    )
