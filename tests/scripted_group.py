"""One prompt group whose trajectories cover every trajectory kind and position outcome, lived through the
real agent loop, tokenizer and sandbox with scripted turns (tests/doubles.py), for the premise and mode
tests. The expected kinds and the failed calls each mode keeps are stated by hand from the rules in
pipeline/kinds.py and docs/saar.md, not read from the code under test."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pyarrow as pa

from pipeline.config import DEFAULT_POLICY, RolloutConfig, SaarConfig
from pipeline.trajectory import ToolResult, Trajectory, trajectory_to_row
from rollout_gen.agent import AgentLoop, RolloutIdentity
from rollout_gen.tasks import Task
from storage.layout import RunLayout
from storage.schemas import RAW
from storage.shards import write_shard
from tests.doubles import ANSWER, ScriptedEngineDouble, call


class InfraAtDouble:
    """TEST DOUBLE around the real pool: the n-th execution fails as infrastructure (a dead worker cannot be
    produced on demand at a chosen call); every other call runs in the real sandbox."""

    def __init__(self, pool, infra_at: int) -> None:
        self.pool, self.infra_at, self.n = pool, infra_at, 0

    def run_many(self, codes: list[str]) -> list[ToolResult]:
        out = []
        for code in codes:
            self.n += 1
            out += (
                [
                    ToolResult(
                        "failure",
                        "Tool call failure\nreason: sandbox_error",
                        "sandbox_error",
                        "infra",
                        None,
                        0.0,
                        False,
                    )
                ]
                if self.n == self.infra_at
                else self.pool.run_many([code])
            )
        return out


TASK = Task("p1", "world", "What is 6 * 7?", "42")
UNCLOSED = '<tool_call>\n{"name": "code_interpreter", "arguments": {"code": "print(6 * 7)"}}'
RIGHT, WRONG = ANSWER.format(42), ANSWER.format(41)

# name: (turns, SAAR settings, rollout settings, infra at execution n, kind)
SCRIPTS: dict[str, tuple[list[str], dict, dict, int, str]] = {
    "clean_correct": ([call("print(6 * 7)"), RIGHT], {}, {}, 0, "clean"),
    "clean_wrong": ([call("print(6 * 7)"), WRONG], {}, {}, 0, "clean"),
    "recovered_correct": ([call("prnt(6 * 7)"), call("print(6 * 7)"), RIGHT], {}, {}, 0, "recovered"),
    "recovered_wrong": ([call("prnt(6 * 7)"), call("print(6 * 7)"), WRONG], {}, {}, 0, "recovered"),
    "exhausted": ([call(f"prnt({i})") for i in range(4)] + [WRONG], {"max_retries": 3}, {}, 0, "not_recovered"),
    "gave_up": ([call("prnt(6 * 7)"), "I cannot fix it. \\boxed{41}"], {}, {}, 0, "not_recovered"),
    "infra": ([call("prnt(6 * 7)"), call("print(6 * 7)"), RIGHT], {}, {}, 2, "infra"),
    "gate_off": ([call("prnt(6 * 7)"), WRONG], {"gate_p": 0.0}, {}, 0, "not_recovered"),
    "malformed_recovered": ([UNCLOSED, call("print(6 * 7)"), RIGHT], {}, {"malformed_call": "failure"}, 0, "recovered"),
}
NAMES = list(SCRIPTS)


def build_group(chat, sandbox, run_id: str = "s") -> list[Trajectory]:
    """The scripted trajectories as one group of prompt p1, sample_idx in NAMES order."""
    out = []
    for i, (turns, saar, rollout, infra_at, _) in enumerate(SCRIPTS.values()):
        engine = ScriptedEngineDouble(chat, lambda text, n, turns=turns: turns[n] if n < len(turns) else RIGHT)
        pool = InfraAtDouble(sandbox, infra_at) if infra_at else sandbox
        cfg = RolloutConfig(samples_per_prompt=1, saar=SaarConfig(**saar), **rollout)
        t = AgentLoop(engine, pool, chat, cfg).run([TASK], RolloutIdentity(run_id, 0, "v"))[0]
        out.append(dataclasses.replace(t, sample_idx=i))
    return out


def write_group(root: Path, trajectories: list[Trajectory], run_id: str = "s", iteration: int = 0) -> Path:
    """Commit the trajectories as the raw shard of `iteration` (sampled by the committed tiny policy)."""
    rows = [trajectory_to_row(dataclasses.replace(t, run_id=run_id, iteration=iteration)) for t in trajectories]
    out = RunLayout(root, run_id).raw_dir(iteration)
    write_shard(out, pa.Table.from_pylist(rows, schema=RAW), RAW, config_hash="scripted", inputs=[str(DEFAULT_POLICY)])
    return out
