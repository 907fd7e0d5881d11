"""A torch function mode that holds a stage's code to its device (tests/test_devices.py).

While it is active, every torch call made from the stages' own code (pipeline/, rollout_gen/, purifier/,
trainer/; library code such as transformers, OpenRLHF or DeepSpeed is theirs to answer for) is checked:

- a tensor factory (torch.tensor, zeros, arange, …) must name its device: without `device=` it makes a CPU tensor
  whatever the stage's device is, which on a GPU is a device mismatch or a silent host round trip;
- a random generator must be made with a device (a CUDA tensor cannot draw from a CPU generator);
- every tensor the call computes with, and every generator it draws from, must be on the stage's device type.

On a CPU-only machine the last check cannot tell devices apart (every tensor is on the CPU); the first two can:
they fail on code that would put a tensor or a generator on the CPU while its stage runs on a GPU. On a GPU
machine the same tests run with the stage on CUDA, where all three bite.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_leaves

ROOT = Path(__file__).resolve().parent.parent
STAGE_CODE = tuple(str(ROOT / package) + "/" for package in ("pipeline", "rollout_gen", "purifier", "trainer"))
TORCH_CODE = os.path.dirname(torch.__file__) + "/"
OVERRIDES = TORCH_CODE + "overrides.py"
FACTORIES = {
    torch.tensor,
    torch.as_tensor,
    torch.zeros,
    torch.ones,
    torch.full,
    torch.empty,
    torch.arange,
    torch.rand,
    torch.randn,
    torch.randint,
    torch.randperm,
    torch.eye,
    torch.linspace,
    torch.scalar_tensor,
}


def stage_frame(func=None, depth: int = 2) -> str | None:
    """`file:line` of the stage code that made the torch call in progress (None: library code made it, torch's
    own included: Module.to moving weights onto the stage's device is torch's call, not the stage's)."""
    frame = sys._getframe(depth)
    # a torch function written in Python (F.rms_norm, Tensor.split, ...) reaches the mode through torch's
    # overrides from its own frame: the caller is the frame above those
    while frame is not None and frame.f_code.co_filename.startswith(OVERRIDES):
        frame = frame.f_back
    if (
        func is not None
        and frame is not None
        and frame.f_code.co_filename.startswith(TORCH_CODE)
        and frame.f_code.co_name == getattr(func, "__name__", None)
    ):
        frame = frame.f_back
    if frame is None or not frame.f_code.co_filename.startswith(STAGE_CODE):
        return None
    return f"{Path(frame.f_code.co_filename).relative_to(ROOT)}:{frame.f_lineno}"


class DeviceDiscipline(TorchFunctionMode):
    def __init__(self, device: torch.device | str) -> None:
        super().__init__()
        self.device = torch.device(device)
        self.violations: list[str] = []
        self.checked = 0  # calls from stage code: proof that the mode saw the stage at all
        self._generator = None

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        where = stage_frame(func)
        if where is not None:
            self.checked += 1
            name = getattr(func, "__name__", str(func))
            if func in FACTORIES and kwargs.get("device") is None:
                self.violations.append(f"{where}: torch.{name} without device=")
            for leaf in tree_leaves((args, kwargs)):
                if isinstance(leaf, (torch.Tensor, torch.Generator)) and leaf.device.type != self.device.type:
                    what = "generator" if isinstance(leaf, torch.Generator) else "tensor"
                    self.violations.append(
                        f"{where}: {name} on a {what} on {leaf.device}, the stage is on {self.device}"
                    )
        return func(*args, **kwargs)

    def __enter__(self):
        # torch.Generator is a class, not a torch function: its construction is watched by a subclass in its place
        mode = self

        class WatchedGenerator(_REAL_GENERATOR):
            def __new__(cls, device=None):
                where = stage_frame()
                if where is not None and device is None:
                    mode.violations.append(f"{where}: torch.Generator without device=")
                return _REAL_GENERATOR.__new__(cls, device if device is not None else "cpu")

            def __init__(self, device=None):
                pass

        torch.Generator = WatchedGenerator
        return super().__enter__()

    def __exit__(self, *exc):
        torch.Generator = _REAL_GENERATOR
        return super().__exit__(*exc)


_REAL_GENERATOR = torch.Generator
