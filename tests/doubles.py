"""Test doubles, each standing in only for what cannot be made to happen here on demand."""

from __future__ import annotations

from typing import Callable

from pipeline.chat import IM_END, ChatFormat
from pipeline.engines.base import Generation, SamplingParams


class ScriptedEngineDouble:
    """TEST DOUBLE for a policy: returns scripted assistant turns instead of sampling.

    The real tiny policy runs in the end-to-end tests; this double exists because no real model
    can be made to emit a chosen malformed turn (bad JSON, unknown tool, unclosed call, an empty
    completion, a retry without a call) at a chosen moment. `script(context_text, turn_no)` gives
    the next turn's text; `None` means an empty completion that stops at once.
    """

    def __init__(self, chat: ChatFormat, script: Callable[[str, int], str | None]) -> None:
        self.chat, self.script = chat, script
        self.calls: list[int] = []
        self.turn_no: dict[str, int] = {}

    def generate(
        self,
        contexts: list[list[int]],
        params: SamplingParams,
        seeds: list[int],
        shared_prefix: list[int] | None = None,
    ) -> list[Generation]:
        self.calls.append(len(contexts))
        out = []
        for ctx in contexts:
            text = self.chat.decode(ctx)
            key = text[: text.index("<|im_start|>assistant")]  # one counter per conversation
            n = self.turn_no.get(key, 0)
            self.turn_no[key] = n + 1
            turn = self.script(text, n)
            ids = ([] if turn is None else self.chat.encode(turn)) + [self.chat.im_end_id]
            ids = ids[: params.max_new_tokens]
            out.append(Generation(ids, [-0.5] * len(ids), "stop" if ids[-1] == self.chat.im_end_id else "length"))
        return out

    def update_weights(self, checkpoint) -> None:  # pragma: no cover - nothing to reload
        pass

    def close(self) -> None:
        pass


def call(code: str, reasoning: str = "Let me compute.") -> str:
    import json

    return (
        f"{reasoning}\n<tool_call>\n"
        f"{json.dumps({'name': 'code_interpreter', 'arguments': {'code': code}})}\n</tool_call>"
    )


ANSWER = "The answer is \\boxed{{{}}}."
assert IM_END
