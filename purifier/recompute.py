"""Old log-probs after a splice: recompute only what changed, reusing the KV of the shared prefix.

A token keeps its sampled log-prob iff the purified sequence before it equals the context it was
sampled under (decided in purifier/saar.py). The others are recomputed under the purified context:

- CPU backend (transformers, on purify.device: the CPU or a GPU): the group's prompt is forwarded once
  and its KV cache copied to every row; each row then forwards its response only up to its last token
  that needs a log-prob. Rows that need none are not forwarded at all. Positions go through the cache in
  chunks of `chunk_tokens` (over all rows), and log-probs come from `pipeline.logprobs.token_logprobs`
  (only for chunks that hold a token needing one: a late splice pays the body, not the lm_head, before
  it), so memory stays bounded at any length: no full-vocabulary logits for a whole sequence, no T×T
  attention scores. (Tokens between the prompt and the splice are forwarded to rebuild their KV: no cache
  survives from the rollout process on CPU.)
- SGLang backend: prefill with max_new_tokens=0 and logprob_start_len=P−1; RadixAttention reuses
  the KV of the unchanged prefix that the rollout left in its cache.
- vLLM backend: prefill with prompt_logprobs (vLLM 0.32 skips its prefix cache for such requests).
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import torch
from transformers import DynamicCache

from pipeline.devices import prepare_device, resolve_device
from pipeline.logprobs import score_turn, split_causal_lm, token_logprobs
from pipeline.policy_model import load_causal_lm
from pipeline.trajectory import PurifiedTrajectory


def _needs(t: PurifiedTrajectory) -> list[int]:
    return [i for i, (m, v) in enumerate(zip(t.loss_mask, t.logprob_valid)) if m == 1 and v == 0]


def _filled(
    trajectories: list[PurifiedTrajectory],
    todo: list[tuple[int, PurifiedTrajectory, list[int]]],
    logprobs: list[list[float]],
    forwarded: list[int],
) -> list[PurifiedTrajectory]:
    """The group with each todo row's (index, row, _needs) recomputed log-probs (one per need) and tokens forwarded."""
    result = list(trajectories)
    for (k, t, need), values, n in zip(todo, logprobs, forwarded):
        lps = list(t.old_logprobs)
        for i, v in zip(need, values):
            lps[i] = v
        result[k] = replace(t, old_logprobs=lps, tokens_forwarded=n)
    return result


