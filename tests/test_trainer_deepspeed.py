"""train.strategy=deepspeed: OpenRLHF's DeepspeedStrategy (ZeRO-2/3) on two real torchrun ranks over gloo
(CPU), against the local strategy on the same purified shard, plus exact resume and refusals."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from storage.layout import RunLayout
from storage.schemas import METRICS
from storage.shards import read_shard
from trainer.grpo import UpdateError
from trainer.stage import run_update_stage
from storage.checkpoints import DONE_MARKER

pytest.importorskip("deepspeed")


def _cfg(purified, root, **train):
    shutil.copytree(purified.storage.root / "runs", root / "runs")
    c = purified.model_copy(deep=True)
    c.storage.root = root
    c.train.mini_batches, c.train.lr, c.train.epochs = 3, 1e-4, 2
    for k, v in train.items():
        setattr(c.train, k, v)
    return c


def _weights(ckpt):
    return load_file(str(ckpt / "model.safetensors"))


def _logged_lrs(root):
    rows = read_shard(RunLayout(root, "w").metrics_dir(0, "update"), METRICS).to_pylist()
    return [r["value"] for r in sorted(rows, key=lambda r: r["step"]) if r["name"] == "lr"]


def _warmup_rule(c):
    """lr * min(1, (s + 1) / warmup_steps) for optimizer step s: the local strategy's documented schedule."""
    w = max(1, c.train.warmup_steps)
    return [c.train.lr * min(1.0, (s + 1) / w) for s in range(6)]


def _max_diff(a, b):
    return max((a[k] - b[k]).abs().max().item() for k in a.keys() & b.keys())


@pytest.fixture(scope="module")
def local_update(purified_run, tmp_path_factory):
    return run_update_stage(_cfg(purified_run, tmp_path_factory.mktemp("local")), "w", 0, log=lambda *_: None)


@pytest.fixture(scope="module")
def zero2_update(purified_run, tmp_path_factory):
    lines = []
    cfg = _cfg(purified_run, tmp_path_factory.mktemp("zero2"), strategy="deepspeed", nproc=2, zero_stage=2)
    out = run_update_stage(cfg, "w", 0, log=lines.append), lines
    assert cfg.train.warmup_steps >= 2 and _logged_lrs(cfg.storage.root) == _warmup_rule(cfg)  # the schedule, exactly
    return out


def test_zero2_on_two_ranks_equals_the_local_update(local_update, zero2_update):
    ds, lines = zero2_update
    assert (ds / DONE_MARKER).is_file() and (ds / "deepspeed" / "latest").is_file()
    assert (ds / "tokenizer.json").read_bytes() == (local_update / "tokenizer.json").read_bytes()
    assert any("ZeRO-2" in x for x in lines) and sum("[update] step" in x for x in lines) == 6
    a, b = _weights(local_update), _weights(ds)
    assert set(b) - set(a) <= {"lm_head.weight"}  # OpenRLHF's save_model also writes the tied head
    assert torch.equal(b.get("lm_head.weight", b["model.embed_tokens.weight"]), b["model.embed_tokens.weight"])
    # each rank trains half of every mini-batch's groups; the token-mean loss makes the sum the same update
    assert _max_diff(a, b) < 2e-5
    from pipeline.config import DEFAULT_POLICY

    assert _max_diff(a, load_file(str(DEFAULT_POLICY / "model.safetensors"))) > 1e-4  # and it did train


def test_zero3_on_two_ranks_equals_the_local_update(purified_run, local_update, tmp_path):
    cfg = _cfg(purified_run, tmp_path, strategy="deepspeed", nproc=2, zero_stage=3)
    ds = run_update_stage(cfg, "w", 0, log=lambda *_: None)
    assert _max_diff(_weights(local_update), _weights(ds)) < 2e-5


def test_resume_after_a_minibatch_gives_the_uninterrupted_weights(purified_run, zero2_update, tmp_path):
    cfg = _cfg(purified_run, tmp_path, strategy="deepspeed", nproc=2, zero_stage=2)
    partial = run_update_stage(cfg, "w", 0, stop_after=2, log=lambda *_: None)
    assert (partial / "progress.json").is_file()
    assert not (RunLayout(tmp_path, "w").checkpoint_dir(1) / DONE_MARKER).exists()
    lines = []
    done = run_update_stage(cfg, "w", 0, log=lines.append)
    assert any("resuming after mini-batch 2" in x for x in lines)
    assert _logged_lrs(tmp_path) == _warmup_rule(cfg)  # the schedule continued from the ZeRO checkpoint
    a, b = _weights(zero2_update[0]), _weights(done)
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert not partial.exists()


