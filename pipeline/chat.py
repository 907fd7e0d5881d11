"""The chat and tool-call format (Qwen/Hermes, docs/saar.md), on token ids.

Text-level helpers parse and render tool calls and tool responses; `ChatFormat` binds them to a
tokenizer and works on token ids: the running sequence is never re-rendered and re-tokenized,
because BPE is not a bijection and chat templates drop text.
"""

from __future__ import annotations

import contextlib

import json
import re
from bisect import bisect_left
from dataclasses import dataclass
from functools import cached_property
from itertools import accumulate
from pathlib import Path
from typing import Any, Literal

import json_repair

from pipeline.trajectory import CallStatus
from storage.errors import CheckpointError

IM_START, IM_END, EOS = "<|im_start|>", "<|im_end|>", "<|endoftext|>"
CALL_OPEN, CALL_CLOSE = "<tool_call>", "</tool_call>"
RESPONSE_OPEN, RESPONSE_CLOSE = "<tool_response>", "</tool_response>"
SPECIAL_TOKENS = [EOS, IM_START, IM_END, CALL_OPEN, CALL_CLOSE, RESPONSE_OPEN, RESPONSE_CLOSE]
TOOL_NAME = "code_interpreter"
TRUNCATION_MARK = "...(truncated)..."
# Appended to the last error after K failed retries, as "\n\nNote: ..." with n = retries made, and only
# when n >= 2 (reference: ToolAgentLoop._handle_max_retry_exceeded).
RETRY_NOTE = (
    "Note: This approach has been attempted {n} times with the same type of error. Consider trying a "
    "different algorithm, method, or approach to solve this problem."
)

CODE_TOOL_SCHEMA: dict[str, Any] = {
    "type": "function",
    "function": {
        "name": TOOL_NAME,
        "description": "Run Python code and return its stdout and stderr.",
        "parameters": {
            "type": "object",
            "properties": {"code": {"type": "string", "description": "The Python code to run."}},
            "required": ["code"],
        },
    },
}

DEFAULT_SYSTEM = "Solve the problem with the Python tool. Put the final answer in \\boxed{}."

# Qwen-style template: system (+ tool list), user, assistant, and tool turns rendered exactly like
# the token-level turns the agent loop appends, so SFT transcripts and rollouts agree token for token.
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{% if message.role == 'system' %}"
    "<|im_start|>system\n{{ message.content }}"
    # Newlines after a block tag are emitted as expressions: transformers renders with trim_blocks.
    "{% if tools %}{{ '\\n# Tools\\n<tools>' }}{% for tool in tools %}{{ '\\n' }}{{ tool | tojson }}{% endfor %}"
    "{{ '\\n</tools>' }}{% endif %}"
    "<|im_end|>\n"
    "{% elif message.role == 'tool' %}"
    "<|im_start|>user\n<tool_response>\n{{ message.content }}\n</tool_response><|im_end|>\n"
    "{% else %}"
    "<|im_start|>{{ message.role }}\n{{ message.content }}<|im_end|>\n"
    "{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


@dataclass(frozen=True)
class ParsedCall:
    status: CallStatus
    code: str | None = None
    problem: str | None = None  # why a call could not be executed (shown to the model as a failure)


# How a malformed call block (never closed, or JSON that json_repair cannot make into a call) is lived:
# "no_call" — the reference: the turn is the final answer, no feedback, no retry (docs/saar.md);
# "failure" — cleaner's alternative: a failed call, shown to the model and retried.
MalformedCall = Literal["no_call", "failure"]
# json_repair parses recursively: a payload nested deeper than this would end in RecursionError,
# so it is treated as unparseable before the parser sees it (no real call nests this deep).
MAX_JSON_DEPTH = 64
_CALL_BLOCK = re.compile(re.escape(CALL_OPEN) + "(.*?)" + re.escape(CALL_CLOSE), re.DOTALL)


def _nesting_depth(payload: str) -> int:
    """The deepest bracket nesting outside JSON strings (a cheap guard, linear in the payload)."""
    depth = deepest = 0
    in_string = escaped = False
    for ch in payload:
        if in_string:
            if escaped:
                escaped = False
            elif ch == "\\":
                escaped = True
            elif ch == '"':
                in_string = False
        elif ch == '"':
            in_string = True
        elif ch in "[{":
            depth += 1
            deepest = max(deepest, depth)
        elif ch in "]}":
            depth = max(0, depth - 1)
    return deepest


def _repair(payload: str) -> Any:
    """json_repair.loads within limits: None when the payload cannot be parsed at all."""
    if _nesting_depth(payload) > MAX_JSON_DEPTH:
        return None
    try:
        return json_repair.loads(payload)
    except (RecursionError, ValueError, TypeError):
        return None


