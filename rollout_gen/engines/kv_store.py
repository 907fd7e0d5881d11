"""Per-trajectory KV caches kept between turns, bounded by a cap on cached tokens (LRU eviction).

An entry is the unpadded KV of the tokens a trajectory's last turn left in the engine. The engine
takes it out when the trajectory's next turn arrives (an entry lives either here or in the running
batch, never both), and the agent loop drops it when the trajectory ends. When the cap is reached
the least recently kept entries go first: their trajectories' next turn is prefilled in full.

An entry may hold a second continuation of the same trajectory, its `branch`: the KV a live importance-ratio
rollback's scoring forward computed for the retry in the context without its failed turn. Whether the retry
replaces that turn is decided after the scoring; `take` hands the next turn whichever of the two shares more
of its context, so a replacing retry is not forwarded a second time.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Hashable, Iterable, Sequence

import torch

KV = list[tuple[torch.Tensor, torch.Tensor]]  # per layer: keys and values [heads, tokens, head_dim] of one row


@dataclass
class Kept:
    ids: list[int]
    kv: KV
    branch: Kept | None = None

    def tokens(self) -> int:  # cached tokens, the branch's included
        return len(self.ids) + (len(self.branch.ids) if self.branch is not None else 0)


def common_prefix(a: Sequence[int], b: Sequence[int], limit: int) -> int:
    """Length of the longest common prefix of a and b, at most `limit`."""
    n = min(len(a), len(b), limit)
    return next((i for i in range(n) if a[i] != b[i]), n)


class KVStore:
    def __init__(self, cap_tokens: int) -> None:
        self.cap_tokens = cap_tokens
        self._entries: OrderedDict[Hashable, Kept] = OrderedDict()
        self.tokens = 0  # cached tokens now
        self.evicted = 0  # entries dropped to stay under the cap
        self.branch_tokens = 0  # tokens not forwarded again because a branch served the next turn

    def __len__(self) -> int:
        return len(self._entries)

    def put(self, key: Hashable, ids: list[int], kv: KV) -> None:
        self.drop(key)
        if len(ids) > self.cap_tokens:
            self.evicted += 1
            return
        self._entries[key] = Kept(list(ids), kv)
        self.tokens += len(ids)
        self._evict()

    def offer(self, key: Hashable, ids: list[int], kv: KV) -> None:
        """Keep `ids`' KV as the branch of `key`'s entry (replacing an earlier branch); nothing without an entry."""
        kept = self._entries.get(key)
        if kept is None:
            return
        self.tokens += len(ids) - (len(kept.branch.ids) if kept.branch is not None else 0)
        kept.branch = Kept(list(ids), kv)
        self._entries.move_to_end(key)
        self._evict()

    def _evict(self) -> None:
        while self.tokens > self.cap_tokens:
            _, old = self._entries.popitem(last=False)
            self.tokens -= old.tokens()
            self.evicted += 1

    def take(self, key: Hashable, context: Sequence[int] = ()) -> Kept | None:
        """The entry of `key`, out of the store: its branch instead when that shares more of `context`."""
        kept = self._entries.pop(key, None)
        if kept is None:
            return None
        self.tokens -= kept.tokens()
        branch, kept.branch = kept.branch, None
        limit = len(context) - 1  # as the engine reuses it: at least one token of the context is forwarded
        if branch is not None:
            gain = common_prefix(branch.ids, context, limit) - common_prefix(kept.ids, context, limit)
            if gain > 0:
                self.branch_tokens += gain
                return branch
        return kept

    def peek(self, key: Hashable) -> Kept | None:
        """The entry of `key` left in place (a reader that only needs a prefix of it)."""
        return self._entries.get(key)

    def drop(self, key: Hashable) -> None:
        self.take(key)

    def clear(self) -> None:
        self._entries.clear()
        self.tokens = 0


def least_forwards(turns: Iterable[tuple[Hashable, Sequence[int], Sequence[int]]]) -> int:
    """The fewest tokens any prefix cache forwards for these turns, after each key's first prefill.

    `turns` are (trajectory key, context, sampled output) in the order each key's turns ran. A
    turn's context costs only what no earlier turn of its key forwarded as a prefix (and at least
    one token: its logits start sampling); its output costs one forward per sampled token but the
    last (a token is forwarded when the next is sampled). A key's first context is the first prefill,
    which no cache saves, and is not counted. Tool responses, generation prompts and SAAR's re-spliced
    calls are new prefixes and count: this is the floor the workload sets, not the engine.
    """
    seen: dict[Hashable, list[Sequence[int]]] = {}
    total = 0
    for key, context, output in turns:
        earlier = seen.setdefault(key, [])
        if earlier:
            shared = max(common_prefix(s, context, len(context) - 1) for s in earlier)
            total += len(context) - shared
        total += max(len(output) - 1, 0)
        earlier.append(list(context) + list(output[:-1]))
    return total
