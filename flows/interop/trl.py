"""TRL's SFT layouts from purified rows: pre-tokenized (`input_ids`, `labels`, `completion_mask`) and conversational
(`messages` with `tool_calls` and tool messages, `tools` as the JSON schema).

The pre-tokenized form is token-exact: `input_ids` is the prompt followed by the purified response,
`completion_mask` is 0 on the prompt and the partition's loss mask on the response, and `labels` is `input_ids`
with -100 where that mask is 0. TRL's SFTTrainer uses a dataset's `labels` as they are whatever its settings (its
`completion_only_loss` reads `completion_mask` only for prompt-completion datasets, so a pre-tokenized one without
`labels` would train every token), as does transformers' Trainer: either trains exactly the tokens the partition
trains. The conversational form is
text: a trainer re-renders and re-tokenizes it with its own template, so it keeps the turns, the calls and the tool
outputs but neither the token boundaries nor a mask inside a turn (docs/formats.md).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from pipeline.chat import (
    CALL_OPEN,
    CODE_TOOL_SCHEMA,
    EOS,
    IM_END,
    RESPONSE_CLOSE,
    RESPONSE_OPEN,
    TOOL_NAME,
    parse_tool_call,
)
from pipeline.trajectory import TokenOrigin

# identity and outcome columns kept beside the training columns (TRL ignores columns it does not know)
ROW_COLUMNS = [
    ("run_id", pa.string()),
    ("iteration", pa.int32()),
    ("prompt_id", pa.string()),
    ("sample_idx", pa.int32()),
    ("reward", pa.float64()),
    ("advantage", pa.float64()),
]
SFT_SCHEMA = pa.schema(
    [
        ("input_ids", pa.list_(pa.int32())),
        ("labels", pa.list_(pa.int32())),
        ("completion_mask", pa.list_(pa.int8())),
        *ROW_COLUMNS,
    ]
)
IGNORED = -100  # the label of a token no loss is taken on (transformers' and TRL's ignore index)

TOOL_CALL = pa.struct(
    [
        ("type", pa.string()),
        ("function", pa.struct([("name", pa.string()), ("arguments", pa.struct([("code", pa.string())]))])),
    ]
)
MESSAGE = pa.struct(
    [("role", pa.string()), ("content", pa.string()), ("tool_calls", pa.list_(TOOL_CALL)), ("name", pa.string())]
)
TOOLS = pa.list_(
    pa.struct(
        [
            ("type", pa.string()),
            (
                "function",
                pa.struct(
                    [
                        ("name", pa.string()),
                        ("description", pa.string()),
                        (
                            "parameters",
                            pa.struct(
                                [
                                    ("type", pa.string()),
                                    (
                                        "properties",
                                        pa.struct(
                                            [("code", pa.struct([("type", pa.string()), ("description", pa.string())]))]
                                        ),
                                    ),
                                    ("required", pa.list_(pa.string())),
                                ]
                            ),
                        ),
                    ]
                ),
            ),
        ]
    )
)
MESSAGES_SCHEMA = pa.schema([("messages", pa.list_(MESSAGE)), ("tools", TOOLS), *ROW_COLUMNS])

COLUMN_DOCS = {
    "input_ids": "prompt token ids followed by the purified response's (int32; the policy's tokenizer)",
    "labels": "input_ids with -100 where completion_mask is 0: TRL's SFTTrainer and transformers' Trainer train "
    "exactly the tokens whose label is not -100, whatever their settings",
    "completion_mask": "0 on the prompt, the partition's loss mask on the response (1 = trained)",
    "messages": "the conversation: the user's question, each assistant turn (text before its call, the call in "
    "`tool_calls`), each tool response as a `tool` message",
    "tools": "the tool the policy was shown, as its JSON schema",
    "run_id": "the cleaner run the row comes from",
    "iteration": "the training iteration that sampled it",
    "prompt_id": "the task's id (rows of one task form a GRPO group)",
    "sample_idx": "the sample's index in its group",
    "reward": "the trajectory's reward",
    "advantage": "its GRPO advantage in its prompt group",
}


def _lists(column: pa.ChunkedArray | pa.Array) -> tuple[np.ndarray, np.ndarray]:
    """(values, offsets from 0) of a list column, nulls as empty lists."""
    arr = column.combine_chunks() if isinstance(column, pa.ChunkedArray) else column
    lengths = pc.fill_null(pc.list_value_length(arr), 0).to_numpy(zero_copy_only=False).astype(np.int64)
    values = arr.flatten().to_numpy(zero_copy_only=False)
    return values, np.concatenate([[0], np.cumsum(lengths)])


def _joined(
    first: tuple[np.ndarray, np.ndarray], second: tuple[np.ndarray, np.ndarray], kind: pa.DataType
) -> pa.ListArray:
    """Per row, the first list followed by the second."""
    (a, ao), (b, bo) = first, second
    rows = len(ao) - 1
    pieces = []
    for r in range(rows):
        pieces += [a[ao[r] : ao[r + 1]], b[bo[r] : bo[r + 1]]]
    values = np.concatenate(pieces) if pieces else np.zeros(0)
    offsets = np.concatenate([[0], np.cumsum(np.diff(ao) + np.diff(bo))]).astype(np.int32)
    return pa.ListArray.from_arrays(pa.array(offsets, pa.int32()), pa.array(values, kind.value_type))


def sft_table(purified: pa.Table) -> pa.Table:
    """TRL's pre-tokenized SFT rows of a batch of purified rows (column-wise, no row leaves Arrow)."""
    prompt, response = _lists(purified["prompt_ids"]), _lists(purified["response_ids"])
    mask = _lists(purified["loss_mask"])
    zeros = (np.zeros(len(prompt[0]), dtype=np.int8), prompt[1])
    input_ids = _joined(prompt, response, SFT_SCHEMA.field("input_ids").type)
    completion_mask = _joined(zeros, mask, SFT_SCHEMA.field("completion_mask").type)
    ids, trained = input_ids.values.to_numpy(), completion_mask.values.to_numpy(zero_copy_only=False)
    labels = pa.ListArray.from_arrays(input_ids.offsets, pa.array(np.where(trained == 1, ids, IGNORED), pa.int32()))
    columns = {"input_ids": input_ids, "labels": labels, "completion_mask": completion_mask}
    columns.update({name: purified[name] for name, _ in ROW_COLUMNS})
    return pa.table([columns[f.name] for f in SFT_SCHEMA], schema=SFT_SCHEMA)


