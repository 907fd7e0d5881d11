"""Policy metrics from rolled-out trajectories: call format, tool errors, retries, accuracy, speed; avg@k and
pass@k per benchmark (pipeline/passk.py)."""

from __future__ import annotations

from collections import Counter

from pipeline.passk import summarize
from pipeline.trajectory import Trajectory
from rollout_gen.tasks import ALL


def world_metrics(trajectories: list[Trajectory], wall_s: float) -> dict:
    n = len(trajectories)
    call_turns = [a for t in trajectories for p in t.positions for a in p.attempts if a.has_call]
    # A malformed call block is lived as no call (the turn is final), but it was an attempt at one:
    # the call marker is in the turn's ids.
    malformed = [t.final_turn for t in trajectories if t.final_turn is not None and t.final_turn.call_start >= 0]
    well_formed = sum(a.call_status == "ok" for a in call_turns)
    firsts = [p.attempts[0] for t in trajectories for p in t.positions]
    first_failed = [a for a in firsts if a.failed]
    # The very first call is sampled in the same context whatever SAAR does at test time: its failure rate is the
    # one protocol-free error metric (with SAAR off a failed call closes its position and the next call opens
    # another, so the per-position rate above counts calls there and positions under SAAR on).
    very_first = [t.positions[0].attempts[0] for t in trajectories if t.positions]
    retries = [
        (p.attempts[i - 1], p.attempts[i]) for t in trajectories for p in t.positions for i in range(1, len(p.attempts))
    ]
    retry_ok = sum(1 for _, r in retries if r.result is not None and not r.failed)
    same_reasoning = sum(
        1
        for f, r in retries
        if f.call_start > 0 and r.call_start > 0 and f.turn_ids[: f.call_start] == r.turn_ids[: r.call_start]
    )
    shallow = sum(t.stats.live_shallow for t in trajectories)
    deep = sum(t.stats.live_deep for t in trajectories)
    generated = sum(t.stats.generated_tokens for t in trajectories)
    labels = Counter(a.result.error_label for a in first_failed)
    return {
        "trajectories": n,
        "accuracy": sum(t.reward > 0 for t in trajectories) / max(1, n),
        "well_formed_call_rate": well_formed / max(1, len(call_turns) + len(malformed)),
        "tool_calls": len(call_turns),
        "first_call_failure_rate": len(first_failed) / max(1, len(firsts)),
        "very_first_call_failure_rate": sum(a.failed for a in very_first) / max(1, len(very_first)),
        "very_first_calls": len(very_first),
        "first_call_failures_by_label": dict(sorted(labels.items())),
        "first_call_failures_per_trajectory": len(first_failed) / max(1, n),
        "retries": len(retries),
        "retry_success_rate": retry_ok / max(1, len(retries)),
        "retry_same_reasoning_share": same_reasoning / max(1, len(retries)),
        "live_shallow_share": shallow / max(1, shallow + deep),
        "mean_response_tokens": sum(len(t.lived_ids) for t in trajectories) / max(1, n),
        "generated_tokens": generated,
        "generated_tokens_per_s": generated / wall_s if wall_s else 0.0,
        "wall_s": wall_s,
        "finish_reasons": dict(Counter(t.finish_reason for t in trajectories)),
    }


def solved(t: Trajectory, kind: str) -> bool:
    """A code problem counts only when every test passes (its reward is the share of tests passed, so 1.0),
    as LiveCodeBench counts it; a math or GPQA one when its boxed answer is right (+1)."""
    return t.reward >= 1.0 if kind == "code" else t.reward > 0


def group_metrics(trajectories: list[Trajectory], counts: list[tuple[int, int]]) -> dict:
    """avg@k / pass@k with standard errors over tasks ((n, c) per task), tool failures and tokens of a group."""
    n = max(1, len(trajectories))
    attempts = [a for t in trajectories for p in t.positions for a in p.attempts]
    firsts = [p.attempts[0] for t in trajectories for p in t.positions]
    return {
        "tasks": len(counts),
        "trajectories": len(trajectories),
        **summarize(counts),
        # every failed execution counts, retries included: what a trajectory paid in tool errors
        "tool_failures_per_trajectory": sum(a.failed for a in attempts) / n,
        "first_call_failure_rate": sum(a.failed for a in firsts) / max(1, len(firsts)),
        "tool_calls_per_trajectory": sum(a.has_call for a in attempts) / n,
        "mean_response_tokens": sum(len(t.lived_ids or ()) for t in trajectories) / n,
        "generated_tokens": sum(t.stats.generated_tokens for t in trajectories),
        "reward_errors": sum(t.finish_reason.startswith("reward_error") for t in trajectories),
    }


def benchmark_metrics(kinds: list[tuple[str, str]], trajectories: list[Trajectory], samples: int) -> dict[str, dict]:
    """{"all": …, source: …}: group_metrics overall and per benchmark (task source). `kinds` is (source, kind)
    per task; the trajectories are task-major, task i's samples at [i*samples, (i+1)*samples)."""
    groups: dict[str, tuple[list[Trajectory], list[tuple[int, int]]]] = {ALL: ([], [])}
    for i, (source, kind) in enumerate(kinds):
        mine = trajectories[i * samples : (i + 1) * samples]
        count = (len(mine), sum(solved(t, kind) for t in mine))
        for key in (ALL, source):
            trajs, counts = groups.setdefault(key, ([], []))
            trajs.extend(mine)
            counts.append(count)
    return {key: group_metrics(trajs, counts) for key, (trajs, counts) in groups.items()}