def _surrogate_at(text: str) -> int:
    """Index of the first lone surrogate (text that cannot be stored as UTF-8), or -1."""
    try:
        text.encode("utf-8")
        return -1
    except UnicodeEncodeError as e:
        return e.start


def _call_from(call: dict) -> ParsedCall:
    """A repaired call object -> what runs (reference: unknown tools and unusable arguments fail)."""
    name, args = call["name"], call["arguments"]
    if name != TOOL_NAME:
        return ParsedCall("unknown_tool", problem=f"unknown tool {name!r}; the only tool is {TOOL_NAME!r}")
    if not isinstance(args, dict):
        return ParsedCall("bad_json", problem="tool call format is wrong: arguments must be a JSON object")
    code = args.get("code")
    if not isinstance(code, str):
        return ParsedCall("bad_json", problem="tool call format is wrong: arguments.code must be a string")
    bad = _surrogate_at(code)
    if bad >= 0:  # e.g. "\\ud800": Python could run it, but it cannot be stored or shown as UTF-8
        return ParsedCall("bad_json", problem=f"arguments.code holds a lone surrogate at index {bad} (not UTF-8 text)")
    return ParsedCall("ok", code=code)


def parse_tool_call(text: str, malformed: MalformedCall = "no_call") -> ParsedCall:
    """The call an assistant turn makes: the first `<tool_call>…</tool_call>` block whose JSON (repaired
    by json_repair, as the reference's Hermes parser does) is an object with `name` and `arguments`.
    Only that one runs (max_parallel_calls=1)."""
    start = text.find(CALL_OPEN)
    if start < 0:
        return ParsedCall("no_call")
    blocks = _CALL_BLOCK.findall(text, start)
    for payload in blocks:
        call = _repair(payload)
        if isinstance(call, dict) and "name" in call and "arguments" in call:
            return _call_from(call)
    if malformed == "no_call":
        return ParsedCall("no_call")
    if not blocks:
        return ParsedCall("unclosed", problem="the <tool_call> block was never closed")
    return ParsedCall("bad_json", problem="invalid tool call JSON: not an object with name and arguments")


def render_tool_call(code: str) -> str:
    payload = json.dumps({"name": TOOL_NAME, "arguments": {"code": code}})
    return f"{CALL_OPEN}\n{payload}\n{CALL_CLOSE}"


def middle_truncate(text: str, limit: int) -> str:
    if len(text) <= limit:
        return text
    half = limit // 2
    return text[:half] + TRUNCATION_MARK + text[len(text) - half :]


def format_tool_response(success: bool, stdout: str = "", stderr: str = "", reason: str = "", limit: int = 256) -> str:
    """The reference response text: success/failure header, then the non-empty fields."""
    fields = (("reason", "" if success else reason), ("stdout", stdout), ("stderr", stderr))
    lines = ["Tool call success" if success else "Tool call failure"] + [f"{k}: {v}" for k, v in fields if v]
    return middle_truncate("\n".join(lines), limit)


@dataclass(frozen=True)
class TurnFrame:
    """The text a chat template writes between two sampled assistant turns, around a tool result.

    `before` follows the sampled stop token (the template's "\n" after <|im_end|>, then the tool turn's
    opening), `after` closes the tool turn, and `generation_prompt` opens the next assistant turn: it is
    `<|im_start|>assistant\n` for Qwen3 and Instruct-2507, `…assistant\n<think>\n` for Thinking-2507 and
    `…<think>\n\n</think>\n\n` for Qwen3 with enable_thinking=False. `ChatFormat` reads them from the
    checkpoint's own template (`derive_frame`), so every turn after a tool result opens as the template's
    full render does at that point.
    """

    before: str = f"\n{IM_START}user\n{RESPONSE_OPEN}\n"
    after: str = f"\n{RESPONSE_CLOSE}{IM_END}\n"
    generation_prompt: str = f"{IM_START}assistant\n"

    def tool_turn(self, text: str) -> str:
        return self.before + text + self.after + self.generation_prompt


HERMES_FRAME = TurnFrame()  # the Qwen/Hermes tool turn of the tool-use world's own template


def tool_response_turn(text: str, frame: TurnFrame = HERMES_FRAME) -> str:
    """The tool turn appended after an assistant turn (whose sampled ids end at <|im_end|>)."""
    return frame.tool_turn(text)


class TemplateError(CheckpointError):
    """The checkpoint's chat template is missing or does not say how a turn opens."""


