"""The committed Qwen3 tokenizer (built from the llama-cpp-python sdist's GGUF vocabulary) against
llama.cpp's own test vectors, Qwen3's added-token layout, and Qwen3's chat template against the
token-level turns the agent loop appends."""

from __future__ import annotations

import json

import pytest
from transformers import AutoTokenizer

from pipeline.chat import (
    CODE_TOOL_SCHEMA,
    DEFAULT_SYSTEM,
    TOOL_NAME,
    ChatFormat,
    format_tool_response,
    render_tool_call,
)
from pipeline.qwen3_tokenizer import ADDED_TOKENS, REGULAR_TOKENS, TOKENIZER_DIR, TOOL_CALL_ID, read_vectors


@pytest.fixture(scope="module")
def tok():
    return AutoTokenizer.from_pretrained(TOKENIZER_DIR)


def test_llama_cpp_test_vectors(tok):
    vectors = read_vectors(TOKENIZER_DIR / "vectors")
    assert len(vectors) == 46 and any(ids and max(ids) > 65_535 for _, ids in vectors)
    for text, want in vectors:
        assert tok.encode(text, add_special_tokens=False) == want, repr(text)


def test_added_tokens_sit_at_qwen3_ids(tok):
    assert len(tok) == REGULAR_TOKENS + len(ADDED_TOKENS) == 151_669
    for i, content, _special in ADDED_TOKENS:
        assert tok.convert_tokens_to_ids(content) == i
        assert tok.encode(content, add_special_tokens=False) == [i]  # one token, never split by BPE
    assert tok.eos_token_id == 151645 and tok.pad_token_id == 151643
    spec = json.loads((TOKENIZER_DIR / "tokenizer.json").read_text())
    assert not any(p.startswith("[PAD") for p in spec["model"]["vocab"])


def test_chat_template_is_qwen3s_and_matches_the_token_level_turns(tok):
    chat = ChatFormat(tok)
    prompt = chat.prompt_ids("What is 2 + 3?")
    text = tok.decode(prompt)
    assert text.startswith(f"<|im_start|>system\n{DEFAULT_SYSTEM}\n\n# Tools\n\nYou may call one or more functions")
    assert text.endswith("<|im_start|>user\nWhat is 2 + 3?<|im_end|>\n<|im_start|>assistant\n")
    turn = chat.encode("<think>\nAdd them.\n</think>\n\n" + render_tool_call("print(2 + 3)")) + [chat.im_end_id]
    feedback = chat.feedback_ids(format_tool_response(True, stdout="5"))
    messages = [
        {"role": "system", "content": DEFAULT_SYSTEM},
        {"role": "user", "content": "What is 2 + 3?"},
        {
            "role": "assistant",
            "content": "<think>\nAdd them.\n</think>\n\n",
            "tool_calls": [
                {"type": "function", "function": {"name": TOOL_NAME, "arguments": {"code": "print(2 + 3)"}}}
            ],
        },
        {"role": "tool", "content": format_tool_response(True, stdout="5")},
    ]
    rendered = tok.apply_chat_template(
        messages, tools=[CODE_TOOL_SCHEMA], add_generation_prompt=True, tokenize=True, return_dict=True
    )["input_ids"]
    assert rendered == prompt + turn + feedback  # the agent loop's ids are what Qwen3's template renders
    assert chat.marker_ids == [TOOL_CALL_ID] and chat.call_start(turn) == turn.index(TOOL_CALL_ID) == 7
    assert turn[0] == 151667 and 151668 in turn  # <think> … </think> before the call


def test_enable_thinking_switch(tok):
    messages = [{"role": "user", "content": "Hi"}]
    on = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    off = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False, enable_thinking=False)
    assert on.endswith("<|im_start|>assistant\n")
    assert off == on + "<think>\n\n</think>\n\n"
