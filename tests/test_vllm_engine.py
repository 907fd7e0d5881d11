"""The vLLM client (pipeline/engines/vllm.py) against vLLM's real CPU server: sampled and scored log-probs are
the checkpoint's, a trajectory's turns reuse the server's prefix cache, weights follow the policy after an
update (prefix cache included), purify.recompute=vllm fills exactly the re-contexted tokens, and bad input
(a server that is down, another model, too long a context, a temperature prompt log-probs cannot honour) is
one line each."""

from __future__ import annotations

import random
import socket

import pytest
import torch
from transformers import AutoModelForCausalLM

from pipeline.chat import load_chat
from pipeline.config import DEFAULT_POLICY, load_config
from pipeline.engines.base import Request, SamplingParams
from pipeline.engines.vllm import VLLMEngine, VLLMMismatch, VLLMUnavailable, connect
from pipeline.trajectory import PurifiedTrajectory
from purifier.recompute import CPURecompute, VLLMRecompute
from rollout_gen.agent import AgentLoop, RolloutIdentity
from rollout_gen.sandbox import SandboxPool
from rollout_gen.world.tasks import eval_tasks
from tests.vllm_helpers import perturbed_copy, requires_vllm, shared_url

pytestmark = requires_vllm
TOL = 1e-4  # fp32 server vs fp32 transformers (float64 log_softmax); measured max ≈ 3e-5 here


@pytest.fixture(scope="module")
def url():
    return shared_url()


@pytest.fixture()
def engine(url):
    e = VLLMEngine([url], DEFAULT_POLICY, max_in_flight=8)
    e.serve(DEFAULT_POLICY)  # an earlier test (or flow) may have left another checkpoint loaded
    yield e
    e.close()


def _forward(checkpoint, sequences: list[list[int]]) -> list[list[float]]:
    """log p(s[k] | s[:k]) for k ≥ 1, from one plain full forward (float64 log_softmax)."""
    model = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32, attn_implementation="eager").eval()
    out = []
    for s in sequences:
        with torch.no_grad():
            lp = torch.log_softmax(model(torch.tensor([s])).logits[0].double(), -1)
        out.append([lp[k - 1, s[k]].item() for k in range(1, len(s))])
    return out


def test_sampled_and_scored_log_probs_are_the_checkpoints(engine):
    chat = load_chat(DEFAULT_POLICY)
    contexts = [chat.prompt_ids(t.question) for t in eval_tasks(load_config(None, []).world)[:8]]
    params = SamplingParams(80, 1.0, 1.0, tuple(sorted(chat.stop_ids)))
    gens = engine.generate(contexts, params, seeds=list(range(8)), shared_prefix=[len(c) for c in contexts])
    seqs = [c + g.output_ids for c, g in zip(contexts, gens)]
    refs = _forward(DEFAULT_POLICY, seqs)
    scored = engine.score(seqs, [len(c) for c in contexts])
    for c, g, ref, sc in zip(contexts, gens, refs, scored):
        want = ref[len(c) - 1 :]
        assert len(g.logprobs) == len(g.output_ids) == len(sc)
        assert max(abs(a - b) for a, b in zip(want, g.logprobs)) <= TOL
        assert max(abs(a - b) for a, b in zip(want, sc)) <= TOL
        assert g.finish_reason == "length" or g.output_ids[-1] in chat.stop_ids  # the stop id is kept, as sampled


def test_a_trajectorys_turns_reuse_the_servers_prefix_cache(url):
    """Turn k+1's context extends turn k's: the server reports the earlier turns as cached (in 128-token blocks on
    the CPU build), and a key's turns all go to its one server."""
    cfg = load_config(
        None,
        [
            "rollout.engine=vllm",
            f"rollout.vllm_urls=[{url}]",
            "rollout.samples_per_prompt=4",
            "rollout.max_response_tokens=512",
            "rollout.engine_tuning.max_in_flight=16",
        ],
    )
    chat = load_chat(DEFAULT_POLICY)
    engine = connect(cfg.rollout, DEFAULT_POLICY, chat.tokenizer)
    try:
        with SandboxPool(cfg.rollout.sandbox) as sandbox:
            trajs = AgentLoop(engine, sandbox, chat, cfg.rollout).run(
                eval_tasks(cfg.world)[:8], RolloutIdentity("c", 0, "v")
            )
    finally:
        engine.close()
    assert len(trajs) == 32 and not any(t.finish_reason.startswith("agent_error") for t in trajs)
    assert engine.stats["cached_tokens"] >= 128 and engine.stats["generated_tokens"] > 0
    assert not engine.router._of  # every trajectory released its server


def test_weights_follow_the_policy_and_the_prefix_cache_does_not_outlive_them(engine, tmp_path):
    """After serve(new) the server's log-probs of a fixed sequence are the new checkpoint's forward within TOL,
    also through a prefix cached under the old weights (reload_weights keeps the cache; cleaner resets it), and
    through a tied lm_head (which vLLM's CPU reload alone leaves at the old weights)."""
    new = perturbed_copy(DEFAULT_POLICY, tmp_path / "perturbed", 0.02)
    chat = load_chat(DEFAULT_POLICY)
    context = chat.prompt_ids("What is 12 + 30?") + chat.encode("Let me compute it. " * 30)  # > 2 cache blocks
    params = SamplingParams(20, 1.0, 1.0, tuple(sorted(chat.stop_ids)))
    engine.generate([context], params, [1], [len(context)])  # cached under the old weights
    engine.serve(new)
    (gen,) = engine.generate([context], params, [1], [len(context)])
    seq = context + gen.output_ids
    (ref_new,), (ref_old,) = _forward(new, [seq]), _forward(DEFAULT_POLICY, [seq])
    sampled_new = ref_new[len(context) - 1 :]
    assert max(abs(a - b) for a, b in zip(sampled_new, gen.logprobs)) <= TOL
    (scored,) = engine.score([seq], [1])
    assert max(abs(a - b) for a, b in zip(ref_new, scored)) <= TOL
    assert max(abs(a - b) for a, b in zip(ref_old, scored)) > 100 * TOL  # not the old weights
    before = engine.stats["prompt_tokens"]
    engine.serve(new)  # already served: nothing reloaded, the cache is kept
    engine.generate([context], params, [1], [len(context)])
    assert engine.stats["prompt_tokens"] > before
    engine.serve(DEFAULT_POLICY)


