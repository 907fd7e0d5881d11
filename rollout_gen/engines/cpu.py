"""The embedded engine: continuous batching with per-trajectory KV caches on transformers, on the CPU or a GPU
(rollout.device: the model, the batch's KV buffers, every tensor of a step and each row's random generator live
there).

Requests join the running batch between decoding steps and leave it as soon as they stop, so a
long turn never holds short ones back. When a turn ends, its row's KV is kept under the
trajectory's key (rollout_gen/engines/kv_store.py); the next turn forwards only the tokens appended
since (tool response, generation prompt), or, after a SAAR splice, those after the common prefix.
Rows that start fresh and share a prompt get its KV computed once. Each row sits right-aligned in
the batch behind explicit position ids and an attention mask (padding may sit between a kept
prefix and new tokens), so its log-probs equal those of an unpadded forward of that row alone.
Prefills go through the cache in chunks of positions and keep only the last position's logits.
Qwen3 checkpoints are forwarded by rollout_gen/engines/qwen3_forward.py: the model's own floats with
a fraction of its per-call work, which is most of a step when few rows are running.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Hashable, Iterator

import torch
import torch.nn.functional as F
from transformers import DynamicCache

from pipeline.devices import generator, prepare_device, resolve_device
from pipeline.engines.base import Generation, Request, SamplingParams, ScoreRequest
from pipeline.logprobs import score_turn, split_causal_lm, token_logprobs
from pipeline.policy_model import load_causal_lm
from storage.errors import CheckpointError
from rollout_gen.engines.batch_kv import growing, left_pad, stack
from rollout_gen.engines.kv_store import KV, KVStore, common_prefix
from rollout_gen.engines.qwen3_forward import Forward, engine_forward


def _sample(
    logits: torch.Tensor, params: SamplingParams, generators: list[torch.Generator]
) -> tuple[torch.Tensor, torch.Tensor]:
    """Next token per row and its log-prob under softmax(logits / T)."""
    temperature = params.temperature if params.temperature > 0 else 1.0
    z = logits.float() / temperature
    # z − logsumexp(z), not log_softmax: on CPU, float32 log_softmax over a 151,936-way peaked
    # distribution is ~3e-4 off (tests/test_qwen3_e2e.py); logsumexp stays within ~1e-6
    logp = z - torch.logsumexp(z, dim=-1, keepdim=True)
    if params.temperature == 0:
        tokens = logp.argmax(dim=-1)
    else:
        probs = logp.exp()
        if params.top_p < 1.0:
            sorted_p, order = probs.sort(dim=-1, descending=True)
            keep = sorted_p.cumsum(dim=-1) - sorted_p < params.top_p
            probs = torch.zeros_like(probs).scatter(-1, order, sorted_p * keep)
        tokens = _race(probs, generators)
    return tokens, logp.gather(-1, tokens[:, None])[:, 0]


def _race(probs: torch.Tensor, generators: list[torch.Generator]) -> torch.Tensor:
    """One token per row: argmax(p / q), q ~ Exp(1) drawn from the row's own generator (an exact
    sampler: the first of independent exponential clocks with rates p to ring). It is how
    torch.multinomial draws one sample, so the tokens are those it gives for the same generators
    (tests/test_async_rollout.py), with one division and argmax for the batch instead of one call per row."""
    q = torch.empty_like(probs)
    for row, g in zip(q, generators):
        row.exponential_(1, generator=g)
    return (probs / q).argmax(dim=-1)


def _last(outputs: Iterator[torch.Tensor]) -> torch.Tensor:
    """The last of `outputs`, each one released as the next is computed."""
    return deque(outputs, maxlen=1)[0]


def _kept_batch(pasts: list[KV | None], lens: list[int], device: torch.device) -> tuple[DynamicCache, torch.Tensor]:
    """Rows' kept KV (`lens[i]` tokens of row i, or none) right-aligned in one cache, and its mask."""
    width = max(lens)
    past_mask = (torch.arange(width, device=device) >= width - torch.tensor(lens, device=device)[:, None]).long()
    if not width:
        return DynamicCache(), past_mask
    ref = next(p for p in pasts if p is not None)
    layers = []
    for li, (k0, _) in enumerate(ref):
        keys = k0.new_zeros(len(pasts), k0.shape[0], width, k0.shape[2])
        values = torch.zeros_like(keys)
        for i, p in enumerate(pasts):
            if p is not None:
                keys[i, :, width - lens[i] :], values[i, :, width - lens[i] :] = p[li]
        layers.append((keys, values))
    return DynamicCache(ddp_cache_data=layers), past_mask


