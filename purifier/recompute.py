"""Old log-probs after a splice: recompute only what changed, reusing the KV of the shared prefix.

A token keeps its sampled log-prob iff the purified sequence before it equals the context it was
sampled under (decided in purifier/saar.py). The others are recomputed under the purified context:

- CPU backend: the group's prompt is forwarded once and its KV cache copied to every row; each row
  then forwards its response only up to its last token that needs a log-prob. Rows that need none
  are not forwarded at all. (Tokens between the prompt and the splice are forwarded to rebuild
  their KV: no cache survives from the rollout process on CPU.)
- SGLang backend: prefill with max_new_tokens=0 and logprob_start_len=P−1; RadixAttention reuses
  the KV of the unchanged prefix that the rollout left in its cache.
"""
from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, DynamicCache

from pipeline.trajectory import PurifiedTrajectory


def _needs(t: PurifiedTrajectory) -> list[int]:
    return [i for i, (m, v) in enumerate(zip(t.loss_mask, t.logprob_valid)) if m == 1 and v == 0]


class CPURecompute:
    def __init__(self, checkpoint: Path, temperature: float = 1.0, threads: int | None = 1) -> None:
        if threads:
            torch.set_num_threads(threads)
        self.model = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32,
                                                          attn_implementation="eager").eval()
        self.temperature = temperature if temperature > 0 else 1.0
        self.prefix_tokens = 0

    @torch.inference_mode()
    def group(self, trajectories: list[PurifiedTrajectory]) -> list[PurifiedTrajectory]:
        """Fill in recomputed log-probs for one prompt group (all rows share prompt_ids)."""
        todo = [(k, t, _needs(t)) for k, t in enumerate(trajectories)]
        todo = [(k, t, need) for k, t, need in todo if need]
        if not todo:
            return trajectories
        prompt = todo[0][1].prompt_ids
        if any(t.prompt_ids != prompt for _, t, _ in todo):
            raise ValueError("a recompute group must share one prompt")
        cache = DynamicCache()
        out = self.model(input_ids=torch.tensor([prompt]), past_key_values=cache, use_cache=True)
        self.prefix_tokens += len(prompt)
        first_logits = out.logits[:, -1:, :]  # predicts response[0]
        inputs = [t.response_ids[: need[-1]] for _, t, need in todo]  # logits up to the last needed token
        width = max(len(x) for x in inputs)
        result = list(trajectories)
        if width:
            cache.batch_repeat_interleave(len(todo))
            ids = torch.zeros((len(todo), width), dtype=torch.long)
            mask = torch.zeros((len(todo), len(prompt) + width), dtype=torch.long)
            mask[:, : len(prompt)] = 1
            for r, x in enumerate(inputs):
                ids[r, : len(x)] = torch.tensor(x, dtype=torch.long)
                mask[r, len(prompt): len(prompt) + len(x)] = 1
            pos = torch.arange(len(prompt), len(prompt) + width)[None, :].expand(len(todo), -1)
            rest = self.model(input_ids=ids, attention_mask=mask, position_ids=pos, past_key_values=cache,
                              use_cache=True).logits
            logits = torch.cat([first_logits.expand(len(todo), -1, -1), rest], dim=1)
        else:
            logits = first_logits.expand(len(todo), -1, -1)
        logp = torch.log_softmax(logits.float() / self.temperature, dim=-1)
        for r, (k, t, need) in enumerate(todo):
            lps = list(t.old_logprobs)
            for i in need:
                lps[i] = float(logp[r, i, t.response_ids[i]])
            result[k] = replace(t, old_logprobs=lps, tokens_forwarded=len(inputs[r]))
        return result


class SGLangRecompute:
    def __init__(self, url: str, temperature: float = 1.0) -> None:
        from rollout_gen.engines.sglang import SGLangEngine

        self.engine = SGLangEngine(url)
        self.temperature = temperature

    def group(self, trajectories: list[PurifiedTrajectory]) -> list[PurifiedTrajectory]:
        todo = [(k, t, _needs(t)) for k, t in enumerate(trajectories)]
        todo = [(k, t, need) for k, t, need in todo if need]
        if not todo:
            return trajectories
        seqs = [t.prompt_ids + t.response_ids[: need[-1] + 1] for _, t, need in todo]
        starts = [len(t.prompt_ids) + need[0] for _, t, need in todo]
        scores = self.engine.score(seqs, starts, self.temperature)
        result = list(trajectories)
        for (k, t, need), s, start in zip(todo, scores, starts):
            lps = list(t.old_logprobs)
            for i in need:
                lps[i] = s[len(t.prompt_ids) + i - start]
            result[k] = replace(t, old_logprobs=lps, tokens_forwarded=len(s))
        return result
