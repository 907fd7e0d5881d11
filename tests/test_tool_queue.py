"""The scheduler's tool queue (issue 17): calls beyond the sandbox's workers wait in the scheduler,
and the free schedule starts first the calls of the trajectories that have made the most calls.
Real Scheduler, real threads; the trajectories here only call tools (no engine is stepped)."""

from __future__ import annotations

import threading
import time

import pytest

from rollout_gen.scheduler import Scheduler


def _run(priority: str, deterministic: bool, calls: list[int], slots: int = 1) -> list[str]:
    """Trajectory i makes calls[i] tool calls one after another; returns the order the calls started.

    Free schedule: a call ends only once every trajectory with calls left has asked for its next one, so the
    queue holds every call that can be made when a slot frees (what slow tools give, without timing). The
    deterministic schedule hands results back at fixed steps, so its calls simply return."""
    started: list[str] = []
    asked, ended = [0] * len(calls), [0] * len(calls)
    cond = threading.Condition()

    def tool(i: int, name: str) -> str:
        with cond:
            started.append(name)
            if not deterministic:
                assert cond.wait_for(
                    lambda: all(asked[j] > ended[j] or asked[j] == calls[j] for j in range(len(calls)) if j != i),
                    timeout=30,
                ), "a trajectory never asked its next call"
            ended[i] += 1
        return name

    sched = Scheduler(None, deterministic=deterministic, tool_delay_steps=1, tool_slots=slots, tool_priority=priority)

    async def trajectory(i: int) -> None:
        for k in range(calls[i]):
            with cond:
                asked[i] += 1
                cond.notify_all()
            assert await sched.tool(i, tool, i, f"t{i}c{k}") == f"t{i}c{k}"

    sched.run([trajectory(i) for i in range(len(calls))])
    return started


def test_fifo_queue_puts_a_long_chain_behind_everyones_first_call():
    assert _run("fifo", False, [3, 1, 1, 1, 1]) == ["t0c0", "t1c0", "t2c0", "t3c0", "t4c0", "t0c1", "t0c2"]


def test_most_calls_first_moves_the_long_chain_ahead():
    # when t0's first call ends, t1's starts in the freed slot before t0 has made its second; from
    # then on t0's calls outrank every trajectory that has made none yet
    order = _run("most_calls", False, [3, 1, 1, 1, 1])
    assert order == ["t0c0", "t1c0", "t0c1", "t2c0", "t0c2", "t3c0", "t4c0"]


@pytest.mark.parametrize("priority", ["most_calls", "fifo"])
def test_deterministic_schedule_starts_calls_in_the_order_they_fall_due(priority):
    # more calls than slots, each due one step after it is made: the loop waits for calls that have not
    # even started (no deadlock), and results come back to the right trajectory
    order = _run(priority, True, [3, 1, 1, 1, 1], slots=2)
    assert order[:5] == ["t0c0", "t1c0", "t2c0", "t3c0", "t4c0"] and sorted(order[5:]) == ["t0c1", "t0c2"]


def test_a_failing_tool_call_reaches_its_trajectory_and_frees_its_slot():
    sched = Scheduler(None, deterministic=False, tool_slots=1)
    seen: list[str] = []

    def boom() -> None:
        raise ValueError("tool broke")

    async def failing() -> None:
        with pytest.raises(ValueError, match="tool broke"):
            await sched.tool(0, boom)
        seen.append("failed")

    async def fine() -> None:
        seen.append(await sched.tool(1, lambda: "ok"))

    sched.run([failing(), fine()])
    assert sorted(seen) == ["failed", "ok"]


def test_the_last_progress_report_counts_every_trajectory_finished():
    seen: list[tuple[int, int]] = []
    sched = Scheduler(
        None, deterministic=False, tool_slots=2, on_progress=lambda p, _: seen.append((p.finished, p.active))
    )

    async def trajectory(i: int) -> None:
        for _ in range(i + 1):
            await sched.tool(i, time.sleep, 0.01)

    sched.run([trajectory(i) for i in range(3)])
    assert seen[-1] == (3, 0)  # a log or bar closed on this shows 3/3, not 2/3
