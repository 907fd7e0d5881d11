"""What the update's settings need of the machine, checked before a training flow writes anything."""
from __future__ import annotations

from pipeline.config import TrainConfig


def check_device(train: TrainConfig) -> None:
    """train.param_dtype=fp16 under DeepSpeed needs a GPU: on CPU (gloo) DeepSpeed refuses it, and the refusal
    came after a whole rollout and purification, as a rank's traceback."""
    if train.strategy == "deepspeed" and train.param_dtype == "fp16":
        import torch

        if not torch.cuda.is_available():
            from trainer.grpo import UpdateError

            raise UpdateError("train.param_dtype=fp16 needs a GPU: DeepSpeed on CPU (gloo) trains in fp32 or bf16 "
                              "(train.param_dtype=bf16)")