def response_runs(origin: list[int] | None, loss_mask: list[int]) -> list[tuple[int, int, bool]]:
    """The purified response cut into (start, end, sampled) runs: sampled turns and the tool responses between
    them. By token origin; a version-1 row, without origins, by its loss mask."""
    sampled = [o != TokenOrigin.NOT_SAMPLED for o in origin] if origin else [m == 1 for m in loss_mask]
    runs: list[tuple[int, int, bool]] = []
    start = 0
    for i in range(1, len(sampled) + 1):
        if i == len(sampled) or sampled[i] != sampled[start]:
            runs.append((start, i, sampled[start]))
            start = i
    return runs


def assistant_text(text: str) -> str:
    """A sampled turn's text as a message's content: without its stop token and without the call block (the
    call goes to `tool_calls`)."""
    for stop in (IM_END, EOS):
        text = text.replace(stop, "")
    at = text.find(CALL_OPEN)
    return (text[:at] if at >= 0 else text).rstrip("\n")


def tool_text(text: str) -> str:
    """A tool-response run's text (the template's frame around it) as a tool message's content."""
    start, end = text.find(RESPONSE_OPEN), text.rfind(RESPONSE_CLOSE)
    if start < 0 or end < start:
        return text
    return unframed(text[start + len(RESPONSE_OPEN) : end])


def unframed(body: str) -> str:
    """The tool's text between <tool_response> and </tool_response>: the template puts one newline on each side
    (pipeline/chat.py TurnFrame); only those go, so the text is the tool's exactly."""
    body = body[1:] if body.startswith("\n") else body
    return body[:-1] if body.endswith("\n") else body


def tool_call(code: str) -> dict[str, Any]:
    return {"type": "function", "function": {"name": TOOL_NAME, "arguments": {"code": code}}}


def conversation(
    question: str, response_ids: list[int], runs: list[tuple[int, int, bool]], decode: Any
) -> list[dict[str, Any]]:
    """The messages of one purified response: the question, then per run an assistant or a tool message."""
    messages: list[dict[str, Any]] = [{"role": "user", "content": question, "tool_calls": None, "name": None}]
    texts = decode([response_ids[s:e] for s, e, _ in runs]) if runs else []
    for (_, _, sampled), text in zip(runs, texts):
        if sampled:
            call = parse_tool_call(text.replace(IM_END, "").replace(EOS, ""))
            messages.append(
                {
                    "role": "assistant",
                    "content": assistant_text(text),
                    "name": None,
                    "tool_calls": [tool_call(call.code)] if call.code is not None else None,
                }
            )
        else:
            messages.append({"role": "tool", "content": tool_text(text), "tool_calls": None, "name": TOOL_NAME})
    return messages


def messages_table(purified: pa.Table, questions: dict[str, str], decode: Any) -> pa.Table:
    """TRL's conversational rows of a batch of purified rows; `questions` maps raw keys to the task's question."""
    rows = []
    for r in purified.to_pylist():
        runs = response_runs(r["token_origin"], r["loss_mask"])
        rows.append(
            {
                "messages": conversation(questions[r["raw_key"]], r["response_ids"], runs, decode),
                "tools": [CODE_TOOL_SCHEMA],
                **{name: r[name] for name, _ in ROW_COLUMNS},
            }
        )
    return pa.Table.from_pylist(rows, schema=MESSAGES_SCHEMA)
