"""BENCHMARK BASELINE, frozen: the CPU engine as it was before the asynchronous loop (issue 17), kept
verbatim so `bench_rollout` can time "today's lockstep loop" against the new one in the same run, and the
lockstep loop itself (`LockstepLoop`, `rollout.loop=lockstep` until issue 28 took it out of the product).

The embedded engine: batched sampling with a KV cache on transformers (CPU).

All active trajectories are sampled in one batch. Rows sharing a prompt get its KV computed once
and copied; each row's own suffix is left-padded behind it with explicit position ids, so every
row's log-probs equal those of an unpadded forward of that row alone. Prefills go through the
cache in chunks of positions and keep only the last position's logits, so a long context costs
neither full-vocabulary logits per position nor a context × context attention matrix.
"""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, DynamicCache

from pipeline.engines.base import Generation, SamplingParams
from rollout_gen.engines.batch_kv import left_pad as _left_pad  # the engine's own: the same padding, one copy
from pipeline.trajectory import Attempt, ToolResult
from rollout_gen.agent import AgentLoop, RolloutIdentity, _Live


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
        tokens = torch.stack([torch.multinomial(probs[i], 1, generator=g)[0] for i, g in enumerate(generators)])
    return tokens, logp.gather(-1, tokens[:, None])[:, 0]


