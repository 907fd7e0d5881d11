"""The SGLang client against a contract double of its HTTP API (see sglang_contract_double.py)."""

from __future__ import annotations

import socket

import pytest

from pipeline.config import DEFAULT_POLICY, load_config
from rollout_gen.agent import AgentLoop, RolloutIdentity
from pipeline.engines.base import SamplingParams
from rollout_gen.engines.cpu import CPUEngine
from pipeline.engines.sglang import SGLangEngine, SGLangUnavailable
from rollout_gen.sandbox import SandboxPool
from pipeline.chat import load_chat
from rollout_gen.world.tasks import eval_tasks
from tests.sglang_contract_double import SGLangContractDouble


@pytest.fixture(scope="module")
def server():
    s = SGLangContractDouble(DEFAULT_POLICY)
    yield s
    s.close()


def test_generate_request_and_response_round_trip_the_http_contract(server):
    """What this shows: the client's `/generate` request (token ids, return_logprob, stop ids, seeds)
    and its parsing of the response. It says nothing about SGLang's own sampling: the double *is* the
    CPU engine behind HTTP, so equal outputs mean nothing was lost or reordered on the way."""
    chat = load_chat(DEFAULT_POLICY)
    client = SGLangEngine(server.url)
    contexts = [chat.prompt_ids("What is 12 + 30?"), chat.prompt_ids("Compute 7 * 8.")]
    params = SamplingParams(40, 1.0, 1.0, tuple(sorted(chat.stop_ids)))
    got = client.generate(contexts, params, seeds=[5, 6])
    want = CPUEngine(DEFAULT_POLICY).generate(contexts, params, seeds=[5, 6])
    assert [g.output_ids for g in got] == [w.output_ids for w in want]
    assert [g.finish_reason for g in got] == [w.finish_reason for w in want]
    req = server.requests[-1]
    assert req["return_logprob"] is True and req["input_ids"] == contexts
    assert req["sampling_params"][0]["stop_token_ids"] == sorted(chat.stop_ids)


def test_score_uses_logprob_start_len(server):
    chat = load_chat(DEFAULT_POLICY)
    client = SGLangEngine(server.url)
    seq = chat.prompt_ids("What is 1 + 2?") + chat.encode("Let me compute.")
    start = len(seq) - 4
    (scores,) = client.score([seq], [start])
    assert len(scores) == 4
    assert server.requests[-1]["logprob_start_len"] == [start - 1]
    assert server.requests[-1]["sampling_params"][0]["max_new_tokens"] == 0


@pytest.mark.parametrize("deterministic", [True, False])
def test_agent_loop_sends_each_trajectory_turn_concurrently(server, deterministic):
    cfg = load_config(
        None,
        [
            "rollout.samples_per_prompt=2",
            f"rollout.engine_tuning.deterministic={deterministic}",
            "rollout.engine_tuning.max_in_flight=4",
        ],
    )
    chat = load_chat(DEFAULT_POLICY)
    first = len(server.requests)
    server.max_in_flight = 0
    with SandboxPool(cfg.rollout.sandbox) as sandbox:
        trajs = AgentLoop(SGLangEngine(server.url), sandbox, chat, cfg.rollout).run(
            eval_tasks(cfg.world)[:3], RolloutIdentity("s", 0, "v")
        )
    assert len(trajs) == 6 and all(t.finish_reason for t in trajs)
    sent = [r for r in server.requests[first:] if r["path"] == "/generate"]
    # one request per trajectory turn, several served together, never more than max_in_flight
    assert all(len(r["input_ids"]) == 1 for r in sent)
    assert len(sent) == sum(t.stats.turns + t.stats.retries for t in trajs)
    assert 1 < server.max_in_flight <= 4


def test_update_weights_from_disk(server):
    client = SGLangEngine(server.url)
    client.update_weights(DEFAULT_POLICY)
    assert server.requests[-1] == {"path": "/update_weights_from_disk", "model_path": str(DEFAULT_POLICY)}


def test_unreachable_server_is_one_clear_error():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # closed again: nothing listens there
    with pytest.raises(SGLangUnavailable, match=r"unreachable.*sglang\.launch_server"):
        SGLangEngine(f"http://127.0.0.1:{port}")


def test_each_rollout_makes_the_server_serve_its_checkpoint(server, tmp_path):
    """The flow's rollout of iteration N samples from checkpoint N: the server's weights are reloaded when it
    serves another path (it never was before: iterations ≥ 1 sampled from the initial weights), and left
    alone when it already serves that one."""
    import shutil

    from rollout_gen.stage import run_rollout_stage

    updated = tmp_path / "checkpoints" / "iteration=0001"
    shutil.copytree(DEFAULT_POLICY, updated)
    cfg = load_config(
        None,
        [
            f"storage.root={tmp_path / 'ws'}",
            "rollout.engine=sglang",
            f"rollout.sglang_url={server.url}",
            "rollout.tasks_per_iteration=2",
            "rollout.samples_per_prompt=1",
        ],
    )
    server.engine.update_weights(DEFAULT_POLICY)
    reloads = lambda: [r["model_path"] for r in server.requests if r["path"] == "/update_weights_from_disk"]  # noqa: E731
    before = len(reloads())
    run_rollout_stage(cfg, "s", 0, DEFAULT_POLICY, show_progress=False)
    assert len(reloads()) == before  # it already serves the initial policy
    run_rollout_stage(cfg, "s", 1, updated, show_progress=False)
    assert reloads()[before:] == [str(updated)] and server.engine.checkpoint == updated
    server.engine.update_weights(DEFAULT_POLICY)  # leave the module's server as it was