def derive_frame(
    tokenizer: Any, template_kwargs: dict[str, Any] | None = None, where: str = "the checkpoint"
) -> TurnFrame:
    """The turn frame the tokenizer's chat template renders, found once by rendering probe conversations.

    The generation prompt is what `add_generation_prompt=True` adds to a render without it; the tool turn
    is what a tool message adds after an assistant message, split at a probe result. Renders are compared
    as text, and the frame is applied on token ids afterwards, so the running sequence is never re-rendered.
    """
    if not getattr(tokenizer, "chat_template", None):
        raise TemplateError(
            f"{where} has no chat template (chat_template.jinja or tokenizer_config.json's "
            "chat_template): cleaner renders the prompt and every tool turn with it"
        )
    kwargs = dict(template_kwargs or {})
    sentinel_a, sentinel_t = "CLEANER-PROBE-ASSISTANT", "CLEANER-PROBE-TOOL"

    def render(messages: list[dict[str, str]], generation_prompt: bool, **tools: Any) -> str:
        try:
            return tokenizer.apply_chat_template(
                messages, add_generation_prompt=generation_prompt, tokenize=False, **kwargs, **tools
            )
        except Exception as e:  # jinja2 raises its own errors (and templates raise on unsupported roles)
            raise TemplateError(
                f"the chat template of {where} failed to render a probe conversation: {type(e).__name__}: {e}"
            ) from None

    user = [{"role": "user", "content": "Q"}]
    plain, prompted = render(user, False), render(user, True)
    if not prompted.startswith(plain) or len(prompted) == len(plain):
        raise TemplateError(
            f"cannot derive the generation prompt from the chat template of {where}: rendering "
            "with add_generation_prompt=True does not extend the render without it"
        )
    with_tool = render(
        user + [{"role": "assistant", "content": sentinel_a}, {"role": "tool", "content": sentinel_t}], False
    )
    a_end = with_tool.find(sentinel_a) + len(sentinel_a)
    t_at = with_tool.find(sentinel_t)
    if a_end < len(sentinel_a) or t_at < a_end or not with_tool[a_end:].startswith(IM_END):
        raise TemplateError(
            f"cannot derive the tool turn from the chat template of {where}: an assistant turn "
            f"must end with {IM_END} and be followed by the tool result"
        )
    system = [{"role": "system", "content": "S"}, *user]
    if render(system, True) == render(system, True, tools=[CODE_TOOL_SCHEMA]):
        raise TemplateError(
            f"the chat template of {where} ignores the tools it is given (apply_chat_template's "
            f"tools=): the prompt would never show the policy the {TOOL_NAME!r} tool; use a template "
            "that renders tools, as instruct and Qwen3 checkpoints' templates do"
        )
    return TurnFrame(
        before=with_tool[a_end + len(IM_END) : t_at],
        after=with_tool[t_at + len(sentinel_t) :],
        generation_prompt=prompted[len(plain) :],
    )


def _bytes_to_unicode() -> dict[int, str]:
    # GPT-2's byte <-> printable-unicode table used by byte-level BPE vocabularies: a printable byte stands for
    # itself, the others, in byte order, for chr(256), chr(257), ...
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    others = [b for b in range(256) if b not in printable]
    return {**{b: chr(b) for b in printable}, **{b: chr(256 + n) for n, b in enumerate(others)}}


# printable character -> byte, for reading a byte-level vocabulary's tokens as the bytes they stand for
BYTE_DECODER = {c: b for b, c in _bytes_to_unicode().items()}


def token_byte_table(tokenizer: Any) -> list[bytes]:
    """The bytes each token id stands for, read from the vocabulary (not by encoding text)."""
    size = len(tokenizer)
    special = {tokenizer.convert_tokens_to_ids(t): t for t in tokenizer.all_special_tokens}
    for added_id, added in getattr(tokenizer, "added_tokens_decoder", {}).items():
        special[added_id] = added.content
    table: list[bytes] = []
    for i in range(size):
        if i in special:
            table.append(special[i].encode())
            continue
        piece = tokenizer.convert_ids_to_tokens(i)
        if piece is not None and all(c in BYTE_DECODER for c in piece):
            table.append(bytes(BYTE_DECODER[c] for c in piece))
        else:
            table.append(tokenizer.decode([i]).encode("utf-8", "surrogatepass"))
    return table


def find_call_start(turn_ids: list[int], marker_ids: list[int], token_bytes: list[bytes]) -> int:
    """Index of the token where the call segment starts, or -1 (no call, or no token boundary there).

    A single-token marker is found by id. A marker that the tokenizer splits is found through the
    bytes of each token id: it must begin exactly at a token boundary, otherwise the split fails
    (and the splice falls back to deep).
    """
    if len(marker_ids) == 1:
        return turn_ids.index(marker_ids[0]) if marker_ids[0] in turn_ids else -1
    at = b"".join(token_bytes[t] for t in turn_ids).find(b"".join(token_bytes[i] for i in marker_ids))
    if at < 0:
        return -1
    offsets = list(accumulate((len(token_bytes[t]) for t in turn_ids), initial=0))  # each token's first byte
    i = bisect_left(offsets, at)  # the first token starting at or after the marker's byte offset
    return i if i < len(turn_ids) and offsets[i] == at else -1


