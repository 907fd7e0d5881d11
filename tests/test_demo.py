"""`cleaner demo` end to end at a small size, and the follow-up commands it prints work as printed:
copied into a shell (another working directory), they look at the same workspace."""

from __future__ import annotations

import shlex

from tests.flow_helpers import run_cleaner


def test_demo_prints_commands_that_look_at_the_same_workspace(tmp_path):
    root = tmp_path / "my workspace"  # a space: the printed commands must quote it
    demo = run_cleaner(
        [
            "demo",
            f"storage.root={root}",
            "flow.iterations=1",
            "rollout.tasks_per_iteration=2",
            "rollout.samples_per_prompt=2",
            "flow.replay_gammas=[0.9]",
        ],
        timeout=900,
    )
    assert demo.returncode == 0, demo.stderr[-3000:]
    lines = demo.stdout.splitlines()
    printed = [ln.strip() for ln in lines if ln.strip().startswith(("cleaner inspect", "replay      cleaner"))]
    inspect = next(ln for ln in printed if "purify_compare" in ln)
    replay = next(ln for ln in printed if ln.startswith("replay")).split(None, 1)[1]
    viewer = next(ln.strip() for ln in lines if ln.strip().startswith("viewer      cleaner view")).split(None, 1)[1]
    replay_argv = shlex.split(replay)
    assert shlex.split(viewer.split("   (")[0])[2:] == replay_argv[2 : replay_argv.index("--run")]  # same config
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    for command in (inspect, replay):
        argv = shlex.split(command)
        assert argv[0] == "cleaner"
        p = run_cleaner(argv[1:], cwd=elsewhere, timeout=900)
        assert p.returncode == 0, f"{command}\n{p.stderr[-2000:]}"
        assert "demo" in p.stdout, f"{command} did not see the demo run:\n{p.stdout[-2000:]}"
    assert not (elsewhere / "workspace").exists()  # nothing looked at a default workspace instead
