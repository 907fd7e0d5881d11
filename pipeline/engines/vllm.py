"""vLLM as the rollout engine and log-prob scorer, token-in/token-out over its OpenAI-compatible server.

Every turn is one `/v1/completions` call whose prompt is the trajectory's token ids (never re-rendered)
and whose answer carries the sampled ids (`return_token_ids`) and their log-probs (`logprobs: 0`); the
server's prefix cache (`--enable-prefix-caching`) reuses the trajectory's earlier turns, which is why each
trajectory stays on one server (served.StickyRouter). Scoring (live importance ratios, purify.recompute=vllm)
is a prefill with `prompt_logprobs: 0` and one throw-away output token.

Facts from vLLM 0.32.0's source (the venv scripts/setup_vllm.sh builds) that shape this client:
- sampled log-probs are of the raw logits unless the server runs with `--logprobs-mode processed_logprobs`
  (then of logits / T; also renormalised over top-k/top-p, hence top_p must be 1 here);
- prompt log-probs never see the temperature, and a request that asks for them never *reads* the prefix
  cache (SamplingParams sets skip_reading_prefix_cache): scoring is a full prefill, `cached_tokens` 0;
- `reload_weights` (collective_rpc, dev mode) loads a checkpoint directory in place (0.1 s for the tiny
  policy, a restart takes 35–50 s) but leaves the prefix cache holding KV of the old weights (reset after every
  reload) and, on the CPU build, a tied lm_head serving the old weights (cleaner's worker extension,
  vllm_ext/cleaner_vllm_ext.py, prepares it again: `load_checkpoint`);
- the checkpoint's EOS also stops generation unless `ignore_eos`: only the chat's stop ids stop here, as
  in the CPU engine.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Hashable

from pipeline.engines.base import Generation, Request, SamplingParams
from pipeline.engines.vllm_server import (
    EXTENSION_DIR,
    WORKER_EXTENSION,
    checkpoint_config,
    cpu_head_problem,
    server_log,
)
from pipeline.engines.served import ConcurrentTurns, ServerRefused, ServerUnavailable, StickyRouter, http_json
from storage.checkpoints import policy_version
from storage.errors import CleanerError

LAUNCH_HINT = (
    "start one with: VLLM_SERVER_DEV_MODE=1 python -m vllm.entrypoints.openai.api_server --model "
    "<checkpoint> --enable-prefix-caching --logprobs-mode processed_logprobs (the CPU build's further "
    "flags: docs/scale_out.md), or leave rollout.vllm_urls empty and cleaner starts it"
)
PROBE = 'What is 12 + 30?\n<tool_call>{"name": "python", "arguments": {"code": "print(6 * 7)"}}</tool_call> ünï'


_SCORE = object()  # the key of a scoring request that belongs to no trajectory


class VLLMUnavailable(ServerUnavailable):
    """No vLLM server answers at a configured URL."""


class VLLMMismatch(CleanerError, ValueError):
    """A vLLM server cannot serve this rollout as configured (another model, too short a context, …)."""


@dataclass
class _Server:
    url: str
    model: str  # the served model name every request must carry
    root: str  # the path it was started with
    max_model_len: int
    config: dict | None  # its VllmConfig from /server_info (dev mode only)

    def setting(self, section: str, key: str) -> object:
        return ((self.config or {}).get(section) or {}).get(key)


class VLLMEngine(ConcurrentTurns):
    # Scheduler (rollout_gen/scheduler.py) drives this through add/step/busy/release: requests carry the
    # trajectory's key, which pins the trajectory to one server.
    concurrent_requests = True

    def __init__(
        self,
        urls: list[str],
        checkpoint: Path,
        *,
        tokenizer: Any = None,
        max_context: int | None = None,
        max_in_flight: int = 64,
        deterministic: bool = True,
        timeout_s: float = 600.0,
    ) -> None:
        if not urls:
            raise VLLMMismatch(
                "no vLLM server to use: set rollout.vllm_urls or leave it empty for cleaner to start one"
            )
        self.checkpoint = Path(checkpoint)
        self.timeout_s = timeout_s
        self.servers = [self._connect(u.rstrip("/")) for u in urls]
        self.router = StickyRouter(len(self.servers))
        self.on_route: Callable[[Hashable, int], None] | None = None  # sees every (key, server) choice: tests, reports
        self._lock = threading.Lock()
        self.stats = {
            "prompt_tokens": 0,
            "cached_tokens": 0,
            "generated_tokens": 0,
            "scored_tokens": 0,
            "score_prompt_tokens": 0,
            "score_cached_tokens": 0,
            "failovers": 0,
        }
        for s in self.servers:
            if max_context and max_context > s.max_model_len:
                raise VLLMMismatch(
                    f"rollout.max_prompt_tokens + rollout.max_response_tokens = {max_context} tokens "
                    f"does not fit the vLLM server at {s.url} (max_model_len {s.max_model_len}): lower "
                    f"them or start it with --max-model-len {max_context}"
                )
            if s.setting("device_config", "device") == "cpu" and (problem := cpu_head_problem(self.checkpoint)):
                raise VLLMMismatch(f"vLLM server at {s.url}: {problem}")
            self._check_tokenizer(s, tokenizer)
        self._init_turns(max_in_flight, deterministic)

    # ---- transport ----------------------------------------------------------------------------
    def _call(
        self, url: str, route: str, payload: Any = None, method: str = "POST", timeout: float | None = None
    ) -> Any:
        try:
            return http_json(
                url,
                route,
                payload,
                method,
                timeout or self.timeout_s,
                name="vLLM",
                hint=LAUNCH_HINT,
                unavailable=VLLMUnavailable,
            )
        except (ServerRefused, VLLMUnavailable) as e:
            managed = server_log(url)
            if managed is None:
                raise
            # a server cleaner started: its log holds the cause, and the launch hint is for servers of one's own
            said = str(e).removesuffix(f"; {LAUNCH_HINT}")
            raise type(e)(f"{said}; the server cleaner started says: {managed[1]} (log: {managed[0]})") from None

    def _connect(self, url: str) -> _Server:
        try:
            self._call(url, "/health", method="GET", timeout=10)
        except ServerRefused as e:
            raise VLLMUnavailable(f"vLLM server at {url} is unhealthy ({e})") from None
        models = (self._call(url, "/v1/models", method="GET", timeout=30) or {}).get("data") or []
        if len(models) != 1:
            raise VLLMMismatch(f"vLLM server at {url} serves {len(models)} models; cleaner needs exactly one")
        m = models[0]
        try:
            config = (self._call(url, "/server_info?config_format=json", method="GET", timeout=60) or {})["vllm_config"]
        except (ServerRefused, KeyError, TypeError):
            config = None  # not in dev mode
        s = _Server(url, m["id"], str(m.get("root") or m["id"]), int(m.get("max_model_len") or 0), config)
        if s.setting("device_config", "device") == "cpu" and s.setting("scheduler_config", "enable_chunked_prefill"):
            raise VLLMMismatch(
                f"vLLM server at {url} is the CPU build with chunked prefill on, whose engine dies on a "
                "seeded request split across steps (vLLM 0.32): start it with --no-enable-chunked-prefill "
                "--max-num-batched-tokens 4096"
            )
        return s

    def _check_tokenizer(self, s: _Server, tokenizer: Any) -> None:
        """The same text must give the same ids on both sides, or every id sent means something else there."""
        if tokenizer is None:
            from transformers import AutoTokenizer

            tokenizer = AutoTokenizer.from_pretrained(self.checkpoint)
        ours = tokenizer.encode(PROBE, add_special_tokens=False)
        theirs = (
            self._call(s.url, "/tokenize", {"model": s.model, "prompt": PROBE, "add_special_tokens": False}, timeout=30)
            or {}
        ).get("tokens")
        if theirs != ours:
            raise VLLMMismatch(
                f"vLLM server at {s.url} serves {s.root}, whose tokenizer is not that of "
                f"{self.checkpoint} (rollout.policy): start it with --model {self.checkpoint}"
            )

    # ---- sampling -----------------------------------------------------------------------------
    def _complete(self, idx: int, context: list[int], params: SamplingParams, seed: int) -> Generation:
        s = self.servers[idx]
        if len(context) >= s.max_model_len:
            raise VLLMMismatch(
                f"a context of {len(context)} tokens does not fit the vLLM server at {s.url} "
                f"(max_model_len {s.max_model_len}); lower rollout.max_response_tokens"
            )
        out = self._call(
            s.url,
            "/v1/completions",
            {
                "model": s.model,
                "prompt": list(context),
                "max_tokens": params.max_new_tokens,
                "temperature": params.temperature,
                "top_p": params.top_p,
                "top_k": 0,
                "min_p": 0.0,
                "repetition_penalty": 1.0,
                "presence_penalty": 0.0,
                "frequency_penalty": 0.0,
                "seed": seed,
                "stop_token_ids": list(params.stop_ids),
                "ignore_eos": True,
                "skip_special_tokens": False,
                "logprobs": 0,
                "return_token_ids": True,
            },
        )
        choice = out["choices"][0]
        ids = [int(t) for t in choice["token_ids"]]
        lps = [float(x) for x in (choice.get("logprobs") or {}).get("token_logprobs") or []]
        if len(lps) != len(ids):
            raise ServerRefused(f"vLLM server at {s.url} returned {len(ids)} output ids but {len(lps)} log-probs")
        if choice.get("finish_reason") not in ("stop", "length"):
            raise ServerRefused(f"vLLM server at {s.url} ended a request with {choice.get('finish_reason')!r}")
        self._count(out.get("usage") or {}, "prompt_tokens", "cached_tokens", generated=len(ids))
        finish = "stop" if choice["finish_reason"] == "stop" or (ids and ids[-1] in params.stop_ids) else "length"
        return Generation(ids, lps, finish)

    def _count(self, usage: dict, prompt_key: str, cached_key: str, generated: int = 0) -> None:
        cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
        with self._lock:
            self.stats[prompt_key] += int(usage.get("prompt_tokens") or 0)
            self.stats[cached_key] += int(cached)
            self.stats["generated_tokens"] += generated

    def _routed(self, key: Hashable, fn: Callable[[int], Any]) -> Any:
        """fn(server index) on the key's server; a server that stops answering hands its trajectories to the
        others (retried there from the same context), and when none is left the stage fails in one line."""
        while True:
            idx = self.router.pick(key)
            if self.on_route is not None:
                self.on_route(key, idx)
            try:
                return fn(idx)
            except VLLMUnavailable as e:
                if not self.router.mark_down(idx):
                    raise VLLMUnavailable(f"{e} (no other vLLM server left to retry on)") from None
                with self._lock:
                    self.stats["failovers"] += 1

    def _turn(self, request: Request) -> Generation:
        return self._routed(
            request.key, lambda i: self._complete(i, list(request.context), request.params, request.seed)
        )

    def release(self, key: Hashable) -> None:
        self.router.release(key)

    def generate(
        self,
        contexts: list[list[int]],
        params: SamplingParams,
        seeds: list[int],
        shared_prefix: list[int] | None = None,
    ) -> list[Generation]:
        """A batch without trajectory keys (the lockstep loop): rows sharing a prompt stay on one server."""
        prefix = shared_prefix or [0] * len(contexts)
        keys = [("prompt", tuple(c[:p])) if p else ("row", i) for i, (c, p) in enumerate(zip(contexts, prefix))]
        return self.map(
            lambda c, s, k: self._routed(k, lambda i: self._complete(i, c, params, s)), contexts, seeds, keys
        )

    # ---- scoring ------------------------------------------------------------------------------
    def _prompt_logprobs(self, idx: int, sequence: list[int], start: int) -> list[float]:
        s = self.servers[idx]
        if len(sequence) >= s.max_model_len:
            raise VLLMMismatch(
                f"a sequence of {len(sequence)} tokens to score does not fit the vLLM server at "
                f"{s.url} (max_model_len {s.max_model_len})"
            )
        out = self._call(
            s.url,
            "/v1/completions",
            {
                "model": s.model,
                "prompt": list(sequence),
                "max_tokens": 1,
                "temperature": 0.0,
                "ignore_eos": True,
                "prompt_logprobs": 0,
            },
        )
        entries = out["choices"][0]["prompt_logprobs"]
        self._count(out.get("usage") or {}, "score_prompt_tokens", "score_cached_tokens")
        with self._lock:
            self.stats["scored_tokens"] += len(sequence) - start
        return [float(entries[k][str(sequence[k])]["logprob"]) for k in range(start, len(sequence))]

    def score(
        self,
        sequences: list[list[int]],
        starts: list[int],
        temperature: float = 1.0,
        keys: list[Hashable] | None = None,
    ) -> list[list[float]]:
        """Log-probs of sequences[i][starts[i]:] (starts ≥ 1) under the served weights, by prefill."""
        if temperature not in (0.0, 1.0):
            raise VLLMMismatch(
                f"temperature {temperature}: vLLM's prompt log-probs are of the raw logits, so scoring "
                "through vLLM (purify.recompute=vllm, live importance rollbacks) needs "
                "rollout.temperature=1.0"
            )
        if any(s < 1 for s in starts):
            raise ValueError("scoring starts at position 1 or later (the first token has no context)")
        temporary = keys is None  # no trajectory to follow: the least busy server, forgotten afterwards
        keys = keys or [(_SCORE, id(seq)) for seq in sequences]

        def one(seq: list[int], start: int, key: Hashable) -> list[float]:
            try:
                return self._routed(key, lambda i: self._prompt_logprobs(i, seq, start))
            finally:
                if temporary:
                    self.router.release(key)

        if len(sequences) == 1:
            return [one(sequences[0], starts[0], keys[0])]
        return self.map(one, sequences, starts, keys)

    def score_turn(
        self, context: list[int], turn: list[int], temperature: float = 1.0, key: Hashable | None = None
    ) -> list[float]:
        """log π(turn | context) per token, on the trajectory's own server."""
        return self.score(
            [list(context) + list(turn)], [len(context)], temperature, [key] if key is not None else None
        )[0]

    # ---- weights ------------------------------------------------------------------------------
    def serve(self, checkpoint: Path) -> None:
        """Make every server sample from `checkpoint`: its weights are loaded unless the server already holds
        them (the weight version cleaner records on it is the checkpoint's content hash)."""
        checkpoint = Path(checkpoint)
        want = policy_version(checkpoint)
        for s in self.servers:
            try:
                have = (self._call(s.url, "/weight_info", method="GET", timeout=30) or {}).get("weight_version")
            except ServerRefused:  # not in dev mode: it can only serve what it was started with
                if Path(s.root).resolve() != checkpoint.resolve():
                    raise VLLMMismatch(
                        f"vLLM server at {s.url} serves {s.root} and cannot load {checkpoint}: start "
                        "it with VLLM_SERVER_DEV_MODE=1 so each iteration's checkpoint can be loaded"
                    ) from None
                continue
            if have == want:
                continue
            if have == "default" and Path(s.root).resolve() == checkpoint.resolve():
                self._call(s.url, "/update_weight_version", {"new_version": want}, timeout=30)  # started with it
                continue
            self._reload(s, checkpoint, want)
        self.checkpoint = checkpoint

    def update_weights(self, checkpoint: Path) -> None:
        want = policy_version(checkpoint)
        for s in self.servers:
            self._reload(s, Path(checkpoint), want)
        self.checkpoint = Path(checkpoint)

    def _reload(self, s: _Server, checkpoint: Path, version: str) -> None:
        path = str(checkpoint.resolve())
        extension = WORKER_EXTENSION in str(s.setting("parallel_config", "worker_extension_cls") or "")
        if not extension and s.setting("device_config", "device") == "cpu" and _tied(checkpoint):
            raise VLLMMismatch(
                f"vLLM server at {s.url} cannot load {checkpoint} in place: on the CPU build "
                "reload_weights keeps a tied lm_head's old weights (vLLM 0.32); start it with "
                f"--worker-extension-cls {WORKER_EXTENSION} and PYTHONPATH={EXTENSION_DIR}, or leave "
                "rollout.vllm_urls empty so cleaner starts it"
            )
        method = "load_checkpoint" if extension else "reload_weights"
        try:
            self._call(s.url, "/collective_rpc", {"method": method, "kwargs": {"weights_path": path}})
        except ServerRefused as e:
            raise VLLMMismatch(
                f"vLLM server at {s.url} could not load {checkpoint} ({e}); it must be started with "
                "VLLM_SERVER_DEV_MODE=1, on a checkpoint of the same architecture, and read the path"
            ) from None
        # The prefix cache still holds KV computed by the old weights: a later prompt would reuse it.
        for _ in range(50):
            if (self._call(s.url, "/reset_prefix_cache", timeout=30) or {}).get("success", True):
                break
            threading.Event().wait(0.1)  # blocks still held by requests finishing: retry
        else:
            raise VLLMMismatch(f"vLLM server at {s.url} kept refusing /reset_prefix_cache after loading {checkpoint}")
        self._call(s.url, "/update_weight_version", {"new_version": version}, timeout=30)

    def check_tempered_logprobs(self) -> None:
        """At T ≠ 1 the sampled log-probs are of logits / T only on a server with --logprobs-mode processed_logprobs."""
        for s in self.servers:
            mode = s.setting("model_config", "logprobs_mode") or "unknown (no /server_info: not in dev mode)"
            if mode != "processed_logprobs":
                raise VLLMMismatch(
                    f"vLLM server at {s.url} reports log-probs as {mode}: at rollout.temperature ≠ 1 "
                    "they must be of logits / T; start it with --logprobs-mode processed_logprobs"
                )

    def cache_hit_rate(self) -> float:
        return self.stats["cached_tokens"] / max(1, self.stats["prompt_tokens"])

    def close(self) -> None:
        self._close_turns()


