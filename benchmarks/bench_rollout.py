"""Rollout phase: CPU engine vs transformers `generate`, the sandbox pool vs a fresh process per
call, and the wall-time overhead of live SAAR retries (live mode `purified` vs `raw`)."""
from __future__ import annotations

import statistics
import time

import torch

from benchmarks.common import BenchResult, Row, best_of
from pipeline.config import DEFAULT_POLICY, load_config
from rollout_gen.agent import AgentLoop, RolloutIdentity
from rollout_gen.engines.base import SamplingParams
from rollout_gen.engines.cpu import CPUEngine
from rollout_gen.sandbox import SandboxPool, run_fresh_process
from rollout_gen.stage import load_chat
from rollout_gen.world.tasks import eval_tasks, training_tasks


def _engine_vs_generate(rows: list[Row], notes: list[str]) -> None:
    cfg = load_config(None)
    chat = load_chat(DEFAULT_POLICY)
    tasks = training_tasks(cfg.world, 16, seed=7)
    prompts = [chat.prompt_ids(t.question) for t in tasks for _ in range(4)]
    stop = tuple(sorted(chat.stop_ids))
    max_new = 96
    engine = CPUEngine(DEFAULT_POLICY)
    model = engine.model
    counted = {}

    def ours() -> None:
        gens = engine.generate(prompts, SamplingParams(max_new, 1.0, 1.0, stop), seeds=list(range(len(prompts))),
                               shared_prefix=[len(p) for p in prompts])
        counted["ours"] = sum(len(g.output_ids) for g in gens)

    pad = chat.tokenizer.pad_token_id
    width = max(len(p) for p in prompts)
    ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts])
    mask = (torch.arange(width)[None, :] >= torch.tensor([width - len(p) for p in prompts])[:, None]).long()

    def hf() -> None:
        torch.manual_seed(0)
        with torch.inference_mode():
            out = model.generate(input_ids=ids, attention_mask=mask, do_sample=True, temperature=1.0, top_p=1.0,
                                 top_k=0, max_new_tokens=max_new, eos_token_id=list(stop), pad_token_id=pad)
        new = out[:, width:]
        n = 0
        for row in new.tolist():
            k = next((i + 1 for i, t in enumerate(row) if t in stop), len(row))
            n += k
        counted["hf"] = n

    t_ours, t_hf = best_of(ours), best_of(hf)
    ours_tps, hf_tps = counted["ours"] / t_ours, counted["hf"] / t_hf
    rows.append(Row("CPU engine generation (64 rows, single turn, with log-probs)", ours_tps, hf_tps, "tokens/s",
                    target=">= 1.0× transformers generate", passed=ours_tps >= hf_tps))
    notes.append(f"engine vs generate: {len(prompts)} prompts (16 tasks × 4 samples), max {max_new} new tokens, "
                 f"T=1.0, stop on <|im_end|>; tokens counted up to each row's stop ({counted['ours']} vs "
                 f"{counted['hf']}); the engine also returns every token's log-prob, generate does not.")


def _sandbox(rows: list[Row], notes: list[str], calls: int = 300) -> None:
    code = "print(6 * 7)"
    with SandboxPool() as pool:
        pool.run_many([code] * 20)  # warm
        lat = []

        def one() -> None:
            t = time.perf_counter()
            r = pool.run(code)
            lat.append(time.perf_counter() - t)
            assert r.status == "success"

        t0 = time.perf_counter()
        pool.run_many([code] * calls)
        pool_cps = calls / (time.perf_counter() - t0)
        for _ in range(200):
            one()
    base_n = 60
    t0 = time.perf_counter()
    for _ in range(base_n):
        run_fresh_process(code)
    fresh_cps = base_n / (time.perf_counter() - t0)
    lat.sort()
    rows.append(Row("sandbox pool throughput (2 workers, each call a fresh forked child)", pool_cps, fresh_cps,
                    "calls/s", target=">= 5× fresh `python -c`", passed=pool_cps >= 5 * fresh_cps))
    rows.append(Row("sandbox p50 latency", statistics.median(lat) * 1e3, None, "ms", higher_is_better=False))
    rows.append(Row("sandbox p99 latency", lat[int(0.99 * len(lat)) - 1] * 1e3, None, "ms", higher_is_better=False))
    notes.append(f"baseline: {base_n} sequential `python -c` processes ({1e3 / fresh_cps:.0f} ms each)")


def _saar_overhead(rows: list[Row], notes: list[str]) -> None:
    chat = load_chat(DEFAULT_POLICY)
    times = {}
    stats = {}
    for mode in ("raw", "purified"):
        cfg = load_config(None, [f"rollout.saar.live_mode={mode}", "rollout.samples_per_prompt=4"])
        tasks = eval_tasks(cfg.world)[:32]
        engine = CPUEngine(DEFAULT_POLICY)
        with SandboxPool(cfg.rollout.sandbox) as sandbox:
            loop = AgentLoop(engine, sandbox, chat, cfg.rollout)
            t0 = time.perf_counter()
            trajs = loop.run(tasks, RolloutIdentity("bench", 0, "v"))
            times[mode] = time.perf_counter() - t0
        stats[mode] = sum(t.stats.retries for t in trajs)
    rows.append(Row("rollout wall time, live mode purified (SAAR splices)", times["purified"], times["raw"], "s",
                    higher_is_better=False, target="reported (baseline: live mode raw)"))
    notes.append(f"SAAR overhead: 32 tasks × 4 samples; retries: purified {stats['purified']}, raw {stats['raw']}")


def run() -> BenchResult:
    torch.set_num_threads(1)
    rows: list[Row] = []
    notes: list[str] = []
    _engine_vs_generate(rows, notes)
    _sandbox(rows, notes)
    _saar_overhead(rows, notes)
    return BenchResult("rollout", "Rollout phase on the committed tiny policy (one torch thread).", rows, notes)