def test_more_ranks_than_groups_is_a_clear_error(purified_run, tmp_path):
    cfg = _cfg(purified_run, tmp_path, strategy="deepspeed", nproc=2, mini_batches=16)  # one group per mini-batch
    # a config read whole is refused when loaded (tests/test_config_cli.py); this one, changed after it was read,
    # is refused by the ranks when they read it
    with pytest.raises(UpdateError, match=r"holds 1 prompt group\(s\) .*train.mini_batches=16"):
        run_update_stage(cfg, "w", 0, log=lambda *_: None)
    assert not RunLayout(tmp_path, "w").checkpoint_dir(1).exists()


def test_zero3_with_the_optimizer_offloaded_equals_the_local_update(purified_run, local_update, tmp_path):
    """train.offload_optimizer (OpenRLHF's adam_offload): the ZeRO-3 partitions' AdamW step runs on CPU memory with
    torch's AdamW (DeepSpeed's torch_adam switch: no DeepSpeedCPUAdam to compile), the same update."""
    cfg = _cfg(purified_run, tmp_path, strategy="deepspeed", nproc=2, zero_stage=3, offload_optimizer=True)
    ds = run_update_stage(cfg, "w", 0, log=lambda *_: None)
    assert _max_diff(_weights(local_update), _weights(ds)) < 2e-5


def _logged(root, name):
    rows = read_shard(RunLayout(root, "w").metrics_dir(0, "update"), METRICS).to_pylist()
    return [r["value"] for r in sorted(rows, key=lambda r: r["step"]) if r["name"] == name]


def test_bf16_on_deepspeed_trains_the_fp32_update_up_to_rounding(purified_run, local_update, tmp_path):
    """DeepSpeed's bf16 mode (bfloat16 weights and micro-batch gradients, float32 master weights, gradient
    accumulation and AdamW moments): every step's loss and gradient norm are the fp32 update's up to bfloat16's
    rounding (measured: within 4%), and the weights it saves are bfloat16, closer to the fp32 update's than to
    where they started."""
    from pipeline.config import DEFAULT_POLICY

    cfg = _cfg(purified_run, tmp_path, strategy="deepspeed", nproc=2, zero_stage=2, param_dtype="bf16")
    ds = _weights(run_update_stage(cfg, "w", 0, log=lambda *_: None))
    local_root = local_update.parents[3]
    for name, floor in (("loss", 1e-3), ("grad_norm", 1e-3)):
        want, got = _logged(local_root, name), _logged(tmp_path, name)
        assert len(got) == len(want) == 6
        assert all(abs(g - w) <= max(floor, 0.1 * abs(w)) for g, w in zip(got, want)), (name, got, want)
    start, fp32 = load_file(str(DEFAULT_POLICY / "model.safetensors")), _weights(local_update)
    matrices = [k for k in fp32.keys() & ds.keys() if fp32[k].ndim == 2]
    assert {ds[k].dtype for k in matrices} == {torch.bfloat16}

    def mean_gap(a, b):
        return float(torch.cat([(a[k].float() - b[k].float()).abs().flatten() for k in matrices]).mean())

    assert mean_gap(ds, {k: v.to(torch.bfloat16) for k, v in fp32.items()}) < mean_gap(ds, start)


def _ranks_of(root, launcher: bool = False) -> list[int]:
    """pids of torchrun ranks (trainer.distributed) working on a store under `root` (`launcher`: of torchrun)."""
    pids = []
    for proc in Path("/proc").iterdir():
        try:
            cmdline = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode()
        except (OSError, ValueError):
            continue
        if proc.name.isdigit() and "trainer.distributed" in cmdline and str(root) in cmdline:
            if launcher == ("torch.distributed.run" in cmdline):
                pids.append(int(proc.name))
    return pids