class LockstepCPUEngine:
    def __init__(
        self, checkpoint: Path, threads: int | None = None, pad_id: int | None = None, chunk_tokens: int = 1024
    ) -> None:
        if threads:
            torch.set_num_threads(threads)
        self.checkpoint = Path(checkpoint)
        self.model = self._load(self.checkpoint)
        self.pad_id = pad_id if pad_id is not None else (self.model.config.pad_token_id or 0)
        self.chunk_tokens = chunk_tokens  # prefill positions per forward, over all rows
        self.prefill_tokens = 0  # tokens forwarded in prefills (shared prefixes count once)

    @staticmethod
    def _load(checkpoint: Path) -> torch.nn.Module:
        if not (Path(checkpoint) / "config.json").is_file():
            raise FileNotFoundError(f"no HF checkpoint at {checkpoint} (config.json missing)")
        model = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32, attn_implementation="eager")
        return model.eval()

    def update_weights(self, checkpoint: Path) -> None:
        self.model = self._load(Path(checkpoint))
        self.checkpoint = Path(checkpoint)

    def close(self) -> None:
        self.model = None

    def _forward_chunked(
        self, ids: torch.Tensor, mask: torch.Tensor, pos: torch.Tensor, past_mask: torch.Tensor, cache: DynamicCache
    ) -> torch.Tensor:
        """Forward `ids` through the cache in chunks of positions; logits of the last position only.

        Only the last position's logits are needed to start sampling (`logits_to_keep=1`), and the
        chunks bound the attention scores: memory does not grow with the square of the context."""
        step = max(1, self.chunk_tokens // max(1, ids.shape[0]))
        logits = None
        for a in range(0, ids.shape[1], step):
            b = min(ids.shape[1], a + step)
            out = self.model(
                input_ids=ids[:, a:b],
                attention_mask=torch.cat([past_mask, mask[:, :b]], dim=-1),
                position_ids=pos[:, a:b],
                past_key_values=cache,
                use_cache=True,
                logits_to_keep=1,
            )
            logits = out.logits[:, -1, :]
        return logits

    @torch.inference_mode()
    def _prefill(
        self, contexts: list[list[int]], shared: list[int]
    ) -> tuple[DynamicCache, torch.Tensor, torch.Tensor, torch.Tensor]:
        """KV cache, attention mask, next position and last logits for every row."""
        # Leave at least one token per row outside the shared part: its logits start sampling.
        shared = [max(0, min(s, len(c) - 1)) for s, c in zip(shared, contexts)]
        prefixes: dict[tuple[int, ...], int] = {}
        row_prefix = [prefixes.setdefault(tuple(c[:s]), len(prefixes)) for c, s in zip(contexts, shared)]
        unique = list(prefixes)
        cache = DynamicCache()
        prefix_mask = torch.zeros((len(contexts), 0), dtype=torch.long)
        prefix_len = torch.zeros(len(contexts), dtype=torch.long)
        if any(unique):
            ids, mask = _left_pad([list(p) for p in unique], self.pad_id)
            pos = (mask.cumsum(-1) - 1).clamp(min=0)
            self._forward_chunked(ids, mask, pos, mask[:, :0], cache)
            self.prefill_tokens += sum(len(p) for p in unique)
            index = torch.tensor(row_prefix)
            cache.batch_select_indices(index)
            prefix_mask = mask[index]
            prefix_len = prefix_mask.sum(-1)
        suffixes = [c[s:] for c, s in zip(contexts, shared)]
        ids, mask = _left_pad(suffixes, self.pad_id)
        pos = prefix_len[:, None] + (mask.cumsum(-1) - 1).clamp(min=0)
        logits = self._forward_chunked(ids, mask, pos, prefix_mask, cache)
        self.prefill_tokens += sum(len(s) for s in suffixes)
        next_pos = prefix_len + mask.sum(-1)
        return cache, torch.cat([prefix_mask, mask], dim=-1), next_pos, logits

    @torch.inference_mode()
    def generate(
        self,
        contexts: list[list[int]],
        params: SamplingParams,
        seeds: list[int],
        shared_prefix: list[int] | None = None,
    ) -> list[Generation]:
        if not contexts:
            return []
        if any(len(c) == 0 for c in contexts):
            raise ValueError("every context needs at least one token")
        shared = shared_prefix or [0] * len(contexts)
        generators = [torch.Generator().manual_seed(int(s) & 0x7FFFFFFFFFFFFFFF) for s in seeds]
        cache, mask, pos, logits = self._prefill(contexts, shared)
        stop = torch.tensor(sorted(params.stop_ids), dtype=torch.long)
        n = len(contexts)
        out_ids: list[list[int]] = [[] for _ in range(n)]
        out_lp: list[list[float]] = [[] for _ in range(n)]
        finished = torch.zeros(n, dtype=torch.bool)
        for step in range(params.max_new_tokens):
            tokens, logp = _sample(logits, params, generators)
            for i in torch.nonzero(~finished).flatten().tolist():
                out_ids[i].append(int(tokens[i]))
                out_lp[i].append(float(logp[i]))
            if len(stop):
                finished |= torch.isin(tokens, stop)
            if bool(finished.all()) or step == params.max_new_tokens - 1:
                break
            mask = torch.cat([mask, torch.ones((n, 1), dtype=torch.long)], dim=-1)
            out = self.model(
                input_ids=tokens[:, None],
                attention_mask=mask,
                position_ids=pos[:, None],
                past_key_values=cache,
                use_cache=True,
                logits_to_keep=1,
            )
            pos = pos + 1
            logits = out.logits[:, -1, :]
        stops = set(params.stop_ids)
        return [
            Generation(ids, lps, "stop" if ids and ids[-1] in stops else "length") for ids, lps in zip(out_ids, out_lp)
        ]


class LockstepLoop(AgentLoop):
    """The agent loop before the asynchronous one: one engine call samples the next turn of every active
    trajectory, then every tool call of that round runs. It applies AgentLoop's rules in the same order per
    trajectory with the same per-turn seeds, so it samples the same tokens (bench_rollout checks it)."""

    def _async(self, lives: list[_Live], params: SamplingParams, identity: RolloutIdentity, progress=None) -> None:
        while True:
            for lv in lives:
                if not lv.done:
                    self._check_limits(lv)
            active = [lv for lv in lives if not lv.done]
            if progress:
                progress(len(lives) - len(active), len(lives), f"{len(active)} active")
            if not active:
                break
            gens = self.engine.generate(
                [lv.prompt + lv.ids for lv in active],
                params,
                [self._seed(lv, identity) for lv in active],
                shared_prefix=[len(lv.prompt) for lv in active],
            )
            pending = [(lv, att) for lv, gen in zip(active, gens) if (att := self._turn(lv, gen)) is not None]
            for lv, _ in pending:
                if lv.unscored is not None:  # live importance rollbacks: scored one by one
                    r = self.score_request(lv)
                    self._importance_rollback(lv, self.engine.score_turn(list(r.context), list(r.turn), r.temperature))
            for (lv, att), result in zip(pending, self._execute([a for _, a in pending])):
                self._on_result(lv, att, result)

    def _execute(self, attempts: list[Attempt]) -> list[ToolResult]:
        runnable = [a.code for a in attempts if a.call_status == "ok"]
        ran = iter(self.sandbox.run_many(runnable)) if runnable else iter(())
        return [next(ran) if a.call_status == "ok" else self._agent_failure(a) for a in attempts]
