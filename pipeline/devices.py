"""Where a stage computes: the device its config names (rollout.device, purify.device, train.device), resolved
once, and the few process-wide switches a CUDA device wants. Every module, tensor and random generator of a stage
is made on, or moved to, the device resolved here (tests/test_devices.py checks that each names it)."""

from __future__ import annotations

import torch

from storage.errors import CleanerError


class DeviceError(CleanerError, RuntimeError):
    """A device setting this machine cannot honour: one line naming the setting, before anything runs."""


def resolve_device(setting: str | torch.device, key: str) -> torch.device:
    """`setting` (auto, cpu, cuda, cuda:N, or a torch.device) as the device to compute on; `key` names the setting
    in the refusal. auto: the first GPU torch sees (cuda:LOCAL_RANK's own device after torch.cuda.set_device),
    else the CPU."""
    if isinstance(setting, torch.device):
        return setting
    if setting == "auto":
        setting = "cuda" if torch.cuda.is_available() else "cpu"
    device = torch.device(setting)
    if device.type != "cuda":
        return device
    if not torch.cuda.is_available():
        build = "a CPU-only torch build" if torch.version.cuda is None else f"torch built for CUDA {torch.version.cuda}"
        raise DeviceError(
            f"{key}={setting}: no CUDA device on this machine ({build}, torch.cuda.is_available() is "
            f"False); use {key}=cpu, or auto (the GPU when there is one)"
        )
    count = torch.cuda.device_count()
    if device.index is not None and device.index >= count:
        raise DeviceError(f"{key}={setting}: this machine has {count} CUDA device(s), cuda:0 to cuda:{count - 1}")
    if device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    return device


def prepare_device(device: torch.device) -> None:
    """Process-wide settings for computing on `device`: on CUDA, float32 matmuls and convolutions on TF32 tensor
    cores (float32 weights and activations, 10-bit mantissa products: without it an H100 runs float32 at ~67
    TFLOP/s instead of ~490), which is what PyTorch's 'high' precision means. Nothing changes on the CPU."""
    if device.type == "cuda":
        torch.cuda.set_device(device)
        torch.set_float32_matmul_precision("high")
        torch.backends.cudnn.allow_tf32 = True


def generator(device: torch.device, seed: int) -> torch.Generator:
    """A random generator on `device` seeded with `seed` (a CUDA tensor cannot draw from a CPU generator)."""
    return torch.Generator(device=device).manual_seed(seed)
