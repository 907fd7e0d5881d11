"""One gloo rank of DeepSpeed: the chunked log-prob route through the engine against OpenRLHF's Actor.forward
(tests/test_chunked_deepspeed.py runs it in a process of its own, since it initialises torch.distributed).

`python -m tests.deepspeed_chunk_probe STAGE CHECKPOINTING RESULT_JSON`: on a tiny Qwen3, the same two rows
through both routes, each followed by the engine's backward; writes each route's log-probs, entropy and full
gradients (DeepSpeed's safe_get_full_grad, ZeRO-2 or ZeRO-3) compared, and the widest lm_head call of each.
"""

from __future__ import annotations

import json
import os
import socket
import sys

import torch
from transformers import Qwen3Config, Qwen3ForCausalLM

from benchmarks.gpu_check import SHAPES
from pipeline.config import TrainConfig
from trainer.chunked_actor import action_log_probs
from trainer.deepspeed_update import DeepSpeedGRPOUpdate, make_strategy

CHUNK = 37  # positions per lm_head call on the chunked route: several chunks per row, a ragged last one


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main(stage: int, checkpointing: bool, out: str) -> None:
    from deepspeed.utils import safe_get_full_grad

    os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_port()))
    cfg = TrainConfig(
        strategy="deepspeed", zero_stage=stage, device="cpu", gradient_checkpointing=checkpointing, lr=1e-5
    )
    torch.manual_seed(0)
    # the GPU check's tiny shape at a small vocabulary: the chunks are forced by CHUNK
    model = Qwen3ForCausalLM(Qwen3Config(**{**SHAPES["tiny"], "vocab_size": 512, "pad_token_id": 0}))
    widest: list[int] = []
    model.get_output_embeddings().register_forward_hook(
        lambda _m, args, _o: widest.append(args[0].numel() // args[0].shape[-1])
    )
    update = DeepSpeedGRPOUpdate(model, cfg, make_strategy(cfg, torch.device("cpu")), temperature=0.7)
    actor, engine = update.actor, update.engine

    g = torch.Generator().manual_seed(1)
    sequences = torch.randint(2, 512, (2, 160), generator=g)
    attention = torch.ones_like(sequences)
    attention[1, :20] = 0  # a left-padded row
    sequences[1, :20] = 0
    action = (torch.rand(2, 120, generator=g) > 0.3).long()  # tool-output gaps among the trained positions
    coefficient = torch.randn(2, 120, generator=g)

    def route(chunked: bool) -> dict:
        widest.clear()
        engine.train()
        if chunked:
            logp, entropy = action_log_probs(actor, sequences, action, attention, return_entropy=True, chunk=CHUNK)
        else:
            logp, out = actor(sequences, action, attention_mask=attention, return_output=True, return_entropy=True)
            entropy = out.entropy[:, -action.shape[1] :] * action  # Actor.forward's entropy covers every position
        engine.set_gradient_accumulation_boundary(True)
        engine.backward((logp * coefficient).sum(), scale_wrt_gas=False)
        grads = {n: safe_get_full_grad(p).detach().clone().float() for n, p in engine.module.named_parameters()}
        engine.optimizer.zero_grad(set_to_none=True)
        return {"logp": logp.detach(), "entropy": (entropy * action).detach(), "grads": grads, "widest": max(widest)}

    plain, chunked = route(False), route(True)
    gaps = {n: float((plain["grads"][n] - chunked["grads"][n]).abs().max()) for n in plain["grads"]}
    scale = max(float(t.abs().max()) for t in plain["grads"].values())
    result = {
        "logp_gap": float((plain["logp"] - chunked["logp"]).abs().max()),
        "entropy_gap": float((plain["entropy"] - chunked["entropy"]).abs().max()),
        "grad_gap": max(gaps.values()),
        "grad_scale": scale,
        "parameters": len(gaps),
        "widest_plain": plain["widest"],
        "widest_chunked": chunked["widest"],
        "trained_positions": int(action.sum()),
    }
    with open(out, "w") as f:
        json.dump(result, f)


if __name__ == "__main__":
    main(int(sys.argv[1]), sys.argv[2] == "1", sys.argv[3])
