"""verl's RL prompt Parquet (the layout of verl's examples/data_preprocess scripts): `data_source`, `prompt` (chat
messages), `ability`, `reward_model` {style, ground_truth}, `extra_info` {split, index, prompt_id, question,
pass_rate, rollouts}; from a task file (what `cleaner filter` writes, or any layout rollout.tasks reads) or from
a run's tasks with the pass rates its rollouts logged. Prompts only: verl samples its own rollouts."""

from __future__ import annotations

from dataclasses import dataclass

import pyarrow as pa

SCHEMA = pa.schema(
    [
        ("data_source", pa.string()),
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
    "prompt": "the chat messages verl renders: the task's question as the user message",
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
                "prompt": [{"role": "user", "content": r.question}],
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
