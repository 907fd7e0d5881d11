"""The engine protocol every rollout backend implements (CPU transformers, SGLang)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Hashable, Literal, Protocol


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


@dataclass(frozen=True)
class Request:
    """One turn of one trajectory. `key` names the trajectory: an engine may keep its KV cache under
    it between turns, until `release(key)`. `shared_prefix` as in `Engine.generate`."""

    key: Hashable
    context: tuple[int, ...]
    params: SamplingParams
    seed: int
    shared_prefix: int = 0


@dataclass(frozen=True)
class ScoreRequest:
    """A retry to score (live importance-ratio rollback): log π(turn | context) per token at `temperature`.
    `key` names the trajectory, as in `Request`: its cached prefix may be reused."""

    key: Hashable
    context: tuple[int, ...]
    turn: tuple[int, ...]
    temperature: float = 1.0


class Engine(Protocol):
    def generate(
        self,
        contexts: list[list[int]],
        params: SamplingParams,
        seeds: list[int],
        shared_prefix: list[int] | None = None,
    ) -> list[Generation]:
        """Sample one continuation per context. `seeds` make each row reproducible whatever the
        batch; `shared_prefix[i]` says how many leading tokens row i shares with the rows that
        have the same ones (the prompt of a group), so an engine may compute them once."""
        ...

    def score_turn(
        self, context: list[int], turn: list[int], temperature: float = 1.0, key: Hashable | None = None
    ) -> list[float]:
        """log softmax(logits / temperature) of each turn token after the context and the turn tokens before
        it: what a live importance-ratio rollback scores a retry with in the context without its failed turn.
        `key`: the trajectory (as in `Request`) whose cached prefix the engine may reuse."""
        ...

    def update_weights(self, checkpoint: Path) -> None: ...

    def close(self) -> None: ...