def _layers(cache: DynamicCache) -> list[tuple[torch.Tensor, torch.Tensor]]:
    return [(layer.keys, layer.values) for layer in cache.layers]


@dataclass
class _Row:
    req: Request
    generator: torch.Generator
    ids: list[int]  # tokens whose KV is in the batch: the context, then each forwarded output token
    out: list[int] = field(default_factory=list)
    lps: list[float] = field(default_factory=list)


class CPUEngine:
    def __init__(
        self,
        checkpoint: Path,
        threads: int | None = None,
        pad_id: int | None = None,
        chunk_tokens: int = 1024,
        kv_cache_tokens: int = 1 << 20,
        reuse_kv: bool = True,
        device: str | torch.device = "cpu",
    ) -> None:
        if threads:
            torch.set_num_threads(threads)
        self.device = resolve_device(device, "rollout.device")
        prepare_device(self.device)
        self._load(checkpoint)
        self.pad_id = pad_id if pad_id is not None else (self.model.config.pad_token_id or 0)
        self.chunk_tokens = chunk_tokens  # prefill positions per forward, over all rows
        self.reuse_kv = reuse_kv  # keep each trajectory's KV between its turns
        self.kept = KVStore(kv_cache_tokens)
        self._queue: list[Request] = []
        self._rows: list[_Row] = []
        self._cache = DynamicCache()  # the running batch's KV
        self._mask = torch.zeros((0, 0), dtype=torch.long, device=self.device)
        self._pending = torch.zeros(0, dtype=torch.long, device=self.device)  # sampled, not yet forwarded, one per row
        self._seen: set[Hashable] = set()
        # Tokens forwarded (shared prefixes count once); `first_prefill_tokens` is the part spent on
        # trajectories' first turns, which no cache can save.
        self.prefill_tokens = self.first_prefill_tokens = self.decode_tokens = self.generated_tokens = 0
        # Set to a list to log each finished turn as (key, context, output ids): the input of
        # kv_store.least_forwards, the floor any prefix cache would forward for the same turns.
        self.turn_log: list[tuple[Hashable, tuple[int, ...], list[int]]] | None = None

    def _load(self, checkpoint: Path) -> None:
        if not (Path(checkpoint) / "config.json").is_file():
            raise CheckpointError(f"no HF checkpoint at {checkpoint} (config.json missing)")
        self.model = load_causal_lm(checkpoint, attn_implementation="eager", device=self.device).eval()
        self.forward = engine_forward(self.model)
        self.checkpoint = Path(checkpoint)

    def update_weights(self, checkpoint: Path) -> None:
        if self.busy():
            raise RuntimeError("update_weights while requests are running")
        self._load(checkpoint)
        self.kept.clear()  # KV of the old weights is not the new policy's

    def close(self) -> None:
        self.kept.clear()
        self.model = self.forward = None

    def score_turn(
        self, context: list[int], turn: list[int], temperature: float = 1.0, key: Hashable | None = None
    ) -> list[float]:
        """log π(turn | context) per token (live importance-ratio rollbacks). The trajectory `key`'s kept KV
        holds the context's prefix (it ends with the failed turn this context leaves out): only the rest and
        the turn are forwarded. Without it, the purifier's own scoring function on the whole sequence."""
        body, head = split_causal_lm(self.model)
        kept = self.kept.peek(key) if key is not None and self.reuse_kv else None
        n = common_prefix(kept.ids, context, len(context) - 1) if kept is not None else 0
        if n == 0:
            return score_turn(body, head, context, turn, temperature, self.chunk_tokens)
        cache = DynamicCache(ddp_cache_data=[(k[None, :, :n], v[None, :, :n]) for k, v in kept.kv])
        fast = getattr(self.forward, "hidden_states", None)  # the engine's own Qwen3 forward, when it runs one
        hidden = (
            (
                lambda ids, pos, c: fast(
                    ids, torch.ones((1, int(pos[0, -1]) + 1), dtype=torch.long, device=self.device), pos, c
                )
            )
            if fast
            else None
        )
        self.prefill_tokens += len(context) + len(turn) - 1 - n
        return score_turn(
            body,
            head,
            context,
            turn,
            temperature=temperature,
            chunk_tokens=self.chunk_tokens,
            cache=cache,
            cached=n,
            hidden_states=hidden,
        )

    @torch.inference_mode()
    def score_turns(self, requests: list[ScoreRequest]) -> list[list[float]]:
        """`score_turn` of several retries in one forward (the rollbacks the scheduler gathered between two
        steps): each row is its trajectory's kept KV up to the clean context, right-aligned, then the rest of
        the context and the retry left-padded behind it, as joining rows are batched. The KV the forward
        computed is kept as the trajectory's branch (kv_store.py): when the retry replaces the failed turn,
        the next turn continues from it instead of forwarding the retry again."""
        hidden_states = getattr(self.forward, "hidden_states", None)
        out: list[list[float] | None] = [None] * len(requests)
        rows: list[tuple[int, KV, int]] = []
        for i, r in enumerate(requests):
            kept = self.kept.peek(r.key) if self.reuse_kv and hidden_states is not None else None
            n = common_prefix(kept.ids, r.context, len(r.context) - 1) if kept is not None else 0
            if n:
                rows.append((i, [(k[:, :n], v[:, :n]) for k, v in kept.kv], n))
            else:  # nothing kept to start from (or no batched forward for this model): one at a time
                out[i] = self.score_turn(list(r.context), list(r.turn), r.temperature, r.key)
        if rows:
            seqs = [list(requests[i].context) + list(requests[i].turn) for i, _, _ in rows]
            lens = [n for _, _, n in rows]
            cache, past_mask = _kept_batch([p for _, p, _ in rows], lens, self.device)
            ids, mask = left_pad([seq[n:-1] for seq, n in zip(seqs, lens)], self.pad_id, self.device)
            self.prefill_tokens += int(mask.sum())
            pos = torch.tensor(lens, device=self.device)[:, None] + (mask.cumsum(-1) - 1).clamp(min=0)
            hidden = torch.cat(list(self._chunked(hidden_states, ids, mask, pos, past_mask, cache)), dim=1)
            _, head = split_causal_lm(self.model)
            by_temperature: dict[float, list[int]] = {}
            for j, (i, _, _) in enumerate(rows):
                by_temperature.setdefault(requests[i].temperature, []).append(j)
            for temperature, js in by_temperature.items():  # a row's last len(turn) positions predict its turn
                turns = [requests[rows[j][0]].turn for j in js]
                lps = token_logprobs(
                    torch.cat([hidden[j, hidden.shape[1] - len(t) :] for j, t in zip(js, turns)]),
                    torch.tensor([x for t in turns for x in t], device=self.device),
                    head,
                    temperature,
                ).tolist()
                for j, t in zip(js, turns):
                    out[rows[j][0]], lps = lps[: len(t)], lps[len(t) :]
            for j, (i, _, _) in enumerate(rows):
                m = torch.cat([past_mask[j], mask[j]]).bool()
                self.kept.offer(requests[i].key, seqs[j][:-1], [(k[j][:, m], v[j][:, m]) for k, v in _layers(cache)])
        return out

    # ---- the continuous-batching protocol ------------------------------------------------------
    def add(self, requests: list[Request]) -> None:
        if any(len(r.context) == 0 for r in requests):
            raise ValueError("every context needs at least one token")
        self._queue.extend(requests)

    def busy(self) -> bool:
        return bool(self._queue or self._rows)

    def tokens_in_flight(self) -> int:
        """Tokens sampled so far by the turns still generating (progress counts them before the turns end)."""
        return sum(len(r.out) for r in self._rows)

    def release(self, key: Hashable) -> None:
        self.kept.drop(key)
        self._seen.discard(key)

    @torch.inference_mode()
    def step(self) -> list[tuple[Request, Generation]]:
        done = []
        if self._queue:
            joining, self._queue = self._queue, []
            done += self._admit(joining)
        if self._rows:
            done += self._decode()
        return done

    def generate(
        self,
        contexts: list[list[int]],
        params: SamplingParams,
        seeds: list[int],
        shared_prefix: list[int] | None = None,
    ) -> list[Generation]:
        """One batch, start to end (no KV kept afterwards): the lockstep loop and the SGLang double."""
        if self.busy():
            raise RuntimeError("generate() while continuous requests are running")
        shared = shared_prefix or [0] * len(contexts)
        reqs = [Request(object(), tuple(c), params, int(s), sh) for c, s, sh in zip(contexts, seeds, shared)]
        self.add(reqs)
        got: dict[int, Generation] = {}
        while self.busy():
            got.update((id(r), g) for r, g in self.step())
        for r in reqs:
            self.release(r.key)
        return [got[id(r)] for r in reqs]

    # ---- steps -------------------------------------------------------------------------------
    def _chunked(
        self,
        forward: Forward,
        ids: torch.Tensor,
        mask: torch.Tensor,
        pos: torch.Tensor,
        past_mask: torch.Tensor,
        cache: DynamicCache,
    ) -> Iterator[torch.Tensor]:
        """`forward` of `ids` through the cache, chunk by chunk of positions, each chunk's output yielded as it
        is computed: the chunks bound the attention scores, so memory does not grow with the square of the
        context. A prefill needs only the last chunk's logits (of its last position: `logits_to_keep=1`) to
        start sampling, and keeps no other (_last): at Qwen3's vocabulary each is rows × 151,936 floats."""
        step = max(1, self.chunk_tokens // max(1, ids.shape[0]))
        for a in range(0, ids.shape[1], step):
            yield forward(
                ids[:, a : a + step], torch.cat([past_mask, mask[:, : a + step]], dim=-1), pos[:, a : a + step], cache
            )

    def _prefill_prefixes(self, prefixes: list[list[int]]) -> list[KV]:
        """The unpadded KV of each prefix (computed together, each once)."""
        ids, mask = left_pad(prefixes, self.pad_id, self.device)
        cache = DynamicCache()
        _last(self._chunked(self.forward, ids, mask, (mask.cumsum(-1) - 1).clamp(min=0), mask[:, :0], cache))
        return [
            [(layer.keys[i][:, -len(p) :], layer.values[i][:, -len(p) :]) for layer in cache.layers]
            for i, p in enumerate(prefixes)
        ]

    def _admit(self, reqs: list[Request]) -> list[tuple[Request, Generation]]:
        rows = [_Row(r, generator(self.device, r.seed & 0x7FFFFFFFFFFFFFFF), list(r.context)) for r in reqs]
        pasts: list[KV | None] = [None] * len(rows)
        first = []
        for i, r in enumerate(reqs):
            first.append(r.key not in self._seen)
            self._seen.add(r.key)
            kept = self.kept.take(r.key, r.context) if self.reuse_kv else None
            if kept is not None:  # at least one token is forwarded: its logits start sampling
                n = common_prefix(kept.ids, r.context, len(r.context) - 1)
                pasts[i] = [(k[:, :n], v[:, :n]) for k, v in kept.kv] if n else None
        # Rows with nothing kept and a shared prompt: each distinct prompt's KV is computed once.
        shared = {
            i: tuple(r.context[: min(r.shared_prefix, len(r.context) - 1)])
            for i, r in enumerate(reqs)
            if pasts[i] is None and r.shared_prefix > 0 and len(r.context) > 1
        }
        unique = list(dict.fromkeys(shared.values()))
        if unique:
            kvs = dict(zip(unique, self._prefill_prefixes([list(u) for u in unique])))
            n = sum(map(len, unique))
            self.prefill_tokens += n
            self.first_prefill_tokens += n if all(first[i] for i in shared) else 0
            for i, prefix in shared.items():
                pasts[i] = kvs[prefix]
        lens = [0 if p is None else p[0][0].shape[1] for p in pasts]
        suffixes = [list(r.context[n:]) for r, n in zip(reqs, lens)]
        self.prefill_tokens += sum(map(len, suffixes))
        self.first_prefill_tokens += sum(len(s) for s, f in zip(suffixes, first) if f)
        # The joining rows' batch: kept KV right-aligned, then their new tokens left-padded behind it.
        cache, past_mask = _kept_batch(pasts, lens, self.device)
        ids, mask = left_pad(suffixes, self.pad_id, self.device)
        pos = torch.tensor(lens, device=self.device)[:, None] + (mask.cumsum(-1) - 1).clamp(min=0)
        logits = _last(self._chunked(self.forward, ids, mask, pos, past_mask, cache))
        tokens, logps = self._sample(logits, rows)
        self._join(_layers(cache), torch.cat([past_mask, mask], dim=1), rows, tokens)
        return self._record(range(len(self._rows) - len(rows), len(self._rows)), tokens, logps)

    def _join(self, layers, mask: torch.Tensor, rows: list[_Row], tokens: torch.Tensor) -> None:
        running = self._cache.layers if self._rows else []
        if running and running[0].fits(len(rows), mask.shape[1]):  # into spare rows, nothing copied
            width = max(self._mask.shape[1], mask.shape[1])
            for layer, (k, v) in zip(running, layers):
                layer.widen(width)
                layer.place(k, v)
            self._mask = torch.cat([F.pad(m, (width - m.shape[1], 0)) for m in (self._mask, mask)])  # left: padding
        else:
            parts = ([(_layers(self._cache), self._mask)] if self._rows else []) + [(layers, mask)]
            bufs, self._mask, n_rows, c0, width = stack(parts)
            self._cache = growing(bufs, n_rows, c0, width)
        self._rows += rows
        self._pending = torch.cat([self._pending, tokens])

    def _decode(self) -> list[tuple[Request, Generation]]:
        n = len(self._rows)
        self._mask = torch.cat([self._mask, torch.ones((n, 1), dtype=torch.long, device=self.device)], dim=1)
        pos = torch.tensor([len(r.ids) for r in self._rows], device=self.device)
        logits = self.forward(self._pending[:, None], self._mask, pos[:, None], self._cache)
        for r, t in zip(self._rows, self._pending.tolist()):
            r.ids.append(t)
        self.decode_tokens += n
        tokens, logps = self._sample(logits, self._rows)
        self._pending = tokens
        return self._record(range(n), tokens, logps)

    def _sample(self, logits: torch.Tensor, rows: list[_Row]) -> tuple[torch.Tensor, torch.Tensor]:
        tokens = torch.zeros(len(rows), dtype=torch.long, device=self.device)
        logps = torch.zeros(len(rows), device=self.device)
        groups: dict[SamplingParams, list[int]] = {}
        for i, r in enumerate(rows):
            groups.setdefault(r.req.params, []).append(i)
        for params, idx in groups.items():
            t, lp = _sample(logits[idx], params, [rows[i].generator for i in idx])
            tokens[idx], logps[idx] = t, lp
        return tokens, logps

    def _record(self, idx: range, tokens: torch.Tensor, logps: torch.Tensor) -> list[tuple[Request, Generation]]:
        """Append each row's sampled token; rows that stopped leave the batch, their KV kept."""
        done, leaving = [], set()
        for i, t, lp in zip(idx, tokens.tolist(), logps.tolist()):
            r = self._rows[i]
            r.out.append(t)
            r.lps.append(lp)
            self.generated_tokens += 1
            stopped = t in r.req.params.stop_ids
            if stopped or len(r.out) >= r.req.params.max_new_tokens:
                done.append((r.req, Generation(r.out, r.lps, "stop" if stopped else "length")))
                if self.turn_log is not None:
                    self.turn_log.append((r.req.key, r.req.context, list(r.out)))
                leaving.add(i)
                if self.reuse_kv:
                    m = self._mask[i].bool()
                    self.kept.put(r.req.key, r.ids, [(key[i][:, m], val[i][:, m]) for key, val in _layers(self._cache)])
        if leaving:
            self._leave(leaving)
        return done

    def _leave(self, leaving: set[int]) -> None:
        """Remove rows from the batch without copying the rest: the kept rows beyond the new batch
        size move into the holes, then every buffer is cut to size (views, written in place after)."""
        size = len(self._rows) - len(leaving)
        holes = [i for i in sorted(leaving) if i < size]
        movers = [i for i in range(size, len(self._rows)) if i not in leaving]
        if holes:
            dst, src = torch.tensor(holes, device=self.device), torch.tensor(movers, device=self.device)
            for layer in self._cache.layers:
                layer.move_rows(dst, src)
            self._mask[dst], self._pending[dst] = self._mask[src], self._pending[src]
            for h, m in zip(holes, movers):
                self._rows[h] = self._rows[m]
        self._rows, self._mask, self._pending = self._rows[:size], self._mask[:size], self._pending[:size]
        # columns that only the rows that left used are dropped (a view too)
        live = torch.nonzero(self._mask.any(0)).flatten()
        start = int(live[0]) if len(live) else self._mask.shape[1]
        self._mask = self._mask[:, start:]
        for layer in self._cache.layers:
            layer.cut(size, start)
