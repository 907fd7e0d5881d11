"""The tool-use world: tasks, rewards, corpus, a short real bootstrap, and the committed policy."""

from __future__ import annotations

import json
import random

import pytest
import torch
from transformers import AutoModelForCausalLM

from pipeline.config import DEFAULT_POLICY, SandboxConfig, WorldConfig, load_config
from rollout_gen.agent import AgentLoop, RolloutIdentity
from flows.eval_cmd import METRICS_FILE, TIMING_FIELDS, evaluate_world
from rollout_gen.rewards import math_reward, overlong_penalty
from pipeline.answers import last_boxed
from rollout_gen.sandbox import SandboxPool
from rollout_gen.stage import make_engine
from pipeline.chat import load_chat
from flows.bootstrap import BootstrapConfig, bootstrap
from rollout_gen.world.corpus import make_transcript
from rollout_gen.world.tasks import eval_tasks, make_task, training_tasks
from trainer.sft import SFTConfig
from tests.plain_forward import sequence_logprobs


def test_tasks_have_exact_answers_and_a_fixed_held_out_set():
    cfg = WorldConfig()
    held = eval_tasks(cfg)
    assert len(held) == cfg.eval_size and held == eval_tasks(cfg)
    assert not {t.question for t in training_tasks(cfg, 500, seed=1)} & {t.question for t in held}
    two_step = [t for t in held if "then" in t.question.lower()]
    assert two_step, "some tasks need two tool calls"
    rng = random.Random(0)
    for _ in range(50):
        t = make_task(rng, cfg)
        assert t.ground_truth.lstrip("-").isdigit()


def test_strict_boxed_reward():
    assert math_reward("so \\boxed{42}.<|im_end|>", "42") == 1.0
    assert math_reward("\\boxed{42} then \\boxed{41}", "42") == -1.0  # the last box counts
    assert math_reward("\\boxed{42}" + "x" * 200, "42") == -1.0  # only the final 100 characters
    assert math_reward("no box", "42") == -1.0
    assert last_boxed("a \\boxed{ 7 }") == "7"
    assert overlong_penalty(100, 200, 50) == 0.0 and overlong_penalty(175, 200, 50) == -0.5


def test_corpus_outputs_come_from_running_the_code():
    cfg = WorldConfig()
    with SandboxPool(SandboxConfig(workers=1)) as pool:
        tasks = training_tasks(cfg, 30, seed=3)
        transcripts = [make_transcript(t, random.Random(i), pool, bug_rate=1.0) for i, t in enumerate(tasks)]
    assert all(t.first_call_failed for t in transcripts)  # bug_rate 1: every first call fails for real
    text = "".join(s for t in transcripts for s, _ in t.segments)
    assert "Tool call failure" in text and "Error" in text
    assert sum(t.deep_retries for t in transcripts) and sum(t.retries - t.deep_retries for t in transcripts)
    for t in transcripts:  # the final answer copies the real stdout of the last successful call
        assert f"\\boxed{{{t.task.ground_truth}}}" in t.segments[-1][0]


def test_short_bootstrap_trains_saves_and_generates(tmp_path):
    out = tmp_path / "policy"
    prov = bootstrap(out, BootstrapConfig(corpus_size=60, sft=SFTConfig(steps=40, log_every=10)), log=lambda *_: None)
    losses = [loss for _, loss in prov["losses"]]
    assert losses[-1] < losses[0]
    assert (out / "PROVENANCE.json").exists() and (out / "model.safetensors").exists()
    cfg = load_config(None, ["rollout.samples_per_prompt=1", "rollout.max_turn_tokens=24"])
    chat = load_chat(out)
    with SandboxPool(cfg.rollout.sandbox) as sandbox:
        trajs = AgentLoop(make_engine(cfg, out, chat), sandbox, chat, cfg.rollout).run(
            eval_tasks(cfg.world)[:2], RolloutIdentity("b", 0, "v")
        )
    # the saved checkpoint is what generated: every sampled turn's log-probs are those of a plain forward of the
    # weights on disk (another model, or the weights before training, gives others), and every token is counted
    model = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32, attn_implementation="eager").eval()
    for t in trajs:
        turns = [a for p in t.positions for a in p.attempts] + ([t.final_turn] if t.final_turn else [])
        assert turns and t.stats.generated_tokens == sum(len(a.turn_ids) for a in turns)
        first = turns[0]  # sampled right after the prompt
        ref = sequence_logprobs(model, t.prompt_ids + first.turn_ids, start=len(t.prompt_ids))
        assert max(abs(r - lp) for r, lp in zip(ref, first.logprobs)) <= 1e-4


def test_committed_policy_metrics_are_reproduced_and_in_range():
    stored = json.loads((DEFAULT_POLICY / METRICS_FILE).read_text())
    fresh = evaluate_world(load_config(None), DEFAULT_POLICY, show_progress=False)
    for key in stored:
        if key not in TIMING_FIELDS:
            assert (
                fresh[key] == pytest.approx(stored[key])
                if isinstance(stored[key], float)
                else fresh[key] == stored[key]
            ), key
    assert fresh["trajectories"] >= 200
    assert fresh["well_formed_call_rate"] >= 0.95
    assert 0.10 <= fresh["first_call_failure_rate"] <= 0.45
    assert fresh["retry_success_rate"] >= 0.50
    assert 0.30 <= fresh["accuracy"] <= 0.95