def _started_update(purified_run, root, log_path):
    """`cleaner update` of iteration 0 on two gloo ranks, returned once both ranks are working."""
    import time

    from tests.flow_helpers import cleaner

    shutil.copytree(purified_run.storage.root / "runs", root / "runs")
    out = open(log_path, "w")
    args = ["update", "--run", "w", "--iteration", "0", "train.strategy=deepspeed", "train.nproc=2"]
    p = cleaner([*args, "train.mini_batches=3", "train.epochs=2", f"storage.root={root}"], root, stdout=out)
    deadline = time.time() + 120
    while len(_ranks_of(root)) < 2 and time.time() < deadline and p.poll() is None:
        time.sleep(0.2)
    while "[update] strategy=deepspeed" not in log_path.read_text() and time.time() < deadline:
        time.sleep(0.2)
    assert len(_ranks_of(root)) == 2 and p.poll() is None, log_path.read_text()[-3000:]
    return p


def test_killing_the_command_stops_its_ranks(purified_run, tmp_path):
    """kill -9 of `cleaner update` left torchrun and its ranks training on their own (on GPUs: holding the cards,
    and a rerun would start a second torchrun beside them); torchrun now dies with the command and stops them."""
    import os
    import signal
    import time

    root = tmp_path / "ws"
    p = _started_update(purified_run, root, tmp_path / "out.log")
    os.kill(p.pid, signal.SIGKILL)  # the command alone, not its process group
    p.wait(timeout=30)
    deadline = time.time() + 5  # torchrun stops its ranks at once (before, they ran until a write hit the pipe)
    while (_ranks_of(root) or _ranks_of(root, launcher=True)) and time.time() < deadline:
        time.sleep(0.1)
    left = _ranks_of(root) + _ranks_of(root, launcher=True)
    for pid in left:
        os.kill(pid, signal.SIGKILL)
    assert not left, "torchrun or its ranks outlived the command"


def test_a_rank_killed_mid_update_is_one_line_naming_it(purified_run, tmp_path):
    """A rank lost mid-update (a GPU's Xid, an OOM kill): the line names the rank that ended first and how, not the
    other rank's gloo/NCCL read error (it printed rank 0's 25-line traceback and blamed rank 0)."""
    import os
    import signal

    root = tmp_path / "ws"
    log = tmp_path / "out.log"
    p = _started_update(purified_run, root, log)
    victim = max(_ranks_of(root))  # started second: local rank 1
    os.kill(victim, signal.SIGKILL)
    assert p.wait(timeout=120) != 0
    last = log.read_text().strip().splitlines()[-1]
    assert last.startswith("cleaner update: deepspeed update of iteration 0 failed: rank ") and "SIGKILL" in last, last
    assert "resumes after the last finished mini-batch" in last and "Traceback" not in log.read_text()
    assert not RunLayout(root, "w").checkpoint_dir(1).exists()


def test_a_checkpoint_continues_only_under_the_strategy_and_zero_layout_that_wrote_it(
    purified_run, local_update, zero2_update
):
    """`cleaner update` of a later iteration with another strategy or ZeRO layout than its checkpoint's: local ->
    deepspeed silently restarted AdamW and the LR warm-up; ZeRO-2 on 2 ranks -> ZeRO-3 or 3 ranks failed inside
    DeepSpeed (25 traceback lines, and a rerun 'resumed' into the same failure). Refused before torchrun starts."""
    from storage.errors import CheckpointError
    from trainer.inputs import check_trainer_state

    zero2, _ = zero2_update

    def cfg(**train):
        c = purified_run.model_copy(deep=True)
        for k, v in train.items():
            setattr(c.train, k, v)
        return c

    check_trainer_state(cfg(strategy="deepspeed", nproc=2, zero_stage=2), zero2)  # as it was written: goes on
    check_trainer_state(cfg(), local_update)
    with pytest.raises(CheckpointError, match=r"deepspeed: missing \(the checkpoint was written by train.strategy"):
        check_trainer_state(cfg(strategy="deepspeed", nproc=2), local_update)
    with pytest.raises(CheckpointError, match="ZeRO-2 state of 2 rank.*train.nproc=3 train.zero_stage=2"):
        check_trainer_state(cfg(strategy="deepspeed", nproc=3, zero_stage=2), zero2)
    with pytest.raises(CheckpointError, match="use train.nproc=2 train.zero_stage=2"):
        check_trainer_state(cfg(strategy="deepspeed", nproc=2, zero_stage=3), zero2)
    with pytest.raises(CheckpointError, match="written by train.strategy=deepspeed; continue with its strategy"):
        check_trainer_state(cfg(), zero2)
    check_trainer_state(cfg(fresh_optimizer=True), zero2)  # asked for knowingly: AdamW and warm-up start again
    check_trainer_state(cfg(strategy="deepspeed", nproc=3, fresh_optimizer=True), zero2)
