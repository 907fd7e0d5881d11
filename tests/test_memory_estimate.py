"""trainer/memory.py, the estimate `cleaner fit` prints, against what the update really keeps.

- the parameter count against transformers' own model (meta device: no memory) at the tiny, 0.6B and 4B shapes;
- the activation coefficients against the bytes autograd saves in transformers' Qwen3 layer
  (saved_tensors_hooks, exact), in fp32, under bf16 autocast, in a bf16 model and with eager attention;
- the whole estimate against the update's peak measured on this CPU (the process's peak resident set, in a
  subprocess: benchmarks/gpu_check.py's --measure-cpu, the same code the GPU check measures with
  torch.cuda.max_memory_allocated) at shapes chosen so that each is dominated by another term, within ±25%;
- `cleaner fit`: the verdict, its exit code, the settings it suggests, and one line for a bad config.json.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from transformers import Qwen3Config, Qwen3ForCausalLM

from benchmarks.gpu_check import SHAPES
from trainer.chunked_actor import positions_per_call
from trainer.memory import GiB, LOGIT_BUDGET, ModelShape, Plan, describe, estimate, layer_activation_bytes, suggestions

ROOT = Path(__file__).resolve().parent.parent


def _model(config: dict, device="meta", attn="sdpa", dtype=torch.float32) -> Qwen3ForCausalLM:
    with torch.device(device):
        return Qwen3ForCausalLM._from_config(
            Qwen3Config(**{"pad_token_id": 0, **config}), attn_implementation=attn, dtype=dtype
        )


@pytest.mark.parametrize("name", ["tiny", "qwen3-0.6b", "qwen3-4b"])
def test_parameter_count_is_transformers_own(name):
    model = _model(SHAPES[name])
    assert ModelShape.from_config(SHAPES[name]).parameters == sum(p.numel() for p in model.parameters())
    untied = {**SHAPES[name], "tie_word_embeddings": False}
    assert ModelShape.from_config(untied).parameters == sum(p.numel() for p in _model(untied).parameters())


def test_logit_budget_is_the_trainers():
    from trainer.chunked_actor import LOGIT_BUDGET as TRAINER_BUDGET

    assert LOGIT_BUDGET == TRAINER_BUDGET


def _saved_per_layer(config: dict, tokens: int, attn: str, precision: str) -> float:
    """Bytes autograd saves for one more decoder layer, per token (two models, one and two layers, differenced)."""
    saved = []
    for layers in (1, 2):
        torch.manual_seed(0)
        model = _model(
            {**config, "num_hidden_layers": layers},
            "cpu",
            attn,
            torch.bfloat16 if precision == "low" else torch.float32,
        ).train()
        params = {p.untyped_storage().data_ptr() for p in model.parameters()}
        storages: dict[int, int] = {}

        def pack(t, storages=storages, params=params):
            s = t.untyped_storage()
            if s.data_ptr() not in params:
                storages[s.data_ptr()] = s.nbytes()
            return t

        ids = torch.randint(0, config["vocab_size"], (1, tokens))
        with (
            torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t),
            torch.autocast("cpu", dtype=torch.bfloat16, enabled=precision == "autocast"),
        ):
            model.model(input_ids=ids, attention_mask=torch.ones_like(ids))
        saved.append(sum(storages.values()))
    return (saved[1] - saved[0]) / tokens


@pytest.mark.parametrize("precision", ["fp32", "autocast", "low"])
@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_activation_coefficients_are_what_autograd_saves(precision, attn):
    for config in (
        {
            "vocab_size": 512,
            "hidden_size": 64,
            "intermediate_size": 192,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "head_dim": 32,
        },
        {
            "vocab_size": 512,
            "hidden_size": 96,
            "intermediate_size": 256,
            "num_attention_heads": 6,
            "num_key_value_heads": 3,
            "head_dim": 16,
        },
    ):
        shape = ModelShape.from_config({**config, "num_hidden_layers": 1})
        tokens = 256
        measured = _saved_per_layer(config, tokens, attn, precision)
        if precision == "autocast":  # its bf16 weight copies are saved once per layer, not per token
            measured -= 2 * shape.layer_matmul_parameters / tokens
        expected = layer_activation_bytes(shape, precision, attn, tokens)
        assert measured == pytest.approx(expected, rel=0.02), (config, measured, expected)


# Shapes each dominated by another term of the estimate: the logits of one lm_head call, the chunked log-prob
# head at Qwen3's vocabulary under bf16 autocast, the decoder layers' activations, the same with activation
# checkpointing (layer inputs + one layer recomputed), the weights, gradients and AdamW moments, and DeepSpeed's
# bf16 weights and ZeRO optimizer with the whole micro-batch's logits (one spec: one process group per process).
MEASURED = [
    (
        "log-prob head (logits)",
        512,
        {"param_dtype": "fp32"},
        dict(
            vocab_size=32768,
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=16,
            tie_word_embeddings=True,
        ),
    ),
    (
        "log-prob head (logits)",
        640,
        {"param_dtype": "bf16"},
        dict(
            vocab_size=151936,
            hidden_size=64,
            intermediate_size=192,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=16,
            tie_word_embeddings=True,
        ),
    ),
    (
        "activations (saved for backward)",
        1024,
        {"param_dtype": "fp32"},
        dict(
            vocab_size=1024,
            hidden_size=256,
            intermediate_size=768,
            num_hidden_layers=6,
            num_attention_heads=8,
            num_key_value_heads=4,
            head_dim=32,
            tie_word_embeddings=True,
        ),
    ),
    (
        "checkpointed",
        1024,
        {"param_dtype": "bf16", "gradient_checkpointing": True},
        dict(
            vocab_size=1024,
            hidden_size=256,
            intermediate_size=768,
            num_hidden_layers=6,
            num_attention_heads=8,
            num_key_value_heads=4,
            head_dim=32,
            tie_word_embeddings=True,
        ),
    ),
    (
        "AdamW moments (fp32)",
        128,
        {"param_dtype": "fp32"},
        dict(
            vocab_size=1024,
            hidden_size=512,
            intermediate_size=2048,
            num_hidden_layers=6,
            num_attention_heads=8,
            num_key_value_heads=4,
            head_dim=64,
            tie_word_embeddings=False,
        ),
    ),
    # DeepSpeed (ZeRO-2, bf16, one gloo rank) at Qwen3's vocabulary: three chunks of lm_head through the engine
    # (OpenRLHF's Actor.forward, which the DeepSpeed path called before, keeps every position's fp32 logits: 3×)
    (
        "log-prob head (logits)",
        1536,
        {"strategy": "deepspeed", "zero_stage": 2, "param_dtype": "bf16"},
        dict(
            vocab_size=151936,
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=16,
            tie_word_embeddings=True,
        ),
    ),
]


@pytest.fixture(scope="module")
def measured(tmp_path_factory):
    folder = tmp_path_factory.mktemp("memory")
    specs = folder / "specs.json"
    specs.write_text(
        json.dumps(
            [{"name": f"shape{i}", "tokens": t, "settings": s, "config": c} for i, (_, t, s, c) in enumerate(MEASURED)]
        )
    )
    env = {**os.environ, "PYTHONPATH": str(ROOT), "MALLOC_MMAP_THRESHOLD_": "65536", "OMP_NUM_THREADS": "2"}
    done = subprocess.run(
        [sys.executable, "-m", "benchmarks.gpu_check", "--measure-cpu", str(specs), str(folder / "result.json")],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads((folder / "result.json").read_text())


@pytest.mark.slow
def test_estimate_is_within_25_percent_of_the_peak_measured_on_this_cpu(measured):
    assert len(measured) == len(MEASURED) >= 3
    for (dominant, tokens, settings, config), got in zip(MEASURED, measured):
        assert got["steps"] == 2 and got["loss_finite"] and got["trained_tokens"] > 0
        assert got["widest_head_call"] <= min(tokens, positions_per_call(config["vocab_size"])), (dominant, got)
        assert got["peak_how"].startswith("peak resident set")
        shape = ModelShape.from_config(config)
        plan = Plan(
            strategy=settings.get("strategy", "local"),
            zero_stage=settings.get("zero_stage", 2),
            param_dtype=settings["param_dtype"],
            gradient_checkpointing=settings.get("gradient_checkpointing", False),
            micro_batch_tokens=tokens,
            trajectory_tokens=tokens,
            device="cpu",
        )
        est = estimate(shape, plan)
        assert got["estimate_bytes"] == pytest.approx(est.peak)  # the check's estimate is this one
        ratio = est.peak / got["peak_bytes"]
        assert 0.75 <= ratio <= 1.25, (dominant, tokens, settings, ratio, got["peak_bytes"], est.terms)
        top = max(est.terms, key=est.terms.get)
        checkpointed = dominant == "checkpointed" and "checkpointed" in "".join(est.terms)
        assert dominant in top or checkpointed, (top, est.terms)
    # the checkpointed update keeps less than the same shape without it (measured, not only estimated)
    assert measured[3]["peak_bytes"] < 0.7 * measured[2]["peak_bytes"]


QWEN3_4B = ModelShape.from_config(SHAPES["qwen3-4b"], "qwen3-4b")
# the single-card recipe: ZeRO-3 with optimizer offload and checkpointing, bf16, at 8k tokens
QWEN3_4B_OFFLOAD_8K = Plan(
    strategy="deepspeed",
    zero_stage=3,
    param_dtype="bf16",
    gradient_checkpointing=True,
    offload_optimizer=True,
    trajectory_tokens=8192,
    micro_batch_tokens=8192,
)


def test_qwen3_4b_at_8k_tokens_fits_no_80gb_card_as_the_update_stood_and_the_suggestions_fit():
    before = Plan(trajectory_tokens=8192, micro_batch_tokens=8192)  # fp32, no checkpointing: the issue's ≈ 150 GiB
    est = estimate(QWEN3_4B, before)
    assert 120 * GiB < est.peak < 180 * GiB and not est.fits(80 * GiB)
    found = suggestions(QWEN3_4B, before, gpus=1, gpu_bytes=80 * GiB)
    assert found and all(e.fits(80 * GiB) for e in found)
    assert all(e.plan.ranks == 1 for e in found)
    # ZeRO-3 with offload and checkpointing, the single-card recipe, fits with room; at 20k tokens too
    recipe = QWEN3_4B_OFFLOAD_8K
    assert estimate(QWEN3_4B, recipe).peak < 40 * GiB
    assert estimate(QWEN3_4B, Plan(**{**recipe.__dict__, "trajectory_tokens": 20480})).fits(80 * GiB)
    # 4 ranks without offload: the optimizer state splits four ways
    four = Plan(
        strategy="deepspeed",
        zero_stage=3,
        ranks=4,
        param_dtype="bf16",
        gradient_checkpointing=True,
        trajectory_tokens=20480,
        micro_batch_tokens=20480,
    )
    assert estimate(QWEN3_4B, four).fits(80 * GiB) and estimate(QWEN3_4B, four).cpu_bytes == 0
    one = estimate(QWEN3_4B, Plan(**{**four.__dict__, "ranks": 1}))
    assert one.peak - estimate(QWEN3_4B, four).peak > 35 * GiB  # 16 B/param of optimizer state, 3/4 of it gone


def test_each_lever_lowers_the_estimate():
    """bf16, checkpointing, ZeRO-3 over 4 ranks, offload, in turn (ZeRO on one rank is no lever: its bf16 weights
    and gradients come on top of the fp32 master copy)."""
    base = Plan(trajectory_tokens=8192, micro_batch_tokens=8192)
    ladder = [
        base,
        Plan(**{**base.__dict__, "param_dtype": "bf16"}),
        Plan(**{**base.__dict__, "param_dtype": "bf16", "gradient_checkpointing": True}),
        Plan(
            **{
                **base.__dict__,
                "strategy": "deepspeed",
                "zero_stage": 3,
                "ranks": 4,
                "param_dtype": "bf16",
                "gradient_checkpointing": True,
            }
        ),
        Plan(
            **{
                **base.__dict__,
                "strategy": "deepspeed",
                "zero_stage": 3,
                "ranks": 4,
                "param_dtype": "bf16",
                "gradient_checkpointing": True,
                "offload_optimizer": True,
            }
        ),
    ]
    peaks = [estimate(QWEN3_4B, p).peak for p in ladder]
    assert peaks == sorted(peaks, reverse=True) and len(set(peaks)) == len(peaks), [p / GiB for p in peaks]


def _cleaner(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "flows.cli", *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        timeout=120,
    )


def test_cleaner_fit_says_yes_for_the_demo_policy_and_no_with_what_would_for_qwen3_4b(tmp_path):
    done = _cleaner("fit", "--gpu-memory", "80")
    assert done.returncode == 0, done.stderr
    assert "fits:" in done.stdout and "peak per GPU" in done.stdout
    (tmp_path / "config.json").write_text(json.dumps({**SHAPES["qwen3-4b"], "model_type": "qwen3"}))
    done = _cleaner("fit", "--model", str(tmp_path), "--tokens", "8192", "--gpu-memory", "80")
    assert done.returncode == 1, done.stderr
    out = done.stdout
    assert "does not fit" in out and "would fit on 1 GPU(s)" in out
    first = out.split("fastest first:\n")[1].splitlines()[0].split("(")[0].split()
    # the first suggestion, applied as overrides, fits
    again = _cleaner(
        "fit",
        "--model",
        str(tmp_path),
        "--tokens",
        "8192",
        "--gpu-memory",
        "80",
        *[kv for kv in first if kv != "train.nproc=1"],
    )
    assert again.returncode == 0, again.stdout + again.stderr
    assert "fits:" in again.stdout
    # with four GPUs, ZeRO across them without offload is offered
    four = _cleaner("fit", "--model", str(tmp_path), "--tokens", "20480", "--gpu-memory", "80", "--gpus", "4")
    assert four.returncode == 1 and "train.nproc=4" in four.stdout


def test_cleaner_fit_refuses_bad_input_in_one_line(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"hidden_size": 64, "num_attention_heads": 4}))
    done = _cleaner("fit", "--model", str(tmp_path), "--gpu-memory", "80")
    assert done.returncode == 2 and len(done.stderr.strip().splitlines()) == 1, done.stderr
    assert f"{tmp_path / 'config.json'}: field 'vocab_size' must be a positive integer" in done.stderr
    done = _cleaner("fit", "--model", str(tmp_path / "nowhere"), "--gpu-memory", "80")
    assert done.returncode == 2 and "no such file" in done.stderr and len(done.stderr.strip().splitlines()) == 1
    done = _cleaner("fit", "--gpu-memory", "-3")
    assert done.returncode == 2 and "--gpu-memory -3" in done.stderr
    if not torch.cuda.is_available():
        done = _cleaner("fit")
        assert done.returncode == 2 and "--gpu-memory" in done.stderr and len(done.stderr.strip().splitlines()) == 1


def test_describe_is_overrides_a_user_types():
    plan = Plan(strategy="deepspeed", zero_stage=3, ranks=2, param_dtype="bf16", gradient_checkpointing=True)
    assert describe(plan) == (
        "train.strategy=deepspeed train.param_dtype=bf16 train.gradient_checkpointing=true "
        "train.zero_stage=3 train.nproc=2 train.offload_optimizer=false train.micro_batch_tokens=8192"
    )


@pytest.mark.parametrize("tied", [True, False])
def test_model_flops_are_what_torch_counts_for_a_training_step(tied):
    """MFU's numerator: torch's FlopCounterMode over one forward + backward of every position through lm_head
    (short rows: the attention term is below the tolerance here and counted by the formula's second part)."""
    from torch.utils.flop_counter import FlopCounterMode

    from trainer.memory import model_flops_per_token

    config = {**SHAPES["tiny"], "vocab_size": 4096, "tie_word_embeddings": tied}
    model = _model(config, "cpu").train()
    tokens = 64
    ids = torch.randint(0, config["vocab_size"], (1, tokens))
    with FlopCounterMode(display=False) as counter:
        model(input_ids=ids).logits.float().logsumexp(-1).sum().backward()
    expected = model_flops_per_token(ModelShape.from_config(config), tokens) * tokens
    assert counter.get_total_flops() == pytest.approx(expected, rel=0.05)


def test_check_fits_refuses_in_one_line_naming_the_settings_the_estimate_and_what_would_fit():
    from trainer.memory import DoesNotFit, check_fits

    plan = Plan(trajectory_tokens=8192, micro_batch_tokens=8192)
    with pytest.raises(DoesNotFit) as e:
        check_fits(QWEN3_4B, plan, gpus=1, gpu_bytes=80 * GiB, card="NVIDIA H100 80GB HBM3")
    line = str(e.value)
    assert "\n" not in line and e.value.exit_code == 1
    assert line.startswith(
        "train.strategy=local train.param_dtype=fp32 train.gradient_checkpointing=false "
        "train.micro_batch_tokens=8192 at 8192 "
        f"tokens needs ≈ {estimate(QWEN3_4B, plan).peak / GiB:.1f} GiB per GPU (estimate) of 72.0 "
        "GiB usable on NVIDIA H100 80GB HBM3"
    )
    assert "would fit: train.strategy=local train.param_dtype=bf16 train.gradient_checkpointing=true" in line
    fitting = QWEN3_4B_OFFLOAD_8K
    assert check_fits(QWEN3_4B, fitting, gpus=1, gpu_bytes=80 * GiB).peak < 72 * GiB
    with pytest.raises(DoesNotFit, match="no settings fit 1 such GPU"):
        check_fits(QWEN3_4B, plan, gpus=1, gpu_bytes=8 * GiB)


def test_a_training_flow_on_a_gpu_refuses_a_model_that_will_not_fit_before_anything_runs(tmp_path):
    """The preflight's fit check (trainer/devices.check_update_fits, which check_device calls when train.device is a
    GPU) with an 80 GB card's bytes given: a Qwen3-4B-shaped policy at 8k tokens as the update stood is refused in
    one line naming the setting, the estimate and what would fit; the demo policy fits."""
    from pipeline.config import load_config
    from trainer.devices import check_update_fits
    from trainer.memory import DoesNotFit

    policy = tmp_path / "qwen3-4b"
    policy.mkdir()
    (policy / "config.json").write_text(json.dumps(SHAPES["qwen3-4b"]))
    big = load_config(
        None, [f"rollout.policy={policy}", "rollout.max_prompt_tokens=512", "rollout.max_response_tokens=7680"]
    )
    with pytest.raises(DoesNotFit) as refused:
        check_update_fits(big, 80 * GiB, "H100")
    message = str(refused.value)
    assert "\n" not in message and "8192 tokens" in message and "would fit:" in message and "H100" in message
    check_update_fits(load_config(None), 80 * GiB, "H100")  # the tiny demo policy


def test_fit_input_a_user_found_wrong_is_one_line_exit_2(tmp_path, capsys):
    """Each was taken silently (0 read as the default, nan/inf GiB, a string head count) or crashed with a
    traceback, or sized a model the estimate cannot size (a mixture of experts as a 3B dense model)."""
    from tests.flow_helpers import refused

    qwen = tmp_path / "qwen"
    qwen.mkdir()
    (qwen / "config.json").write_text(json.dumps({**SHAPES["qwen3-4b"], "architectures": ["Qwen3ForCausalLM"]}))
    base = ["fit", "--model", str(qwen)]
    refused([*base, "--tokens", "0", "--gpu-memory", "79.2"], capsys, 2, "--tokens 0")
    refused([*base, "--gpus", "0", "--gpu-memory", "79.2"], capsys, 2, "--gpus 0")
    for odd in ("nan", "inf"):
        refused([*base, "--gpu-memory", odd], capsys, 2, f"--gpu-memory {odd}")
    ds = ["train.strategy=deepspeed", "train.nproc=4"]
    refused([*base, "--gpus", "2", "--gpu-memory", "79.2", *ds], capsys, 2, "train.nproc=4 ranks for 2 GPU(s)")

    def config(name: str, text: str | bytes) -> str:
        folder = tmp_path / name
        folder.mkdir()
        data = text.encode() if isinstance(text, str) else text
        (folder / "config.json").write_bytes(data)
        return str(folder)

    moe = {**SHAPES["qwen3-4b"], "model_type": "qwen3_moe", "num_experts": 128, "moe_intermediate_size": 768}
    refused(["fit", "--model", config("moe", json.dumps(moe)), "--gpu-memory", "79.2"], capsys, 2, "num_experts=128")
    bert = {**SHAPES["qwen3-4b"], "model_type": "bert", "architectures": ["BertForMaskedLM"]}
    refused(["fit", "--model", config("bert", json.dumps(bert)), "--gpu-memory", "79.2"], capsys, 2, "BertForMaskedLM")
    heads = {**SHAPES["qwen3-4b"], "num_key_value_heads": "8"}
    path = config("heads", json.dumps(heads))
    refused(["fit", "--model", path, "--gpu-memory", "79.2"], capsys, 2, "'num_key_value_heads' must be a positive")
    path = config("utf16", json.dumps(SHAPES["qwen3-4b"]).encode("utf-16"))
    refused(["fit", "--model", path, "--gpu-memory", "79.2"], capsys, 2, "not UTF-8")
    (tmp_path / "dir" / "config.json").mkdir(parents=True)
    refused(["fit", "--model", str(tmp_path / "dir"), "--gpu-memory", "79.2"], capsys, 2, "a folder")

    # train.nproc given: it is what a run starts, so it is what is sized (--gpus said 2 and the line said nproc=2)
    from flows.cli import main

    assert main([*base, "--tokens", "8192", "--gpus", "4", "--gpu-memory", "79.2", *ds[:1], "train.nproc=2"]) in (0, 1)
    assert "train.nproc=2" in capsys.readouterr().out


QWEN3_06B = ModelShape.from_config(SHAPES["qwen3-0.6b"], "qwen3-0.6b")


def test_a_smaller_micro_batch_is_suggested_before_checkpointing():
    """Micro-batches of 32k tokens pack four 8k trajectories: halving the budget down to one trajectory frees
    activations without the recomputed forward checkpointing costs (fit never offered it)."""
    packed = Plan(param_dtype="bf16", trajectory_tokens=8192, micro_batch_tokens=32768)
    assert not estimate(QWEN3_06B, packed).fits(40 * GiB)
    first = suggestions(QWEN3_06B, packed, gpus=1, gpu_bytes=40 * GiB)[0]
    assert first.plan.micro_batch_tokens == 8192 and not first.plan.gradient_checkpointing
    assert first.plan.strategy == "local" and first.fits(40 * GiB)
    assert "train.micro_batch_tokens=8192" in describe(first.plan)
    # never below one trajectory: a row is not split, so a smaller budget would change nothing
    one = Plan(param_dtype="bf16", trajectory_tokens=8192, micro_batch_tokens=8192)
    from trainer.memory import candidate_plans

    assert {c.micro_batch_tokens for c in candidate_plans(one, 1)} == {8192}
    assert {c.micro_batch_tokens for c in candidate_plans(packed, 1)} == {32768, 16384, 8192}


def test_offload_needs_room_in_the_hosts_memory(tmp_path, capsys):
    """ZeRO-3 + offload moves 20 B/param to the host: ≈ 75 GiB for Qwen3-4B on one rank. fit said it fits a node of
    48 GiB; now it says the host does not hold it (exit 1), with --host-memory or this machine's memory when the
    GPUs are sized here, and the preflight refuses it in one line."""
    from flows.cli import main
    from tests.flow_helpers import refused
    from trainer.memory import DoesNotFit, check_fits

    offload = QWEN3_4B_OFFLOAD_8K
    est = estimate(QWEN3_4B, offload)
    assert 70 * GiB < est.host_bytes < 80 * GiB and est.fits(80 * GiB) and not est.fits(80 * GiB, 48 * GiB)
    assert est.fits(80 * GiB, 128 * GiB)
    with pytest.raises(DoesNotFit) as e:
        check_fits(QWEN3_4B, offload, gpus=1, gpu_bytes=80 * GiB, host_bytes=48 * GiB)
    assert "GiB of host memory for offload (estimate) of 43.2 GiB usable" in str(e.value) and "\n" not in str(e.value)
    # two ranks offload half each: the one node's memory holds the same
    assert estimate(QWEN3_4B, Plan(**{**offload.__dict__, "ranks": 2})).host_bytes == pytest.approx(est.host_bytes)
    # every suggestion holds in the host's memory
    for e in suggestions(QWEN3_4B, offload, gpus=2, gpu_bytes=40 * GiB, host_bytes=48 * GiB):
        assert e.host_bytes <= 48 * GiB * 0.9

    qwen = tmp_path / "qwen"
    qwen.mkdir()
    (qwen / "config.json").write_text(json.dumps(SHAPES["qwen3-4b"]))
    args = [
        "fit",
        "--model",
        str(qwen),
        "--tokens",
        "8192",
        "--gpu-memory",
        "79.2",
        *(
            "train.strategy=deepspeed train.zero_stage=3 train.offload_optimizer=true train.param_dtype=bf16 "
            "train.gradient_checkpointing=true"
        ).split(),
    ]
    assert main([*args, "--host-memory", "48"]) == 1
    out = capsys.readouterr().out
    assert "the host's memory does not hold offload's share" in out and "48 GiB (--host-memory): does not fit" in out
    assert main([*args, "--host-memory", "128"]) == 0
    assert "of 115.2 GiB usable of 128 GiB (--host-memory)" in capsys.readouterr().out
    assert main(args) == 0  # the GPUs are not this machine's: shown, not checked
    assert "not checked (--host-memory GIB" in capsys.readouterr().out
    refused([*args, "--host-memory", "0"], capsys, 2, "--host-memory 0")


def test_offload_keeps_the_gradient_shard_in_host_memory():
    """With offload_optimizer, DeepSpeed 0.19 allocates the gradient partition on the offload device (ZeRO-3's
    grad_partitions_flat_buffer on `self.device`, which is cpu; ZeRO-2 accumulates into the CPU fp32 partition
    through one largest-tensor GPU buffer and keeps a host bit16 copy of the shard). The estimate counted the bf16
    shard on the GPU too: ≈ 7.5 GiB of Qwen3-4B's 20 GiB on one card, over the GPU check's ±25%. The source is read
    here so that a DeepSpeed that moves them back fails this test (the CPU cannot tell host from card)."""
    import inspect

    from deepspeed.runtime.zero import stage3, stage_1_and_2

    assert "self.device = get_accelerator().current_device_name() if not self.offload_optimizer else" in (
        inspect.getsource(stage3)
    )
    three = inspect.getsource(stage3)
    assert "self.grad_partitions_flat_buffer: Tensor = torch.zeros(" in three
    # …in the accumulation dtype (float32 under bf16: trainer/deepspeed_update.py asks OpenRLHF for it), beside
    # each subgroup's fp32 gradient buffer under offload
    assert (
        "dtype=self.gradient_accumulation_dtype,\n" in three.split("self.grad_partitions_flat_buffer: Tensor")[1][:200]
    )
    assert "subgroup_gradient_buffer = torch.zeros(num_elements, dtype=gradient_dtype, device=self.device)" in three
    from trainer import deepspeed_update

    assert 'grad_accum_dtype="fp32" if cfg.param_dtype == "bf16" else None' in inspect.getsource(deepspeed_update)
    two = inspect.getsource(stage_1_and_2)
    assert "self.device = get_accelerator().current_device_name() if not self.cpu_offload else 'cpu'" in two
    assert "self.temp_grad_buffer_for_gpu_offload = torch.zeros(largest_param_numel," in two

    base = dict(param_dtype="bf16", gradient_checkpointing=True, trajectory_tokens=8192, micro_batch_tokens=8192)
    p = QWEN3_4B.parameters
    for stage in (2, 3):
        kept = estimate(QWEN3_4B, Plan(strategy="deepspeed", zero_stage=stage, **base))
        off = estimate(QWEN3_4B, Plan(strategy="deepspeed", zero_stage=stage, offload_optimizer=True, **base))
        grads_kept = next(v for k, v in kept.terms.items() if k.startswith("gradients"))
        grads_off = next(v for k, v in off.terms.items() if k.startswith("gradients"))
        # ZeRO-3's shard is float32 (the accumulation dtype), ZeRO-2's bf16 with one largest tensor left on the GPU
        on_card = 4 * p if stage == 3 else 2 * p - 2 * QWEN3_4B.largest_tensor
        assert grads_kept - grads_off == pytest.approx(on_card)
        assert off.cpu_bytes == pytest.approx(16 * p + (4 * p if stage == 3 else 2 * p))
    assert estimate(QWEN3_4B, Plan(strategy="deepspeed", zero_stage=3, offload_optimizer=True, **base)).peak < 14 * GiB


def test_a_partition_longer_than_the_rollout_budget_is_sized_at_its_own_length(purified_run, tmp_path):
    """The GPU preflight sized the update at rollout.max_prompt_tokens + max_response_tokens, but a partition can
    hold longer rows (an import of another framework's rollouts, a replay under other settings): the update would
    run out of memory mid-way. The update's plan reads the partition's longest row (id columns only) and sizes it
    again when it is longer (trainer/devices.check_partition_fits, on a CUDA device; here with an 80 GB card's
    bytes given, as the flow preflight's test does)."""
    from pipeline.config import load_config
    from storage.layout import RunLayout
    from storage.schemas import PURIFIED
    from storage.shards import read_shard
    from trainer.devices import check_update_fits, longest_trajectory
    from trainer.memory import DoesNotFit

    part = RunLayout(purified_run.storage.root, "w").purified_dir(0, "saar", 0.5)
    rows = read_shard(part, PURIFIED).to_pylist()
    assert longest_trajectory(part) == max(len(r["prompt_ids"]) + len(r["response_ids"]) for r in rows) > 0

    policy = tmp_path / "qwen3-0.6b"
    policy.mkdir()
    (policy / "config.json").write_text(json.dumps(SHAPES["qwen3-0.6b"]))
    cfg = load_config(
        None,
        [f"rollout.policy={policy}", "rollout.max_prompt_tokens=512", "rollout.max_response_tokens=1536"]
        + "train.strategy=deepspeed train.zero_stage=3 train.param_dtype=bf16 train.gradient_checkpointing=true "
        "train.nproc=1 train.micro_batch_tokens=2048".split(),
    )
    check_update_fits(cfg, 80 * GiB, "H100")  # the budget, 2,048 tokens: fits
    check_update_fits(cfg, 80 * GiB, "H100", longest=1024)  # shorter rows: fits
    with pytest.raises(DoesNotFit) as e:
        check_update_fits(cfg, 80 * GiB, "H100", longest=524288)
    line = str(e.value)
    assert "\n" not in line and line.startswith("the partition's longest trajectory is 524288 tokens")
    assert "= 2048 the preflight sized" in line and "GiB" in line


def test_host_memory_is_the_cgroups_when_lower(tmp_path):
    """A container's or a SLURM job's memory limit kills past it: the host memory offload must fit is the lower of
    the machine's and the cgroup's (it was the machine's alone)."""
    from trainer.memory import this_host_memory

    machine = this_host_memory(limits=())
    (tmp_path / "v2").write_text("max\n")
    (tmp_path / "v1").write_text(f"{2 * GiB}\n")
    assert this_host_memory(limits=(str(tmp_path / "v2"),)) == machine  # no limit
    assert this_host_memory(limits=(str(tmp_path / "v2"), str(tmp_path / "v1"))) == 2 * GiB
    assert this_host_memory(limits=(str(tmp_path / "missing"),)) == machine
