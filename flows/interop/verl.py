"""verl's RL prompt Parquet (the layout of verl's examples/data_preprocess scripts for its tool agent loop):
`data_source`, `agent_name` (tool_agent), `prompt` (cleaner's system prompt and the question), `ability`,
`reward_model` {style, ground_truth}, `extra_info` {split, index, prompt_id, question, pass_rate, rollouts}; from a
task file (what `cleaner filter` writes, or any layout rollout.tasks reads) or from a run's tasks with the pass
rates its rollouts logged; and the tool config verl's multi-turn rollout reads (`tool_config_path`): cleaner's
code tool schema on verl's Sandbox Fusion tool. Prompts only: verl samples its own rollouts."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import pyarrow as pa

from pipeline.chat import CODE_TOOL_SCHEMA, DEFAULT_SYSTEM

AGENT_NAME = "tool_agent"  # verl's agent loop that runs the tools of tool_config_path
SANDBOX_TOOL_CLASS = "verl.tools.sandbox_fusion_tools.SandboxFusionTool"
SANDBOX_URL = "http://localhost:8080/run_code"  # a local Sandbox Fusion server's endpoint (its default port)

SCHEMA = pa.schema(
    [
        ("data_source", pa.string()),
        ("agent_name", pa.string()),
        ("prompt", pa.list_(pa.struct([("role", pa.string()), ("content", pa.string())]))),
        ("ability", pa.string()),
        ("reward_model", pa.struct([("style", pa.string()), ("ground_truth", pa.string())])),
        (
            "extra_info",
            pa.struct(
                [
                    ("split", pa.string()),
                    ("index", pa.int64()),
                    ("prompt_id", pa.string()),
                    ("question", pa.string()),
                    ("pass_rate", pa.float64()),
                    ("rollouts", pa.int64()),
                ]
            ),
        ),
    ]
)

COLUMN_DOCS = {
    "data_source": "the task's source (verl picks its reward function by it)",
    "agent_name": f"`{AGENT_NAME}`: verl's agent loop that calls the tools of `tool_config.yaml`",
    "prompt": "the chat messages verl renders: cleaner's system prompt, then the task's question as the user message "
    "(the tool schema comes from `tool_config.yaml`, as cleaner's rollouts render it)",
    "ability": "math (a boxed answer) or code (tests run by the reward)",
    "reward_model": "style `rule` and `ground_truth`: the answer, or the code tests as JSON",
    "extra_info": "split, row index, cleaner's prompt_id and question, and the pass rate and rollout count the "
    "run logged for the task (null from a task file without them)",
}


@dataclass(frozen=True)
class PromptRow:
    prompt_id: str
    data_source: str
    question: str
    ground_truth: str
    ability: str
    pass_rate: float | None = None
    rollouts: int | None = None


def table(rows: list[PromptRow], split: str = "train") -> pa.Table:
    return pa.Table.from_pylist(
        [
            {
                "data_source": r.data_source,
                "agent_name": AGENT_NAME,
                "prompt": [{"role": "system", "content": DEFAULT_SYSTEM}, {"role": "user", "content": r.question}],
                "ability": r.ability,
                "reward_model": {"style": "rule", "ground_truth": r.ground_truth},
                "extra_info": {
                    "split": split,
                    "index": i,
                    "prompt_id": r.prompt_id,
                    "question": r.question,
                    "pass_rate": r.pass_rate,
                    "rollouts": r.rollouts,
                },
            }
            for i, r in enumerate(rows)
        ],
        schema=SCHEMA,
    )


def tool_config(sandbox_url: str = SANDBOX_URL) -> dict[str, Any]:
    """verl's tool config (`actor_rollout_ref.rollout.multi_turn.tool_config_path`): cleaner's one code tool, with
    the schema its rollouts show the model, run by verl's Sandbox Fusion tool."""
    return {
        "tools": [
            {
                "class_name": SANDBOX_TOOL_CLASS,
                # verl reads config.type (ToolType: native, or mcp) before anything else of a tool
                "config": {"type": "native", "sandbox_fusion_url": sandbox_url},
                "tool_schema": CODE_TOOL_SCHEMA,
            }
        ]
    }
