"""Random, structurally valid raw trajectories: test fixtures and benchmark load, not model output."""

from __future__ import annotations

import random

import numpy as np

from pipeline.trajectory import Attempt, Position, ToolResult, Trajectory, TrajectoryStats, fingerprint

LABELS = ["NameError", "SyntaxError", "TypeError", "worker_timeout"]


def _f32(values: list[float]) -> list[float]:
    return np.asarray(values, dtype=np.float32).tolist()


def synthetic_trajectory(
    rng: random.Random,
    idx: int,
    run_id: str = "synthetic",
    iteration: int = 0,
    vocab: int = 512,
    positions: int = 2,
    max_retries: int = 3,
) -> Trajectory:
    prompt = [rng.randrange(vocab) for _ in range(rng.randint(20, 40))]
    lived: list[int] = []
    mask: list[int] = []
    lps: list[float] = []
    pos_list: list[Position] = []
    stats = TrajectoryStats()

    def turn(attempt_idx: int, failed: bool, context: list[int]) -> Attempt:
        ids = [rng.randrange(vocab) for _ in range(rng.randint(8, 30))]
        cs = rng.randrange(1, len(ids) - 2)
        result = ToolResult(
            status="failure" if failed else "success",
            text="Tool call failure\nreason: NameError" if failed else "Tool call success\nstdout: 42",
            error_label=rng.choice(LABELS) if failed else None,
            error_class="model" if failed else None,
            exit_code=1 if failed else 0,
            duration_s=round(rng.random() / 10, 6),
            timed_out=False,
        )
        return Attempt(
            attempt_idx=attempt_idx,
            turn_ids=ids,
            logprobs=_f32([-rng.random() * 3 for _ in ids]),
            call_start=cs,
            call_status="ok",
            context_len=len(context),
            context_fingerprint=fingerprint(context),
            code=f"print({rng.randint(0, 999)})",
            result=result,
            feedback_ids=[rng.randrange(vocab) for _ in range(rng.randint(5, 12))],
        )

    for p in range(positions):
        attempts = []
        n_fail = rng.choice([0, 0, 1, 2, max_retries + 1])
        for a in range(min(n_fail, max_retries) + 1):
            failed = a < n_fail
            att = turn(a, failed, prompt + lived)
            attempts.append(att)
            stats.generated_tokens += len(att.turn_ids)
        last = attempts[-1]
        outcome = "success" if n_fail == 0 else ("exhausted" if last.failed else "recovered")
        pos_list.append(Position(position_idx=p, attempts=attempts, outcome=outcome))
        lived += last.turn_ids + last.feedback_ids
        mask += [1] * len(last.turn_ids) + [0] * len(last.feedback_ids)
        lps += last.logprobs + [0.0] * len(last.feedback_ids)
        stats.tool_calls += len(attempts)
        stats.first_attempt_failures += int(n_fail > 0)
        stats.retries += len(attempts) - 1
    final = Attempt(
        attempt_idx=0,
        turn_ids=[rng.randrange(vocab) for _ in range(10)],
        logprobs=_f32([-0.5] * 10),
        call_start=-1,
        call_status="no_call",
        context_len=len(prompt) + len(lived),
        context_fingerprint=fingerprint(prompt + lived),
    )
    lived += final.turn_ids
    mask += [1] * 10
    lps += final.logprobs
    stats.response_tokens = len(lived)
    return Trajectory(
        run_id=run_id,
        iteration=iteration,
        prompt_id=f"p{idx // 4:06d}",
        sample_idx=idx % 4,
        policy_version="synthetic",
        seed=idx,
        task_source="synthetic",
        question=f"What is {idx} + 1?",
        ground_truth=str(idx + 1),
        saar_gate=True,
        gate_p=1.0,
        live_mode="purified",
        gamma_live=0.5,
        max_retries=max_retries,
        prompt_ids=prompt,
        lived_ids=lived,
        lived_mask=mask,
        lived_logprobs=_f32(lps),
        positions=pos_list,
        final_turn=final,
        final_answer=str(idx + 1),
        reward=1.0,
        finish_reason="stop",
        stats=stats,
    )


def synthetic_trajectories(n: int, seed: int = 0, **kw) -> list[Trajectory]:
    rng = random.Random(seed)
    return [synthetic_trajectory(rng, i, **kw) for i in range(n)]