class ChatFormat:
    """The chat format bound to one tokenizer: everything the agent loop needs on token ids."""

    def __init__(
        self,
        tokenizer: Any,
        system_prompt: str = DEFAULT_SYSTEM,
        template_kwargs: dict[str, Any] | None = None,
        where: str = "the checkpoint",
    ) -> None:
        self.tokenizer = tokenizer
        self.system_prompt = system_prompt
        self.template_kwargs = dict(template_kwargs or {})  # e.g. {"enable_thinking": False} for Qwen3
        self.frame = derive_frame(tokenizer, self.template_kwargs, where)
        self.im_end_id = tokenizer.convert_tokens_to_ids(IM_END)
        self.eos_id = tokenizer.convert_tokens_to_ids(EOS)
        self.stop_ids = {i for i in (self.im_end_id, self.eos_id) if i is not None and i >= 0}
        self.marker_ids = tokenizer.encode(CALL_OPEN, add_special_tokens=False)

    @cached_property
    def token_bytes(self) -> list[bytes]:
        return token_byte_table(self.tokenizer)

    def encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=False)

    def decode(self, ids: list[int], skip_special: bool = False) -> str:
        backend = getattr(self.tokenizer, "backend_tokenizer", None)  # the Rust tokenizer: same text, no wrapper cost
        if backend is not None:
            return backend.decode(list(ids), skip_special_tokens=skip_special)
        return self.tokenizer.decode(ids, skip_special_tokens=skip_special)

    def prompt_ids(self, question: str) -> list[int]:
        messages = [{"role": "system", "content": self.system_prompt}, {"role": "user", "content": question}]
        out = self.tokenizer.apply_chat_template(
            messages, tools=[CODE_TOOL_SCHEMA], add_generation_prompt=True, tokenize=True, **self.template_kwargs
        )
        if isinstance(out, dict) or hasattr(out, "input_ids"):
            out = out["input_ids"]
        return list(out)

    def feedback_ids(self, response_text: str) -> list[int]:
        return self.encode(self.frame.tool_turn(response_text))

    def call_start(self, turn_ids: list[int]) -> int:
        return find_call_start(turn_ids, self.marker_ids, self.token_bytes)

    def parse_turn(self, turn_ids: list[int], malformed: MalformedCall = "no_call") -> tuple[int, ParsedCall]:
        """(call_start, parsed call) of one sampled assistant turn."""
        text = self.decode([t for t in turn_ids if t not in self.stop_ids])
        return self.call_start(turn_ids), parse_tool_call(text, malformed)


# A tokenizer's vocabulary, in one of the forms transformers reads (without one it builds a tokenizer of a few
# dozen special tokens, and a rollout commits nonsense ids)
VOCABULARY_FILES = (("tokenizer.json",), ("vocab.json", "merges.txt"), ("tokenizer.model",))


def load_chat(checkpoint: Path, template_kwargs: dict[str, Any] | None = None) -> ChatFormat:
    from transformers import AutoTokenizer

    checkpoint = Path(checkpoint)
    if not checkpoint.is_dir():
        raise CheckpointError(
            f"checkpoint {checkpoint} "
            + ("is a file, not a checkpoint folder" if checkpoint.exists() else "does not exist")
        )
    if not (checkpoint / "tokenizer_config.json").is_file():
        raise CheckpointError(f"no tokenizer in checkpoint {checkpoint} (tokenizer_config.json missing)")
    if not any(all((checkpoint / name).is_file() for name in names) for names in VOCABULARY_FILES):
        raise CheckpointError(
            f"checkpoint {checkpoint}: tokenizer_config.json without a vocabulary beside it "
            "(tokenizer.json, or vocab.json and merges.txt, or tokenizer.model)"
        )
    tokenizer = AutoTokenizer.from_pretrained(checkpoint)
    with contextlib.suppress(OSError, ValueError, AttributeError):  # a checkpoint without config.json: no check
        vocab = json.loads((checkpoint / "config.json").read_text()).get("vocab_size")
        if isinstance(vocab, int) and len(tokenizer) > vocab:  # ids the model has no embedding for
            raise CheckpointError(
                f"checkpoint {checkpoint}: its tokenizer has {len(tokenizer):,} ids and config.json "
                f"vocab_size is {vocab:,}: the tokenizer is another model's"
            )
    return ChatFormat(tokenizer, template_kwargs=template_kwargs, where=f"checkpoint {checkpoint}")
