"""SAAR rules as the reference implementation lives them (issue 14 §1, issue 13 §4).

Every expected value here is derived from the reference agent loop (Open-CLEANER,
verl/verl/experimental/agent_loop/tool_agent_loop.py and tool_parser.py), not from this project's
outputs. The policy is scripted (tests/doubles.py); tokenizer and sandbox are the real ones.
"""

from __future__ import annotations

import io

import pyarrow as pa
import pyarrow.parquet as pq

from pipeline.chat import parse_tool_call
from pipeline.config import RolloutConfig, SaarConfig
from pipeline.trajectory import ToolResult, trajectory_to_row
from purifier.saar import purify
from rollout_gen.agent import AgentLoop, RolloutIdentity
from rollout_gen.tasks import Task
from storage.schemas import RAW
from tests.doubles import ANSWER, ScriptedEngineDouble, call

TASK = Task("f1", "world", "What is 6 * 7?", "42")
TWO_STEP = Task("f2", "world", "Compute 6 * 7. Then add that result to 8.", "50")
NOTE_HEAD = "\n\nNote: This approach has been attempted "


def run(chat, sandbox, turns, task=TASK, rollout: dict | None = None, **saar):
    script = (
        (lambda text, n: turns[n] if n < len(turns) else ANSWER.format(task.ground_truth))
        if isinstance(turns, list)
        else turns
    )
    cfg = RolloutConfig(samples_per_prompt=1, saar=SaarConfig(**saar), **(rollout or {}))
    return AgentLoop(ScriptedEngineDouble(chat, script), sandbox, chat, cfg).run([task], RolloutIdentity("f", 0, "v"))[
        0
    ]


def relived(chat, t):
    """The invariant: purification at the live γ rebuilds exactly the lived sequence."""
    p = purify(t, t.gamma_live, "saar", chat.decode)
    return p.response_ids == t.lived_ids and p.loss_mask == t.lived_mask


# ---- §1.1 a retry replaces a turn: budgets are restored on rollback -------------------------------
# Reference: RollbackManager.create_checkpoint/restore_checkpoint save and restore assistant_turns and
# user_turns around every retry; _handle_generating_state(ignore_termination=True) skips the length check.


def test_retries_do_not_use_up_max_turns(chat, sandbox):
    t = run(
        chat,
        sandbox,
        [call("prnt(6 * 7)"), call("prnt(6 * 7 )"), call("prnt( 6 * 7)"), call("print(6 * 7)"), ANSWER.format(42)],
        rollout={"max_turns": 4},
    )
    assert [p.outcome for p in t.positions] == ["recovered"] and len(t.positions[0].attempts) == 4
    assert t.final_answer == "42" and t.reward == 1.0 and t.finish_reason == "stop"
    assert relived(chat, t)


def test_retries_do_not_use_up_max_tool_turns(chat, sandbox):
    t = run(
        chat,
        sandbox,
        [call("prnt(6 * 7)"), call("print(6 * 7)"), call("print(42 + 8)"), ANSWER.format(50)],
        task=TWO_STEP,
        rollout={"max_tool_turns": 2},
    )
    assert [p.outcome for p in t.positions] == ["recovered", "success"]
    assert t.final_answer == "50" and t.reward == 1.0
    assert relived(chat, t)


def test_length_check_is_skipped_while_regenerating(chat, sandbox):
    turns = [call("a = 6\nb = 7\nc = a * b\nd = c\ne = d\nprnt(e)"), call("print(6 * 7)"), ANSWER.format(42)]
    free = run(chat, sandbox, turns)
    failed = free.positions[0].attempts[0]
    # the budget fits the purified trajectory but not the failed turn plus its error feedback
    budget = len(free.lived_ids)
    assert len(failed.turn_ids) + len(failed.feedback_ids) >= budget
    t = run(chat, sandbox, turns, rollout={"max_response_tokens": budget})
    assert t.positions[0].outcome == "recovered" and t.final_answer == "42" and t.reward == 1.0
    assert t.lived_ids == free.lived_ids and len(t.lived_ids) <= budget
    assert relived(chat, t)


