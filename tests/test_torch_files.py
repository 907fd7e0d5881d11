"""trainer/torch_files.py: a full disk while saving a state is an OSError naming the file (a user's full disk ended
in torch's `RuntimeError: [enforce fail at inline_container.cc:672] . unexpected pos …`, then 140 lines)."""

from __future__ import annotations

import errno
from pathlib import Path

import pytest
import torch

from trainer.torch_files import save_torch


@pytest.mark.skipif(not Path("/dev/full").exists(), reason="needs /dev/full (every write: ENOSPC)")
def test_a_full_disk_is_an_oserror_not_torchs_runtime_error():
    with pytest.raises(OSError) as e:
        save_torch({"w": torch.zeros(1 << 16)}, Path("/dev/full"))
    assert e.value.errno == errno.ENOSPC and not isinstance(e.value, RuntimeError)


def test_a_saved_state_loads_back(tmp_path):
    state = {"w": torch.arange(10.0), "step": 3}
    save_torch(state, tmp_path / "s.pt")
    back = torch.load(tmp_path / "s.pt")
    assert back["step"] == 3 and torch.equal(back["w"], state["w"])
