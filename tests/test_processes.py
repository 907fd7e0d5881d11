"""The processes cleaner starts die with their starter (pipeline/processes.py dies_with), with the signal asked."""

from __future__ import annotations

import os
import subprocess
import sys
import time

from pipeline.processes import alive
from tests.flow_helpers import ROOT

# the starter: a child under dies_with(SIGTERM) that records the signal it gets, then waits to be killed
STARTER = """
import os, signal, subprocess, sys
from pipeline.processes import dies_with
child = ("import signal, sys, time\\n"
         "def got(sig, _): open(sys.argv[1], 'w').write(signal.Signals(sig).name); sys.exit(0)\\n"
         "signal.signal(signal.SIGTERM, got)\\nprint('ready', flush=True)\\ntime.sleep(600)")
p = subprocess.Popen([sys.executable, "-c", child, sys.argv[1]], stdout=subprocess.PIPE, text=True,
                     preexec_fn=dies_with(os.getpid(), signal.SIGTERM))
assert p.stdout.readline().strip() == "ready"
print(p.pid, flush=True)
signal.pause()
"""


def test_a_child_started_with_dies_with_gets_its_signal_when_the_starter_is_killed(tmp_path):
    record = tmp_path / "signal"
    starter = subprocess.Popen(
        [sys.executable, "-c", STARTER, str(record)],
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    child = int(starter.stdout.readline())
    assert alive(child) and not record.exists()
    starter.kill()  # kill -9: no handler of the starter's runs, only the kernel's PR_SET_PDEATHSIG
    starter.wait()
    for _ in range(1200):  # the child exits once it has recorded the signal (a failure gives up after a minute)
        if not alive(child):
            break
        time.sleep(0.05)
    assert record.read_text() == "SIGTERM"