def test_turn_limit_hit_by_a_retry_restores_the_state_before_it(chat, sandbox):
    # max_turns=2: the retry of turn 1 would be turn 2 = the limit, so the reference restores the
    # checkpoint taken before the error feedback and stops: the failed call stays, without its error.
    t = run(chat, sandbox, [call("prnt(1)"), call("print(1)")], rollout={"max_turns": 2})
    (pos,) = t.positions
    assert pos.outcome == "truncated" and len(pos.attempts) == 1 and t.finish_reason == "max_turns"
    assert t.lived_ids == pos.attempts[0].turn_ids and "NameError" not in chat.decode(t.lived_ids)
    assert relived(chat, t)


# ---- §1.2 malformed calls are no call (reference: HermesToolParser.extract_tool_calls) ------------


def test_unclosed_call_is_a_final_turn(chat, sandbox):
    turn = '<tool_call>\n{"name": "code_interpreter", "arguments": {"code": "print(42)"}}'
    t = run(chat, sandbox, [turn, call("print(42)")])
    assert t.positions == [] and t.final_turn is not None and t.final_turn.call_status == "no_call"
    assert t.stats.tool_calls == 0 and "Tool call" not in chat.decode(t.lived_ids)
    assert relived(chat, t)


def test_near_json_is_repaired_and_run(chat, sandbox):
    # a missing closing brace: json_repair.loads turns it into the call the model meant
    turn = '<tool_call>\n{"name": "code_interpreter", "arguments": {"code": "print(6 * 7)"}\n</tool_call>'
    t = run(chat, sandbox, [turn, ANSWER.format(42)])
    (pos,) = t.positions
    assert pos.attempts[0].call_status == "ok" and pos.attempts[0].code == "print(6 * 7)"
    assert pos.outcome == "success" and "stdout: 42" in pos.attempts[0].result.text


def test_unrepairable_json_is_a_final_turn(chat, sandbox):
    turn = "<tool_call>\nthis is not json at all\n</tool_call>"
    t = run(chat, sandbox, [turn, call("print(42)")])
    assert t.positions == [] and t.final_turn.call_status == "no_call" and t.reward == -1.0


def test_unknown_tool_is_a_failed_call_and_retried(chat, sandbox):
    # reference _call_tool: self.tools[name] raises KeyError -> "Tool call failure: tool call format is wrong"
    turn = '<tool_call>\n{"name": "web_search", "arguments": {"query": "x"}}\n</tool_call>'
    t = run(chat, sandbox, [turn, call("print(42)"), ANSWER.format(42)])
    assert t.positions[0].attempts[0].call_status == "unknown_tool" and t.positions[0].outcome == "recovered"


def test_legacy_option_retries_malformed_calls(chat, sandbox):
    turn = '<tool_call>\n{"name": "code_interpreter", "arguments": {"code": "print(42)"}}'
    t = run(chat, sandbox, [turn, call("print(42)"), ANSWER.format(42)], rollout={"malformed_call": "failure"})
    first = t.positions[0].attempts[0]
    assert first.call_status == "unclosed" and first.failed and t.positions[0].outcome == "recovered"
    assert relived(chat, t)


# ---- §1.3 model error, then an infra error on its retry -------------------------------------------


class InfraOnExecutionSandboxDouble:
    """TEST DOUBLE around the real pool: the n-th execution fails as infrastructure (a dead worker
    cannot be produced on demand at a chosen call); every other call runs in the real sandbox."""

    def __init__(self, pool, infra_at: int) -> None:
        self.pool, self.infra_at, self.n = pool, infra_at, 0

    def run_many(self, codes):
        out = []
        for code in codes:
            self.n += 1
            if self.n == self.infra_at:
                out.append(
                    ToolResult(
                        "failure",
                        "Tool call failure\nreason: sandbox_error",
                        "sandbox_error",
                        "infra",
                        None,
                        0.0,
                        False,
                    )
                )
            else:
                out.extend(self.pool.run_many([code]))
        return out


