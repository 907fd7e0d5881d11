"""What the stages' settings need of the machine, checked before a training flow (or an update) writes anything:
each refusal one line naming the setting."""

from __future__ import annotations

from pipeline.config import CleanerConfig, TrainConfig
from pipeline.devices import DeviceError, resolve_device


def check_device(cfg: CleanerConfig) -> None:
    """The devices rollout.device, purify.device and train.device name exist here (each only where its stage
    computes with torch in this process), and the update's precision, rank count and attention fit them."""
    if cfg.rollout.engine == "cpu":
        resolve_device(cfg.rollout.device, "rollout.device")
    if cfg.purify.recompute == "cpu" and cfg.purify.runner.lower() in ("fnapirunner", "directrunner"):
        resolve_device(cfg.purify.device, "purify.device")  # on a cluster, the workers' devices count
    check_train_device(cfg.train)
    device = resolve_device(cfg.train.device, "train.device")
    if device.type == "cuda":  # a model that will not fit: one line now, not an out-of-memory mid-update
        import torch

        card = torch.cuda.get_device_properties(device)
        check_update_fits(cfg, card.total_memory, card.name)


def check_update_fits(cfg: CleanerConfig, gpu_bytes: float, card: str, longest: int | None = None) -> None:
    """The update's estimated peak per GPU (trainer/memory.py) at the longest trajectory the rollout may write (or
    `longest`, a partition's own longest row) fits `gpu_bytes`; else one line naming the settings, the estimate and
    what would fit (`cleaner fit` shows more)."""
    from pathlib import Path

    from trainer.memory import DoesNotFit, ModelShape, Plan, check_fits, this_host_memory

    budget = cfg.rollout.max_prompt_tokens + cfg.rollout.max_response_tokens
    plan = Plan.from_train(cfg.train, longest or budget)
    shape = ModelShape.from_path(Path(cfg.rollout.policy))
    try:
        check_fits(shape, plan, plan.ranks, gpu_bytes, card, host_bytes=this_host_memory())
    except DoesNotFit as e:
        if longest is None:
            raise
        raise DoesNotFit(
            f"the partition's longest trajectory is {longest} tokens, longer than rollout.max_prompt_tokens + "
            f"rollout.max_response_tokens = {budget} the preflight sized (an import, or a replay under other "
            f"settings): {e}"
        ) from None


def longest_trajectory(part) -> int:
    """Tokens of the longest row (prompt and response) of a purified partition that trains a token (the update
    forwards no other: trainer.batches.trained_rows), from its id and mask columns alone."""
    import numpy as np
    import pyarrow.compute as pc

    from storage.schemas import PURIFIED
    from storage.shards import read_shard

    table = read_shard(part, PURIFIED, columns=["prompt_ids", "response_ids", "loss_mask"])
    if table.num_rows == 0:
        return 0
    lengths = pc.add(pc.list_value_length(table["prompt_ids"]), pc.list_value_length(table["response_ids"]))
    mask = table["loss_mask"].combine_chunks()
    trained = np.bincount(
        pc.list_parent_indices(mask).to_numpy(), weights=pc.list_flatten(mask).to_numpy(), minlength=table.num_rows
    )
    lengths = lengths.to_numpy(zero_copy_only=False)[trained > 0]
    return int(lengths.max()) if len(lengths) else 0


def check_partition_fits(cfg: CleanerConfig, part) -> None:
    """On a GPU, a partition whose longest row is past the rollout's budget (which the flow's preflight sized) is
    sized again at its own length, before the trainer loads."""
    device = resolve_device(cfg.train.device, "train.device")
    if device.type != "cuda":
        return
    longest = longest_trajectory(part)
    if longest > cfg.rollout.max_prompt_tokens + cfg.rollout.max_response_tokens:
        import torch

        card = torch.cuda.get_device_properties(device)
        check_update_fits(cfg, card.total_memory, card.name, longest=longest)


def check_train_device(train: TrainConfig) -> None:
    """train.device exists here, and the update's precision, rank count and attention fit it."""
    import torch

    device = resolve_device(train.device, "train.device")
    on_gpu = device.type == "cuda"
    if train.strategy == "deepspeed" and train.param_dtype == "fp16" and not on_gpu:
        # on CPU (gloo) DeepSpeed refuses it, and the refusal came after a whole rollout and purification, as a
        # rank's traceback
        from trainer.grpo import UpdateError

        raise UpdateError(
            "train.param_dtype=fp16 needs a GPU: DeepSpeed on CPU (gloo) trains in fp32 or bf16 "
            "(train.param_dtype=bf16)"
        )
    if train.strategy == "deepspeed" and on_gpu:
        if train.device.startswith("cuda:"):
            raise DeviceError(
                f"train.device={train.device}: strategy=deepspeed puts rank r on GPU r (LOCAL_RANK); "
                "choose the GPUs with CUDA_VISIBLE_DEVICES and set train.device=cuda"
            )
        if train.nproc > torch.cuda.device_count():
            raise DeviceError(
                f"train.nproc={train.nproc}: more ranks than this machine's {torch.cuda.device_count()} "
                f"GPU(s) (one rank per GPU under NCCL); use train.nproc={torch.cuda.device_count()} "
                "or fewer"
            )
    if train.attn_implementation == "flash_attention_2":
        from trainer.openrlhf_compat import flash_attention_kernels

        missing = flash_attention_kernels()
        if missing or not on_gpu:
            why = missing or f"train.device resolves to {device.type}, and its kernels run on a GPU only"
            raise DeviceError(f"train.attn_implementation=flash_attention_2: {why}; use train.attn_implementation=sdpa")
