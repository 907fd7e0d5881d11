"""Policy metrics from rolled-out trajectories: call format, tool errors, retries, accuracy, speed."""
from __future__ import annotations

from collections import Counter

from pipeline.trajectory import Trajectory


def world_metrics(trajectories: list[Trajectory], wall_s: float, decode=None) -> dict:
    n = len(trajectories)
    call_turns = [a for t in trajectories for p in t.positions for a in p.attempts if a.has_call]
    # A malformed call block is lived as no call (the turn is final), but it was an attempt at one:
    # the call marker is in the turn's ids.
    malformed = [t.final_turn for t in trajectories if t.final_turn is not None and t.final_turn.call_start >= 0]
    well_formed = sum(a.call_status == "ok" for a in call_turns)
    firsts = [p.attempts[0] for t in trajectories for p in t.positions]
    first_failed = [a for a in firsts if a.failed]
    retries = [(p.attempts[i - 1], p.attempts[i]) for t in trajectories for p in t.positions
               for i in range(1, len(p.attempts))]
    retry_ok = sum(1 for _, r in retries if r.result is not None and not r.failed)
    same_reasoning = sum(1 for f, r in retries if f.call_start > 0 and r.call_start > 0
                         and f.turn_ids[: f.call_start] == r.turn_ids[: r.call_start])
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