def test_infra_error_on_a_retry_keeps_the_live_splice(chat, sandbox):
    infra = InfraOnExecutionSandboxDouble(sandbox, infra_at=2)
    cfg = RolloutConfig(samples_per_prompt=1)
    engine = ScriptedEngineDouble(
        chat, lambda text, n: [call("prnt(6 * 7)"), call("print(6 * 7)")][n] if n < 2 else ANSWER.format(42)
    )
    t = AgentLoop(engine, infra, chat, cfg).run([TASK], RolloutIdentity("f", 0, "v"))[0]
    (pos,) = t.positions
    assert pos.outcome == "infra" and [a.result.error_class for a in pos.attempts] == ["model", "infra"]
    assert "prnt" not in chat.decode(t.lived_ids)
    assert relived(chat, t)


# ---- §1.4 the exhaustion note (reference: _handle_max_retry_exceeded) -----------------------------


def test_exhaustion_note_counts_retries(chat, sandbox):
    t = run(chat, sandbox, [call(f"prnt({i})") for i in range(4)], max_retries=3)
    pos = t.positions[0]
    assert pos.outcome == "exhausted" and len(pos.attempts) == 4
    fb = chat.decode(pos.attempts[-1].feedback_ids)
    assert NOTE_HEAD + "3 times with the same type of error." in fb
    assert relived(chat, t)


def test_no_exhaustion_note_after_a_single_retry(chat, sandbox):
    t = run(chat, sandbox, [call("prnt(1)"), call("prnt(2)")], max_retries=1)
    pos = t.positions[0]
    assert pos.outcome == "exhausted" and len(pos.attempts) == 2
    assert "has been attempted" not in chat.decode(pos.attempts[-1].feedback_ids)


# ---- §1.5 the safety cap (reference: _handle_processing_tools_state, total_rollbacks > 30) ---------


def test_safety_cap_fires_after_the_cap_and_mid_retry_goes_to_exhaustion(chat, sandbox):
    # cap 2: executions 1 and 2 may be retried; execution 3 (a retry) finds SAAR off, and because it is
    # retrying, the reference ends the position through the exhausted handler (note: 2 retries).
    t = run(chat, sandbox, lambda text, n: call("prnt(1)") if n < 5 else ANSWER.format(1), safety_cap=2, max_retries=3)
    assert [len(p.attempts) for p in t.positions] == [3, 1, 1]
    assert [p.outcome for p in t.positions] == ["exhausted", "not_retried", "not_retried"]
    assert NOTE_HEAD + "2 times" in chat.decode(t.positions[0].attempts[-1].feedback_ids)
    assert relived(chat, t)


# ---- issue 13 §4: a bad row never loses a batch ----------------------------------------------------


def test_deeply_nested_call_json_does_not_lose_the_batch(chat, sandbox):
    deep = "<tool_call>\n" + "[" * 3000 + "]" * 3000 + "\n</tool_call>"
    assert parse_tool_call(deep).status == "no_call"
    cfg = RolloutConfig(samples_per_prompt=2)
    engine = ScriptedEngineDouble(chat, lambda text, n: deep if "What is" in text and n == 0 else ANSWER.format(50))
    out = AgentLoop(engine, sandbox, chat, cfg).run([TASK, TWO_STEP], RolloutIdentity("f", 0, "v"))
    assert len(out) == 4 and [t.final_turn is not None for t in out] == [True] * 4
    assert [t.reward for t in out] == [-1.0, -1.0, 1.0, 1.0]


def test_lone_surrogate_in_model_code_is_recorded_and_the_row_written(chat, sandbox):
    bad = '<tool_call>\n{"name": "code_interpreter", "arguments": {"code": "print(\'\\ud800\')"}}\n</tool_call>'
    t = run(chat, sandbox, [bad, call("print(42)"), ANSWER.format(42)])
    first = t.positions[0].attempts[0]
    assert first.call_status == "bad_json" and first.failed and first.result.error_class == "model"
    assert "surrogate" in first.result.text
    buf = io.BytesIO()
    pq.write_table(pa.Table.from_pylist([trajectory_to_row(t)], schema=RAW), buf)  # raised before the fix
    assert pq.read_table(io.BytesIO(buf.getvalue())).num_rows == 1
