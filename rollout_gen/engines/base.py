"""The engine protocol every rollout backend implements (CPU transformers, SGLang)."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Literal, Protocol


@dataclass(frozen=True)
class SamplingParams:
    max_new_tokens: int
    temperature: float = 1.0  # log-probs are of softmax(logits / temperature), as SGLang reports them
    top_p: float = 1.0
    stop_ids: tuple[int, ...] = ()


@dataclass
class Generation:
    output_ids: list[int]  # includes the stop token that ended generation, as SGLang's output_ids do
    logprobs: list[float]  # one per output id, of the sampled token
    finish_reason: Literal["stop", "length"]


class Engine(Protocol):
    def generate(self, contexts: list[list[int]], params: SamplingParams, seeds: list[int],
                 shared_prefix: list[int] | None = None) -> list[Generation]:
        """Sample one continuation per context. `seeds` make each row reproducible whatever the
        batch; `shared_prefix[i]` says how many leading tokens row i shares with the rows that
        have the same ones (the prompt of a group), so an engine may compute them once."""
        ...

    def update_weights(self, checkpoint: Path) -> None: ...

    def close(self) -> None: ...
