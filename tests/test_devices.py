"""A device per stage (rollout.device, purify.device, train.device): every tensor, module and random generator
of the rollout engine, the recompute and the update (local and DeepSpeed) is made on its stage's device, checked
by a torch function mode over the real stages (tests/device_discipline.py), on the CPU and, where one is, on a
GPU; the refusals of devices this machine lacks; mixed precision, activation checkpointing and the attention
switch of the update."""

from __future__ import annotations

import json
import os
import random
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from pipeline.config import DEFAULT_POLICY, ConfigError, dump_config, load_config, train_settings
from pipeline.devices import DeviceError, resolve_device
from pipeline.engines.base import Request, SamplingParams, ScoreRequest
from purifier.recompute import CPURecompute
from rollout_gen.engines.cpu import CPUEngine
from storage.checkpoints import DONE_MARKER
from storage.layout import RunLayout
from tests.device_discipline import DeviceDiscipline
from tests.flow_helpers import copy_runs, refused
from tests.test_logprobs import _rows  # rows of one prompt group, about half needing a recompute
from trainer.stage import run_update_stage

ROOT = Path(__file__).resolve().parent.parent
DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
no_gpu = pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a GPU")


def _clean(mode: DeviceDiscipline) -> None:
    assert mode.checked > 100, "the mode saw almost nothing of the stage"
    assert not mode.violations, "\n".join(dict.fromkeys(mode.violations))


@pytest.mark.parametrize("device", DEVICES)
def test_the_rollout_engine_makes_everything_on_its_device(device):
    """Continuous batching (rows joining, leaving, a shared prompt, top-p), a second turn on the kept KV, batched
    and single importance-ratio scoring: every tensor and each row's generator on rollout.device."""
    with DeviceDiscipline(device) as mode:
        engine = CPUEngine(DEFAULT_POLICY, device=device, chunk_tokens=24)
        rng = random.Random(0)
        prompt = [rng.randrange(5, 1000) for _ in range(30)]
        ctx = {k: prompt + [rng.randrange(5, 1000) for _ in range(3 + 4 * k)] for k in range(3)}
        engine.add(
            [
                Request(k, tuple(c), SamplingParams(6 + 5 * k, 1.0, 0.9, ()), seed=k, shared_prefix=len(prompt))
                for k, c in ctx.items()
            ]
        )
        out, generators = {}, []
        while engine.busy():
            generators += [r.generator for r in engine._rows]
            out.update((r.key, g) for r, g in engine.step())
        kv = [t for layer in engine._cache.layers for t in (layer.keys, layer.values)]
        turn2 = {k: ctx[k] + out[k].output_ids + [7, 8, 9] for k in ctx}
        engine.add([Request(k, tuple(c), SamplingParams(4, 1.0, 1.0, ()), seed=9) for k, c in turn2.items()])
        while engine.busy():
            engine.step()
        scores = engine.score_turns([ScoreRequest(k, tuple(turn2[k]), (11, 12, 13)) for k in (0, 1)])
        single = engine.score_turn(turn2[2], [11, 12], key=2)
    _clean(mode)
    assert all(len(s) == 3 for s in scores) and len(single) == 2
    want = torch.device(device).type
    assert {p.device.type for p in engine.model.parameters()} == {want}
    assert kv and {t.device.type for t in kv} == {want}
    assert generators and {g.device.type for g in generators} == {want}


@pytest.mark.parametrize("device", DEVICES)
def test_the_recompute_makes_everything_on_its_device(device):
    with DeviceDiscipline(device) as mode:
        backend = CPURecompute(DEFAULT_POLICY, temperature=0.9, chunk_tokens=16, device=device)
        got = backend.group(_rows(5, 23, seed=1))
        scored = backend.score(list(range(5, 30)), [40, 41, 42])
    _clean(mode)
    assert len(got) == 5 and len(scored) == 3
    assert {p.device.type for p in backend.model.parameters()} == {torch.device(device).type}


@pytest.fixture()
def train_copy(purified_run, tmp_path):
    cfg = purified_run.model_copy(deep=True)
    cfg.storage.root = copy_runs(purified_run.storage.root, tmp_path / "ws")
    cfg.train.mini_batches, cfg.train.epochs = 2, 1
    return cfg


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize(
    "settings",
    [{}, {"param_dtype": "bf16", "gradient_checkpointing": True, "use_dpo_on_tool_calls": True, "log_entropy": True}],
    ids=["fp32", "bf16-checkpointed-dpo"],
)
def test_the_local_update_makes_everything_on_its_device(train_copy, device, settings):
    """The whole update stage (micro-batches, the loss, the DPO side loss, the optimizer, the checkpoint)."""
    cfg = train_copy
    cfg.train.device = device
    for k, v in settings.items():
        setattr(cfg.train, k, v)
    with DeviceDiscipline(device) as mode:
        ckpt = run_update_stage(cfg, "w", 0, log=lambda *_: None)
    _clean(mode)
    assert (ckpt / DONE_MARKER).is_file()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


