"""SGLang as the rollout engine and log-prob scorer (its /generate API), token-in/token-out.

Over HTTP (`python -m sglang.launch_server --model-path M --port 30000`, or an sglang-router in
front of several servers) or in-process with `sglang.Engine` where sglang is installed. Both return
the same dicts: `output_ids` (stop token included), `meta_info.output_token_logprobs` as
`(logprob, token_id, text|None)` and `meta_info.finish_reason` {"type": "stop"|"length", ...}.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Hashable

from pipeline.engines.base import Generation, SamplingParams
from pipeline.engines.served import ServerRefused, ServerUnavailable, http_json

LAUNCH_HINT = "start one with: python -m sglang.launch_server --model-path <checkpoint> --port 30000"


class SGLangUnavailable(ServerUnavailable):
    """No SGLang server answers at the configured URL (or sglang is not installed)."""


def sampling_params(params: SamplingParams, seed: int | None = None) -> dict:
    sp: dict[str, Any] = {
        "max_new_tokens": params.max_new_tokens,
        "temperature": params.temperature,
        "top_p": params.top_p,
        "stop_token_ids": list(params.stop_ids),
        "skip_special_tokens": False,
        "no_stop_trim": True,
    }
    if seed is not None:
        sp["sampling_seed"] = seed  # honoured when the server runs with deterministic inference
    return sp


def parse_generation(result: dict, stop_ids: tuple[int, ...]) -> Generation:
    ids = list(result["output_ids"])
    meta = result.get("meta_info", {})
    lps = [float(entry[0]) for entry in meta.get("output_token_logprobs", [])]
    if len(lps) != len(ids):
        raise ValueError(f"SGLang returned {len(ids)} output ids but {len(lps)} log-probs")
    kind = (meta.get("finish_reason") or {}).get("type", "length")
    finish = "stop" if kind == "stop" or (ids and ids[-1] in stop_ids) else "length"
    return Generation(ids, lps, finish)


def parse_scores(result: dict, start: int) -> list[float]:
    """Log-probs of S[start:] from a prefill with logprob_start_len = start − 1 (entry 0 is None)."""
    entries = result["meta_info"]["input_token_logprobs"]
    return [float(e[0]) for e in entries[1:]] if start > 0 else [float(e[0]) for e in entries if e[0] is not None]


class SGLangEngine:
    # The agent loop sends each trajectory's turn as its own request, many in flight
    # (rollout.engine_tuning.max_in_flight), so the server batches them continuously and its radix cache keeps
    # each trajectory's prefix between turns; `generate` is thread-safe (one HTTP call per call).
    concurrent_requests = True

    def __init__(
        self,
        url: str | None = None,
        checkpoint: Path | None = None,
        timeout_s: float = 600.0,
        in_process: bool = False,
        **engine_kwargs: Any,
    ) -> None:
        self.url = (url or "").rstrip("/")
        self.timeout_s = timeout_s
        self.checkpoint = checkpoint
        self._engine = None
        if in_process:
            try:
                import sglang  # noqa: F401  (optional extra; not installable beside openrlhf)
            except ImportError as e:
                raise SGLangUnavailable(
                    "in-process SGLang needs the `sglang` extra (pip install cleaner[sglang])"
                ) from e
            self._engine = sglang.Engine(model_path=str(checkpoint), **engine_kwargs)
        else:
            self.health()

    # ---- transport ----------------------------------------------------------------------------
    def _post(self, route: str, payload: dict | None = None, method: str = "POST", timeout: float | None = None) -> Any:
        return http_json(
            self.url,
            route,
            payload,
            method,
            timeout or self.timeout_s,
            name="SGLang",
            hint=LAUNCH_HINT,
            unavailable=SGLangUnavailable,
        )

    def health(self) -> None:
        try:
            self._post("/health", method="GET", timeout=10)
        except ServerRefused as e:
            raise SGLangUnavailable(f"SGLang server at {self.url} is unhealthy ({e})") from None

    def _generate(self, payload: dict) -> list[dict]:
        if self._engine is not None:
            out = self._engine.generate(**payload)
        else:
            out = self._post("/generate", payload)
        return out if isinstance(out, list) else [out]

    # ---- the engine protocol ------------------------------------------------------------------
    def generate(
        self,
        contexts: list[list[int]],
        params: SamplingParams,
        seeds: list[int],
        shared_prefix: list[int] | None = None,
    ) -> list[Generation]:
        if not contexts:
            return []
        # RadixAttention shares prompt prefixes by itself; shared_prefix needs no handling here.
        payload = {
            "input_ids": contexts,
            "sampling_params": [sampling_params(params, s) for s in seeds],
            "return_logprob": True,
        }
        return [parse_generation(r, params.stop_ids) for r in self._generate(payload)]

    def score(self, sequences: list[list[int]], starts: list[int], temperature: float = 1.0) -> list[list[float]]:
        """Log-probs of sequences[i][starts[i]:], prefilling with the cached prefix reused."""
        payload = {
            "input_ids": sequences,
            "sampling_params": [{"max_new_tokens": 0, "temperature": temperature} for _ in sequences],
            "return_logprob": True,
            "logprob_start_len": [max(0, s - 1) for s in starts],
        }
        return [parse_scores(r, s) for r, s in zip(self._generate(payload), starts)]

    def score_turn(
        self, context: list[int], turn: list[int], temperature: float = 1.0, key: Hashable | None = None
    ) -> list[float]:
        """log π(turn | context) per token (live importance-ratio rollbacks): a prefill on the prefix the
        server's radix cache holds (whatever `key`)."""
        return self.score([list(context) + list(turn)], [len(context)], temperature)[0]

    def serve(self, checkpoint: Path) -> None:
        """Make the server sample from `checkpoint`: its weights are reloaded unless `/get_model_info` says it
        already serves that path (a rollout after an update must not sample from the previous policy)."""
        served = None
        if self._engine is None:
            try:
                served = (self._post("/get_model_info", method="GET") or {}).get("model_path")
            except RuntimeError:  # a server without the route: reload to be sure
                served = None
        elif self.checkpoint is not None:
            served = str(self.checkpoint)
        if served is None or Path(served).resolve() != Path(checkpoint).resolve():
            self.update_weights(checkpoint)
        self.checkpoint = checkpoint

    def update_weights(self, checkpoint: Path) -> None:
        if self._engine is not None:
            self._engine.update_weights_from_disk(str(checkpoint))
        else:
            out = self._post("/update_weights_from_disk", {"model_path": str(checkpoint)})
            if isinstance(out, dict) and out.get("success") is False:
                raise RuntimeError(f"SGLang could not load {checkpoint}: {out.get('message')}")
        self.checkpoint = checkpoint

    def close(self) -> None:
        if self._engine is not None:
            self._engine.shutdown()
            self._engine = None
