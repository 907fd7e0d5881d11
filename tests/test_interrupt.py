"""Ctrl-C during a command, as from a terminal (SIGINT to its process group): one line that says how to go on,
exit 130, no traceback (it printed 50-90 lines of KeyboardInterrupt and CancelledError). What a rerun resumes is
tested where each stage's resume is (test_flows, test_resume_update)."""
from __future__ import annotations

import os
import signal
import time

import pytest

from tests.flow_helpers import cleaner, tiny_config


def _as_from_a_terminal() -> None:
    signal.signal(signal.SIGINT, signal.SIG_DFL)  # a parent without job control starts us with SIGINT ignored


@pytest.mark.parametrize("command", ["rollout", "train"])
def test_ctrl_c_is_one_line_that_says_how_to_resume(tmp_path, command):
    args = ["rollout", "--run", "c", "rollout.tasks_per_iteration=8"] if command == "rollout" else [
        "train", "-c", str(tiny_config(tmp_path))]
    log = tmp_path / "out.log"
    with open(log, "w") as out:
        p = cleaner([*args, f"storage.root={tmp_path}"], tmp_path, stdout=out, preexec_fn=_as_from_a_terminal)
    try:
        deadline = time.time() + 180
        while "rollout it 0]" not in log.read_text() and time.time() < deadline and p.poll() is None:
            time.sleep(0.2)
        assert p.poll() is None, log.read_text()
        time.sleep(2)  # at work: the sandbox and the engine started
        os.killpg(p.pid, signal.SIGINT)
        code = p.wait(timeout=120)
    finally:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
    text = log.read_text()
    assert code == 130 and "Traceback" not in text, text[-4000:]
    assert text.strip().splitlines()[-1] == (f"cleaner {command}: interrupted; run the same command again to resume "
                                             "(what was committed is kept)"), text[-2000:]