class CPURecompute:
    def __init__(
        self,
        checkpoint: Path,
        temperature: float = 1.0,
        threads: int | None = 1,
        chunk_tokens: int = 1024,
        device: str | torch.device = "cpu",
    ) -> None:
        if threads:
            torch.set_num_threads(threads)
        self.device = resolve_device(device, "purify.device")
        prepare_device(self.device)
        self.model = load_causal_lm(checkpoint, attn_implementation="eager", device=self.device).eval()
        self.body, self.head = split_causal_lm(self.model)
        self.temperature = temperature if temperature > 0 else 1.0
        # positions forwarded per step over all rows: bounds the attention scores and the logits
        # (chunk_tokens × vocab floats) whatever the trajectories' length
        self.chunk_tokens = chunk_tokens
        self.prefix_tokens = 0

    @torch.inference_mode()
    def group(self, trajectories: list[PurifiedTrajectory]) -> list[PurifiedTrajectory]:
        """Fill in recomputed log-probs for one prompt group (all rows share prompt_ids)."""
        todo = [(k, t, need) for k, t in enumerate(trajectories) if (need := _needs(t))]
        if not todo:
            return trajectories
        prompt = todo[0][1].prompt_ids
        if any(t.prompt_ids != prompt for _, t, _ in todo):
            raise ValueError("a recompute group must share one prompt")
        device = self.device
        cache = DynamicCache()
        for a in range(0, len(prompt), self.chunk_tokens):  # the prompt once, in chunks, into the cache
            hidden = self.body(
                input_ids=torch.tensor([prompt[a : a + self.chunk_tokens]], device=device),
                past_key_values=cache,
                use_cache=True,
            ).last_hidden_state
        self.prefix_tokens += len(prompt)
        n = len(todo)
        # the first response token, predicted by the prompt's last position
        first = torch.tensor([t.response_ids[0] for _, t, _ in todo], device=device)
        first_lp = token_logprobs(hidden[:, -1].expand(n, -1), first, self.head, self.temperature)
        inputs = [t.response_ids[: need[-1]] for _, t, need in todo]  # up to the last needed token
        width = max(len(x) for x in inputs)
        logp = torch.zeros((n, width + 1), device=device)
        logp[:, 0] = first_lp
        if width:
            cache.batch_repeat_interleave(n)
            # each made in one copy from host lists: input j of a row predicts its response[j + 1], and is wanted
            # when that token needs a log-prob
            pad = [width - len(x) for x in inputs]
            ids = torch.tensor([x + [0] * p for x, p in zip(inputs, pad)], dtype=torch.long, device=device)
            targets = torch.tensor(
                [t.response_ids[1 : len(x) + 1] + [0] * p for (_, t, _), x, p in zip(todo, inputs, pad)],
                dtype=torch.long,
                device=device,
            )
            mask = torch.tensor(
                [[1] * (len(prompt) + len(x)) + [0] * p for x, p in zip(inputs, pad)], dtype=torch.long, device=device
            )
            wanted_at = [{i - 1 for i in need if i > 0} for _, _, need in todo]
            wanted = torch.tensor([[j in w for j in range(width)] for w in wanted_at], dtype=torch.bool, device=device)
            step = max(1, self.chunk_tokens // n)
            for a in range(0, width, step):
                b = min(width, a + step)
                pos = torch.arange(len(prompt) + a, len(prompt) + b, device=device)[None, :].expand(n, -1)
                hidden = self.body(
                    input_ids=ids[:, a:b],
                    attention_mask=mask[:, : len(prompt) + b],
                    position_ids=pos,
                    past_key_values=cache,
                    use_cache=True,
                ).last_hidden_state
                # the body runs over every position (the cache needs them), the lm_head only over chunks with a
                # token that needs its log-prob: before a late splice, 151,936 logits per position are wasted
                if wanted[:, a:b].any():
                    logp[:, a + 1 : b + 1] = token_logprobs(hidden, targets[:, a:b], self.head, self.temperature)
        host = logp.tolist()  # one copy off the device, then read per needed token
        return _filled(
            trajectories,
            todo,
            [[host[r][i] for i in need] for r, (_, _, need) in enumerate(todo)],
            [len(x) for x in inputs],
        )

    def score(self, context: list[int], turn: list[int]) -> list[float]:
        """log π(turn[k] | context, turn[:k]) for every k: one rollback's importance-ratio numerator (saar_is)."""
        self.prefix_tokens += len(context) + len(turn) - 1
        return score_turn(self.body, self.head, context, turn, self.temperature, self.chunk_tokens)


class ServedRecompute:
    """Recompute on an inference server: one prefill per row that needs it, from its first needed token
    to its last. `engine.score(sequences, starts, temperature)` is the server's (SGLang, vLLM)."""

    def __init__(self, engine, temperature: float = 1.0) -> None:
        self.engine = engine
        self.temperature = temperature

    def group(self, trajectories: list[PurifiedTrajectory]) -> list[PurifiedTrajectory]:
        todo = [(k, t, need) for k, t in enumerate(trajectories) if (need := _needs(t))]
        if not todo:
            return trajectories
        seqs = [t.prompt_ids + t.response_ids[: need[-1] + 1] for _, t, need in todo]
        starts = [len(t.prompt_ids) + need[0] for _, t, need in todo]
        scores = self.engine.score(seqs, starts, self.temperature)
        return _filled(
            trajectories,
            todo,
            [[s[len(t.prompt_ids) + i - start] for i in need] for (_, t, need), s, start in zip(todo, scores, starts)],
            [len(s) for s in scores],
        )

    def score(self, context: list[int], turn: list[int]) -> list[float]:
        """As CPURecompute.score, by a prefill on the server."""
        return self.engine.score_turn(context, turn, self.temperature)


class SGLangRecompute(ServedRecompute):
    def __init__(self, url: str, temperature: float = 1.0) -> None:
        from pipeline.engines.sglang import SGLangEngine

        super().__init__(SGLangEngine(url), temperature)


class VLLMRecompute(ServedRecompute):
    """Prefill with prompt_logprobs on the rollout's vLLM servers, after making them serve `checkpoint` (the policy
    that sampled the shard). vLLM never reads its prefix cache for such a request (pipeline/engines/vllm.py):
    `engine.stats` counts the prompt tokens prefilled and the cached ones it reports (0 in vLLM 0.32)."""

    def __init__(self, urls: list[str], checkpoint: Path, temperature: float = 1.0) -> None:
        from pipeline.engines.vllm import VLLMEngine

        engine = VLLMEngine(list(urls), checkpoint, max_in_flight=8)
        engine.serve(checkpoint)
        super().__init__(engine, temperature)
