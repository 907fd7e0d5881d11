"""train.strategy=deepspeed: the same GRPO update on OpenRLHF's `DeepspeedStrategy` (ZeRO-2/3).

One process per rank under torchrun (see trainer/distributed.py). Each rank trains a share of every
mini-batch's groups; the loss is the token mean over the whole mini-batch (OpenRLHF's
`batch_num_tokens` + `dp_size`), so the update equals the local strategy's up to float rounding.

GPUs (train.device auto or cuda): OpenRLHF's own `setup_distributed` (`torch.cuda.set_device(LOCAL_RANK)`,
NCCL, CUDA device mesh); each rank's micro-batches and the update's own all-reduces are made on its GPU.
CPU (train.device=cpu, or auto without a GPU): the same strategy on gloo, with the three CUDA-only calls it makes
replaced (device mesh on "cpu", no `torch.cuda.set_device`, no `cuda.synchronize` after saving).

The optimizer is DeepSpeed's `torch_adam` path everywhere: torch.optim.AdamW on the ZeRO partitions (its fused
CUDA kernel on a GPU, prebuilt in torch), never DeepSpeed's FusedAdam or DeepSpeedCPUAdam, which a pure
DeepSpeed wheel (DS_BUILD_OPS=0) JIT-compiles with nvcc / a C++ compiler inside the run. With
train.offload_optimizer the float32 partitions and moments live in CPU memory (OpenRLHF's adam_offload) and the
step is torch's AdamW there. The schedule is the local strategy's warmup schedule.
"""

from __future__ import annotations

import contextlib
import math
import os
from pathlib import Path
from types import SimpleNamespace

import torch
from transformers import PreTrainedModel

from pipeline.config import TrainConfig
from pipeline.devices import DeviceError, prepare_device, resolve_device
from pipeline.trajectory import PurifiedTrajectory
from trainer.grpo import (
    DivergedError,
    GRPOUpdate,
    UpdateError,
    UpdateProgress,
    hyperparameters,
    keep_configured,
    load_schedule_state,
    warmup_schedule,
)
from trainer.chunked_actor import serve_through_engine
from trainer.inputs import copy_tokenizer_files
from trainer.openrlhf_compat import openrlhf_models
from trainer.resume import read_progress, tag_of, write_progress

STATE_TAG = "state"


def rank_device(cfg: TrainConfig) -> torch.device:
    """This rank's device: its own GPU (LOCAL_RANK) unless train.device resolves to the CPU."""
    device = resolve_device(cfg.device, "train.device")
    if device.type == "cpu":
        return device
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if local_rank >= torch.cuda.device_count():
        raise DeviceError(
            f"train.nproc: rank {local_rank} has no GPU of its own (this machine has "
            f"{torch.cuda.device_count()}); use train.nproc={torch.cuda.device_count()} or fewer"
        )
    return torch.device("cuda", local_rank)


def make_strategy(cfg: TrainConfig, device: torch.device):
    """OpenRLHF's DeepspeedStrategy, distributed initialised (torchrun's env: RANK, WORLD_SIZE, MASTER_*), on
    NCCL with this rank's GPU current when `device` is CUDA, else on gloo."""
    on_cpu = device.type == "cpu"
    if on_cpu:
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
    openrlhf_models()  # the flash_attn import shim on CPU, before OpenRLHF's strategy module imports models
    import deepspeed
    import torch.distributed as dist
    import openrlhf.utils.deepspeed.deepspeed as ds_module
    from torch.distributed.device_mesh import init_device_mesh

    world = int(os.environ.get("WORLD_SIZE", "1"))
    # bf16: gradients accumulate over a mini-batch's micro-batches in float32 (OpenRLHF's grad_accum_dtype;
    # DeepSpeed's default would accumulate them in bfloat16)
    args = SimpleNamespace(
        local_rank=-1,
        optim="adam",
        ds=SimpleNamespace(
            param_dtype=cfg.param_dtype,
            zero_stage=cfg.zero_stage,
            tensor_parallel_size=1,
            ring_attn_size=1,
            adam_offload=cfg.offload_optimizer,
            zpg=1,
            grad_accum_dtype="fp32" if cfg.param_dtype == "bf16" else None,
        ),
        train=SimpleNamespace(dynamic_batch_enable=False),
    )

    class Strategy(ds_module.DeepspeedStrategy):
        def get_ds_train_config(self, optim_dict=None, *, max_norm=None):
            config = super().get_ds_train_config(optim_dict, max_norm=max_norm)
            if "optimizer" in config:  # torch's AdamW: nothing compiled at run time (module docstring)
                config["optimizer"]["params"]["torch_adam"] = True
                if not on_cpu and not cfg.offload_optimizer:
                    config["optimizer"]["params"]["fused"] = True  # its partitions are on the GPU
            return config

    strategy = Strategy(
        seed=cfg.seed,
        max_norm=cfg.grad_clip,
        micro_train_batch_size=1,
        train_batch_size=world,
        zero_stage=cfg.zero_stage,
        args=args,
    )
    if not on_cpu:
        strategy.setup_distributed()  # torch.cuda.set_device(LOCAL_RANK), NCCL
        prepare_device(device)
        return strategy
    # OpenRLHF's setup_distributed on CPU, minus its CUDA calls
    deepspeed.init_distributed(dist_backend="gloo")
    strategy.world_size = dist.get_world_size()
    strategy.ds_device_mesh = init_device_mesh("cpu", (strategy.world_size, 1, 1), mesh_dim_names=("dp", "sp", "tp"))
    strategy.ring_attn_rank = 0
    strategy.accumulated_gradient = 1
    ds_module.torch_dist_barrier_and_cuda_sync = dist.barrier  # save_model's post-save sync, without CUDA
    return strategy


