"""`purify.recompute=sglang` (purifier/recompute.py: SGLangRecompute) against the SGLang contract double,
which serves the real tiny policy over HTTP: the log-probs it fills in are the model's, only the tokens
that need them change, rows that need none are never sent, and the prefill asks for the cached prefix
(max_new_tokens=0, logprob_start_len = first needed position − 1). It must agree with the CPU backend."""

from __future__ import annotations

import random

import pytest
import torch
from transformers import AutoModelForCausalLM

from pipeline.config import DEFAULT_POLICY
from pipeline.trajectory import PurifiedTrajectory
from purifier.recompute import CPURecompute, SGLangRecompute
from pipeline.chat import load_chat
from tests.sglang_contract_double import SGLangContractDouble

SENTINEL = -123.0  # a sampled log-prob that must be left as it is


@pytest.fixture(scope="module")
def server():
    s = SGLangContractDouble(DEFAULT_POLICY)
    yield s
    s.close()


def _row(prompt, response, needs, mask=None, k=0):
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
        [SENTINEL] * len(response),
        valid,
        1.0,
        0.5,
        [],
        min(needs, default=-1),
        0,
        True,
    )


@pytest.fixture(scope="module")
def rows():
    chat = load_chat(DEFAULT_POLICY)
    prompt = chat.prompt_ids("What is 12 + 30?")
    rng = random.Random(0)
    resp = [[rng.randrange(5, 300) for _ in range(n)] for n in (9, 6, 7, 5)]
    return [
        _row(prompt, resp[0], {2, 3, 6}, k=0),  # a splice in the middle
        _row(prompt, resp[1], set(), k=1),  # nothing to recompute: never sent
        _row(prompt, resp[2], {0, 4}, k=2),  # from the first response token (start = P)
        _row(prompt, resp[3], {1, 2}, mask=[1, 0, 1, 1, 1], k=3),  # mask-0 tokens are not recomputed
    ]


def _reference(row) -> list[float]:
    """log p(token | everything before it) from one plain full forward of the model."""
    model = AutoModelForCausalLM.from_pretrained(DEFAULT_POLICY, dtype=torch.float32, attn_implementation="eager")
    ids = row.prompt_ids + row.response_ids
    with torch.no_grad():
        logp = torch.log_softmax(model(torch.tensor([ids])).logits[0].float(), -1)
    p = len(row.prompt_ids)
    return [logp[p + i - 1, t].item() for i, t in enumerate(row.response_ids)]


def test_sglang_recompute_fills_exactly_the_needed_tokens_with_the_models_log_probs(server, rows):
    first = len(server.requests)
    out = SGLangRecompute(server.url).group(rows)
    assert out[1] is rows[1]  # untouched
    for row, got in zip(rows, out):
        ref = _reference(row)
        for i, (m, v) in enumerate(zip(row.loss_mask, row.logprob_valid)):
            if m == 1 and v == 0:
                assert got.old_logprobs[i] == pytest.approx(ref[i], abs=1e-4), (row.sample_idx, i)
                assert got.old_logprobs[i] != SENTINEL
            else:
                assert got.old_logprobs[i] == SENTINEL, (row.sample_idx, i)
    # the prefill: one request, the rows that need it, each cut after its last needed token
    (req,) = server.requests[first:]
    p = len(rows[0].prompt_ids)
    assert req["path"] == "/generate" and req["return_logprob"] is True
    assert req["input_ids"] == [
        rows[0].prompt_ids + rows[0].response_ids[:7],
        rows[2].prompt_ids + rows[2].response_ids[:5],
        rows[3].prompt_ids + rows[3].response_ids[:3],
    ]
    assert req["logprob_start_len"] == [p + 2 - 1, p - 1, p + 2 - 1]  # row 3: token 1 is mask-0
    assert all(sp["max_new_tokens"] == 0 for sp in req["sampling_params"])
    # tokens forwarded: from the first needed token to the last one
    assert [t.tokens_forwarded for t in out] == [5, 0, 5, 1]


def test_sglang_and_cpu_recompute_agree(server, rows):
    sgl = SGLangRecompute(server.url).group(rows)
    cpu = CPURecompute(DEFAULT_POLICY, threads=None).group(rows)
    for a, b in zip(sgl, cpu):
        assert a.old_logprobs == pytest.approx(b.old_logprobs, abs=1e-4)


def test_a_group_that_needs_nothing_sends_nothing(server, rows):
    first = len(server.requests)
    quiet = [rows[1], _row(rows[0].prompt_ids, rows[0].response_ids, set(), k=5)]
    assert SGLangRecompute(server.url).group(quiet) is quiet
    assert len(server.requests) == first