def _row(prompt, response, needs, k=0, mask=None):
    mask = mask or [1] * len(response)
    valid = [0 if i in needs else 1 for i in range(len(response))]
    return PurifiedTrajectory(
        "r",
        0,
        "p0",
        k,
        "saar",
        0.5,
        f"k{k}",
        prompt,
        response,
        mask,
        [-123.0] * len(response),
        valid,
        1.0,
        0.5,
        [],
        min(needs, default=-1),
        0,
        True,
    )


def test_vllm_recompute_fills_exactly_the_needed_tokens_and_agrees_with_the_cpu_recompute(url):
    chat = load_chat(DEFAULT_POLICY)
    prompt = chat.prompt_ids("What is 12 + 30?")
    rng = random.Random(0)
    resp = [[rng.randrange(5, 300) for _ in range(n)] for n in (9, 6, 7, 5)]
    rows = [
        _row(prompt, resp[0], {2, 3, 6}),
        _row(prompt, resp[1], set(), k=1),
        _row(prompt, resp[2], {0, 4}, k=2),
        _row(prompt, resp[3], {1, 2}, k=3, mask=[1, 0, 1, 1, 1]),
    ]
    backend = VLLMRecompute([url], DEFAULT_POLICY)
    try:
        got = backend.group(rows)
    finally:
        backend.engine.close()
    cpu = CPURecompute(DEFAULT_POLICY, threads=None).group(rows)
    assert got[1] is rows[1]
    for row, a, b in zip(rows, got, cpu):
        for i, (m, v) in enumerate(zip(row.loss_mask, row.logprob_valid)):
            if m and not v:
                assert abs(a.old_logprobs[i] - b.old_logprobs[i]) <= TOL
            else:
                assert a.old_logprobs[i] == -123.0
    assert [t.tokens_forwarded for t in got] == [5, 0, 5, 1]
    # vLLM 0.32 never reads its prefix cache for a request with prompt_logprobs: nothing reported reused
    assert backend.engine.stats["score_prompt_tokens"] > 0 and backend.engine.stats["score_cached_tokens"] == 0


# ---- bad input: one line each -----------------------------------------------------------------------------


def _one_line(e: pytest.ExceptionInfo) -> str:
    msg = str(e.value)
    assert "\n" not in msg and len(msg) < 400
    return msg


def test_a_server_that_is_down_is_one_line():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with pytest.raises(VLLMUnavailable) as e:
        VLLMEngine([f"http://127.0.0.1:{port}"], DEFAULT_POLICY)
    assert f"127.0.0.1:{port} is unreachable" in _one_line(e)


def test_a_server_of_another_model_is_one_line(url):
    other = DEFAULT_POLICY.parent / "qwen3-tokenizer"  # the real Qwen3 tokenizer: the server's ids mean other text
    with pytest.raises(VLLMMismatch) as e:
        VLLMEngine([url], other)
    assert "tokenizer" in _one_line(e) and url in str(e.value) and str(other) in str(e.value)


def test_a_context_longer_than_the_servers_is_one_line(url):
    cfg = load_config(None, ["rollout.engine=vllm", f"rollout.vllm_urls=[{url}]", "rollout.max_response_tokens=2048"])
    with pytest.raises(VLLMMismatch) as e:
        connect(cfg.rollout, DEFAULT_POLICY)
    msg = _one_line(e)
    assert "2304 tokens" in msg and "max_model_len 1024" in msg and "rollout.max_response_tokens" in msg


def test_settings_vllm_cannot_honour_are_one_line(engine, url):
    with pytest.raises(VLLMMismatch, match="rollout.temperature=1.0") as e:
        engine.score([[1, 2, 3]], [1], temperature=0.7)
    _one_line(e)
    cfg = load_config(
        None,
        ["rollout.engine=vllm", f"rollout.vllm_urls=[{url}]", "rollout.max_response_tokens=512", "rollout.top_p=0.9"],
    )
    with pytest.raises(VLLMMismatch, match="rollout.top_p=0.9") as e:
        connect(cfg.rollout, DEFAULT_POLICY)
    _one_line(e)


def test_requests_carry_the_trajectory_key_to_one_server(engine):
    """The scheduler's add/step path: every request of a key goes through `on_route` with that key."""
    chat = load_chat(DEFAULT_POLICY)
    seen = []
    engine.on_route = lambda key, idx: seen.append((key, idx))
    params = SamplingParams(8, 1.0, 1.0, tuple(sorted(chat.stop_ids)))
    prompt = chat.prompt_ids("What is 1 + 2?")
    engine.add([Request(("t", i), tuple(prompt), params, i, len(prompt)) for i in range(3)])
    done = []
    while engine.busy():
        done += engine.step()
    assert sorted(r.key for r, _ in done) == [("t", 0), ("t", 1), ("t", 2)] and {k for k, _ in seen} == {
        ("t", 0),
        ("t", 1),
        ("t", 2),
    }
