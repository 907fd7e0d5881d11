"""Import OpenRLHF's models on a CPU-only machine.

`openrlhf.models` imports `flash_attn`, whose interface module imports the compiled
`flash_attn_2_cuda` at import time; on CPU that extension does not exist. When (and only when) the
real module is absent, a stand-in with a proper ModuleSpec is registered whose every attribute
access raises and is counted: cleaner never calls flash-attn kernels (eager/SDPA attention,
packing off), and `SHIM.touched` lets a test prove it.
"""

from __future__ import annotations

import importlib.machinery
import importlib.util
import logging
import sys
import types

log = logging.getLogger("cleaner.trainer")


class _KernelShim(types.ModuleType):
    def __init__(self, name: str) -> None:
        super().__init__(name)
        self.__spec__ = importlib.machinery.ModuleSpec(name, loader=None)
        self.__dict__["touched"] = []

    def __getattr__(self, attr: str):
        if attr.startswith("__"):
            raise AttributeError(attr)
        self.__dict__["touched"].append(attr)
        raise RuntimeError(f"{self.__name__}.{attr}: CUDA flash-attention kernels are not available on CPU")


SHIM: _KernelShim | None = None


def flash_attention_kernels() -> str | None:
    """None when flash_attn's compiled CUDA kernels can be imported (train.attn_implementation=flash_attention_2),
    else why not."""
    if importlib.util.find_spec("flash_attn") is None:
        return "the flash_attn package is not installed"
    try:
        spec = importlib.util.find_spec("flash_attn_2_cuda")  # the shim below has a spec without a loader
    except ValueError:
        spec = None
    if spec is None or spec.loader is None:
        return "flash_attn is installed without its CUDA kernels (flash_attn_2_cuda)"
    return None


def install_shims() -> None:
    global SHIM
    if "flash_attn_2_cuda" in sys.modules or importlib.util.find_spec("flash_attn_2_cuda") is not None:
        return
    SHIM = _KernelShim("flash_attn_2_cuda")
    sys.modules["flash_attn_2_cuda"] = SHIM
    log.info("flash_attn_2_cuda is absent (CPU): registered an import shim that refuses every kernel call")


def openrlhf_models():
    install_shims()
    import openrlhf.models as models

    return models