def _tied(checkpoint: Path) -> bool:
    cfg = checkpoint_config(checkpoint)
    return True if cfg is None else bool(cfg.get("tie_word_embeddings"))  # unknown: the case that needs the extension


def vllm_urls(rollout: Any, checkpoint: Path, log: Callable[[str], None] | None = None) -> list[str]:
    """rollout.vllm_urls, or the servers this process started (started now when none run yet)."""
    if rollout.vllm_urls:
        return list(rollout.vllm_urls)
    from pipeline.config import DEFAULT_VLLM_VENV
    from pipeline.engines.vllm_server import managed_urls

    # The longest context a rollout builds, not the checkpoint's 32k or 40k: the server sizes its scheduling
    # budget and start-up profiling by it.
    return managed_urls(
        checkpoint,
        count=rollout.vllm_servers,
        venv=rollout.vllm_venv or DEFAULT_VLLM_VENV,
        dtype=rollout.vllm_dtype,
        max_model_len=rollout.max_prompt_tokens + rollout.max_response_tokens,
        extra_args=rollout.vllm_args,
        timeout_s=rollout.engine_tuning.vllm_start_timeout_s,
        log=log,
    )


def connect(
    rollout: Any, checkpoint: Path, tokenizer: Any = None, log: Callable[[str], None] | None = None
) -> VLLMEngine:
    """The engine for rollout.engine=vllm, serving `checkpoint` (reloaded after an update)."""
    if rollout.top_p < 1.0:
        raise VLLMMismatch(
            f"rollout.top_p={rollout.top_p}: vLLM reports log-probs renormalised over the top-p "
            "nucleus, cleaner's are of softmax(logits / T); use rollout.top_p=1.0 with rollout.engine=vllm"
        )
    engine = VLLMEngine(
        vllm_urls(rollout, checkpoint, log),
        checkpoint,
        tokenizer=tokenizer,
        max_context=rollout.max_prompt_tokens + rollout.max_response_tokens,
        max_in_flight=rollout.engine_tuning.max_in_flight,
        deterministic=rollout.engine_tuning.deterministic,
    )
    try:
        if rollout.temperature not in (0.0, 1.0):
            engine.check_tempered_logprobs()
        engine.serve(checkpoint)
    except BaseException:
        engine.close()
        raise
    return engine