class DeepSpeedGRPOUpdate(GRPOUpdate):
    def __init__(self, model: torch.nn.Module, cfg: TrainConfig, strategy, temperature: float = 1.0) -> None:
        import torch.distributed as dist

        self.strategy = strategy
        self.dist = dist
        self.rank, self.world_size = dist.get_rank(), dist.get_world_size()
        # this rank's GPU on NCCL (DeepSpeed moves the model there), the CPU on gloo
        on_gpu = dist.get_backend() != "gloo"
        super().__init__(
            model,
            cfg,
            temperature,
            torch.device("cuda", torch.cuda.current_device()) if on_gpu else torch.device("cpu"),
        )

    def prepare(self, model: torch.nn.Module, actor) -> None:
        cfg = self.cfg
        prep = {
            "optim": "adam",
            "adam": {"lr": cfg.lr, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": cfg.weight_decay},
            "lr_scheduler": "constant",
            "scheduler_steps": 1,
            "max_norm": cfg.grad_clip,
        }
        if isinstance(model, PreTrainedModel):
            serve_through_engine(model)  # log-probs without full-vocabulary logits (trainer/chunked_actor.py)
        self.actor, self.optimizer, _ = self.strategy.prepare((actor, prep))
        self.engine = self.actor.model
        self.model = self.engine  # train()/eval() reach the wrapped module
        self.scheduler = warmup_schedule(self.engine.basic_optimizer, cfg)  # the torch optimizer inside ZeRO
        self.configured = hyperparameters(self.engine.basic_optimizer)
        self.engine.lr_scheduler = self.scheduler  # the engine steps it; same schedule as the local strategy

    def autocast(self):
        return contextlib.nullcontext()  # DeepSpeed's bf16/fp16 modes hold the weights in that dtype themselves

    def my_groups(self, groups: list[list[PurifiedTrajectory]]) -> list[list[PurifiedTrajectory]]:
        if len(groups) < self.world_size:
            raise UpdateError(
                f"a mini-batch has {len(groups)} prompt groups for {self.world_size} ranks; use fewer "
                f"train.mini_batches or ranks (train.nproc) so every rank gets a whole group"
            )
        return groups[self.rank :: self.world_size]

    def reduce(self, values: list[float]) -> list[float]:
        t = torch.tensor(values, dtype=torch.float64, device=self.device)  # NCCL reduces only GPU tensors
        self.dist.all_reduce(t)
        return t.tolist()

    def most(self, n: int) -> int:
        t = torch.tensor([n], dtype=torch.int64, device=self.device)
        self.dist.all_reduce(t, op=self.dist.ReduceOp.MAX)
        return int(t.item())

    def zero_grad(self) -> None:
        pass  # the engine zeroes (partitioned) gradients after each step

    def backward(self, loss: torch.Tensor, last: bool) -> None:
        # one optimizer step per mini-batch whatever its number of micro-batches
        self.engine.set_gradient_accumulation_boundary(last)
        self.engine.backward(loss, scale_wrt_gas=False)

    def step(self) -> float:
        self.engine.step()
        grad_norm = self.strategy.get_grad_norm(self.actor)
        if not math.isfinite(grad_norm):
            raise DivergedError(f"gradient norm is {grad_norm} at optimizer step {self.global_step}")
        return grad_norm

    # -- state: ZeRO checkpoints (every rank writes its partition) ----------------------------------
    def save_state(self, folder: Path, tag: str) -> None:
        self.engine.save_checkpoint(str(folder), tag=tag, client_state={"global_step": self.global_step})

    def load_state(self, folder: Path, tag: str | None = None) -> bool:
        if not (folder / "latest").is_file():
            return False
        _, client = self.engine.load_checkpoint(
            str(folder), tag=tag, load_optimizer_states=True, load_lr_scheduler_states=True
        )
        self.global_step = client["global_step"]
        # a state saved before the schedule was transformers' counted steps done: moved on by one
        load_schedule_state(self.scheduler, self.scheduler.state_dict(), self.global_step)
        keep_configured(self.engine.basic_optimizer, self.scheduler, self.configured)
        return True

    def save_progress(self, folder: Path, progress: UpdateProgress, key: str) -> None:
        """After mini-batch k: the ZeRO state under its tag (every rank), then (rank 0) progress.json names it."""
        self.save_state(folder, tag_of(progress))
        self.dist.barrier()
        if self.rank == 0:
            write_progress(folder, key, progress)
        self.dist.barrier()

    def resume_progress(self, folder: Path, key: str) -> UpdateProgress | None:
        """A partial update of the same inputs/settings, or None (then nothing is loaded)."""
        found = read_progress(folder, key)
        if found is None:
            return None
        tag, progress = found
        self.load_state(folder, tag)
        return progress

    def save_weights(self, out: Path, src: Path) -> None:
        # save_model ends with tokenizer.save_pretrained(out): here, src's tokenizer files copied
        tokenizer = SimpleNamespace(save_pretrained=lambda folder: copy_tokenizer_files(src, Path(folder)))
        self.strategy.save_model(self.actor, tokenizer, str(out), safe_serialization=True)