RANK_UNDER_THE_MODE = """
import json, sys
from pipeline.config import load_config
from tests.device_discipline import DeviceDiscipline
from trainer.distributed import deepspeed_update

cfg = load_config(sys.argv[1])
with DeviceDiscipline(sys.argv[2]) as mode:
    deepspeed_update(cfg, "w", 0)
print("DISCIPLINE " + json.dumps({"checked": mode.checked, "violations": sorted(set(mode.violations))}))
"""


@pytest.mark.parametrize("device", DEVICES)
def test_a_deepspeed_rank_makes_its_batches_and_collectives_on_its_device(train_copy, device, tmp_path):
    """One torchrun-style rank (gloo on the CPU, NCCL on a GPU) under the mode: its micro-batches and the update's
    own all-reduces (token counts, metrics, micro-batch counts) on the rank's device."""
    pytest.importorskip("deepspeed")
    cfg = train_copy
    cfg.train.strategy, cfg.train.nproc, cfg.train.zero_stage, cfg.train.device = "deepspeed", 1, 2, device
    frozen = tmp_path / "rank.yaml"
    frozen.write_text(dump_config(cfg))
    env = {
        **os.environ,
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(_free_port()),
        "RANK": "0",
        "WORLD_SIZE": "1",
        "LOCAL_RANK": "0",
        "LOCAL_WORLD_SIZE": "1",
        "OMP_NUM_THREADS": "1",
        "PYTHONPATH": str(ROOT),
    }
    done = subprocess.run(
        [sys.executable, "-c", RANK_UNDER_THE_MODE, str(frozen), device],
        capture_output=True,
        text=True,
        env=env,
        cwd=ROOT,
        timeout=600,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    found = json.loads(next(x for x in done.stdout.splitlines() if x.startswith("DISCIPLINE "))[len("DISCIPLINE ") :])
    assert found["checked"] > 100 and not found["violations"], "\n".join(found["violations"])
    assert (RunLayout(cfg.storage.root, "w").checkpoint_dir(1) / DONE_MARKER).is_file()


# -- settings this machine cannot honour: one line naming the setting, before anything runs ----------------------


@no_gpu
@pytest.mark.parametrize("key", ["rollout.device", "purify.device", "train.device"])
def test_a_cuda_device_where_there_is_none_is_one_line_before_anything_runs(tmp_path, capsys, key):
    ws = tmp_path / "ws"
    refused(["train", f"storage.root={ws}", f"{key}=cuda"], capsys, 1, f"{key}=cuda", "no CUDA device", f"{key}=cpu")
    assert not ws.exists()


@no_gpu
@pytest.mark.parametrize("stage", ["rollout", "purify"])
def test_a_stage_alone_on_a_missing_gpu_is_one_line(world_copy, capsys, stage):
    """`cleaner rollout` / `cleaner purify` refuse in one line, before the stage writes anything."""
    from flows.cli import main

    root, run = world_copy.storage.root, "w2" if stage == "rollout" else "w"
    assert main([stage, "--run", run, "--iteration", "0", f"storage.root={root}", f"{stage}.device=cuda:1"]) == 1
    lines = capsys.readouterr().err.strip().splitlines()
    assert lines[-1].startswith(f"cleaner {stage}: {stage}.device=cuda:1: no CUDA device"), lines
    assert not any("Traceback" in x for x in lines)
    layout = RunLayout(root, run)
    assert not (layout.raw_dir(0) if stage == "rollout" else layout.raw_dir(0).parent / "purified").exists()


def test_a_device_that_is_no_device_is_refused_by_the_config():
    with pytest.raises(ConfigError, match=r"train.device: .*expected auto, cpu, cuda or cuda:N"):
        load_config(None, ["train.device=gpu"])
    for setting in ("auto", "cpu", "cuda", "cuda:3"):
        assert load_config(None, [f"purify.device={setting}"]).purify.device == setting


def test_fp16_on_the_local_strategy_and_offload_without_deepspeed_are_refused_by_the_config():
    with pytest.raises(ConfigError, match="train.param_dtype=fp16 needs a loss scale"):
        load_config(None, ["train.param_dtype=fp16"])
    with pytest.raises(ConfigError, match="train.offload_optimizer=true .* needs train.strategy=deepspeed"):
        load_config(None, ["train.offload_optimizer=true"])


def test_flash_attention_without_its_kernels_is_one_line(tmp_path, capsys):
    from trainer.openrlhf_compat import flash_attention_kernels

    if flash_attention_kernels() is None and torch.cuda.is_available():
        pytest.skip("flash-attn's CUDA kernels are here")
    ws = tmp_path / "ws"
    refused(
        ["train", f"storage.root={ws}", "train.attn_implementation=flash_attention_2"],
        capsys,
        1,
        "train.attn_implementation=flash_attention_2",
        "train.attn_implementation=sdpa",
    )
    assert not ws.exists()


class _CudaDouble:
    """Stands in for torch.cuda on this CPU machine (test double): a node with `n` GPUs."""

    def __init__(self, n: int) -> None:
        self.n = n

    def is_available(self) -> bool:
        return True

    def device_count(self) -> int:
        return self.n

    def current_device(self) -> int:
        return 0

    def get_device_properties(self, device):  # an 80 GB card: the preflight's fit check reads its size
        from types import SimpleNamespace

        return SimpleNamespace(total_memory=80 * 2**30, name="H100 (double)")


def test_more_ranks_than_gpus_is_one_line(monkeypatch):
    from trainer.devices import check_device

    monkeypatch.setattr(torch, "cuda", _CudaDouble(2))
    cfg = load_config(
        None, ["train.strategy=deepspeed", "train.nproc=4", "rollout.engine=sglang", "purify.recompute=sglang"]
    )
    with pytest.raises(DeviceError, match=r"^train.nproc=4: more ranks than this machine's 2 GPU\(s\)"):
        check_device(cfg)
    cfg.train.nproc = 2
    check_device(cfg)  # as many ranks as GPUs
    cfg.train.device = "cuda:1"
    with pytest.raises(DeviceError, match="CUDA_VISIBLE_DEVICES"):
        check_device(cfg)
    with pytest.raises(DeviceError, match=r"cuda:5: this machine has 2 CUDA device"):
        resolve_device("cuda:5", "rollout.device")


def test_a_collective_failure_in_a_rank_is_one_line(monkeypatch, tmp_path, capsys):
    """A rank whose NCCL (here: gloo's) collective fails mid-update says so in one `cleaner:` line, which the
    launcher raises as the stage's error (a double raises the DistBackendError NCCL raises: no NCCL here)."""
    import trainer.distributed as distributed
    from torch.distributed import DistBackendError

    def lost(*_a, **_k):
        raise DistBackendError("NCCL error in: ProcessGroupNCCL.cpp:1935, unhandled system error\nmore lines")

    monkeypatch.setattr(distributed, "deepspeed_update", lost)
    monkeypatch.setenv("RANK", "1")
    frozen = tmp_path / "c.yaml"
    frozen.write_text(dump_config(load_config(None, [])))
    assert distributed.main([str(frozen), "w", "0"]) == 1
    (line,) = capsys.readouterr().out.strip().splitlines()
    assert line.startswith("cleaner: the update's ranks lost each other (rank 1: DistBackendError: NCCL error")
    assert "resumes after the last finished mini-batch" in line


# -- the same settings train the same update on the CPU ---------------------------------------------------------


def test_placement_is_in_no_hash_and_new_switches_at_their_defaults_keep_old_records():
    a, b = load_config(None, []), load_config(None, ["rollout.device=cpu", "purify.device=cpu", "train.device=cpu"])
    sections = ("rollout", "world", "purify", "train")
    assert a.section_hash(*sections) == b.section_hash(*sections)
    assert train_settings(a.train) == train_settings(b.train)
    # what a checkpoint of the cleaner before these settings recorded for the default train section
    assert train_settings(a.train) == "a9525b51a28d9df6"
    assert train_settings(load_config(None, ["train.gradient_checkpointing=true"]).train) != train_settings(a.train)


def _weights(ckpt):
    return load_file(str(ckpt / "model.safetensors"))


def test_checkpointing_sdpa_and_bf16_train_the_same_update(purified_run, tmp_path):
    """Activation checkpointing recomputes the same floats (weights equal), eager attention is SDPA's up to float
    rounding, and bf16 mixed precision keeps float32 weights that land near the fp32 update's."""

    def update(name, **train):
        cfg = purified_run.model_copy(deep=True)
        cfg.storage.root = copy_runs(purified_run.storage.root, tmp_path / name)
        for k, v in train.items():
            setattr(cfg.train, k, v)
        return _weights(run_update_stage(cfg, "w", 0, log=lambda *_: None))

    base = update("base")
    start = load_file(str(DEFAULT_POLICY / "model.safetensors"))

    def mean_gap(a, b):
        return float(torch.cat([(a[k] - b[k]).abs().flatten() for k in base]).mean())

    moved = mean_gap(base, start)
    assert moved > 1e-5  # it trained
    for name, settings, worst_gap in (
        ("ckpt", {"gradient_checkpointing": True}, 0.0),
        ("eager", {"attn_implementation": "eager"}, 1e-7),
        ("bf16", {"param_dtype": "bf16"}, moved / 4),
    ):  # measured: moved / 16
        got = update(name, **settings)
        assert all(t.dtype == torch.float32 for t in got.values()), name
        assert mean_gap(got, base) <= worst_gap, (name, mean_gap(got, base), moved)
