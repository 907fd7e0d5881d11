"""pipeline/chat.py: tool-call parsing, tool-response rendering and the call boundary on token ids."""

from __future__ import annotations

import json

import pytest

from pipeline.chat import (
    CALL_OPEN,
    IM_END,
    ChatFormat,
    format_tool_response,
    middle_truncate,
    parse_tool_call,
    render_tool_call,
    tool_response_turn,
)
from rollout_gen.world.tokenizer import train_tokenizer

TURNS = [
    "I will add the numbers with Python.\n" + render_tool_call("print(12 + 34)") + IM_END,
    "Let me compute it step by step.\n" + render_tool_call("a = 7\nb = 8\nprint(a * b)") + IM_END,
    "The answer is \\boxed{46}." + IM_END,
]
CORPUS = [t for t in TURNS for _ in range(20)] + [tool_response_turn(format_tool_response(True, "46"))] * 10


@pytest.fixture(scope="module", params=[True, False], ids=["single-token-marker", "split-marker"])
def chat(request) -> ChatFormat:
    return ChatFormat(
        train_tokenizer(CORPUS, vocab_size=400, single_token_markers=request.param, merge_across_words=False)
    )


def test_parse_tool_call_variants():
    assert parse_tool_call("no call here").status == "no_call"
    ok = parse_tool_call("think " + render_tool_call("print(1)") + " " + render_tool_call("print(2)"))
    assert ok.status == "ok" and ok.code == "print(1)"  # only the first call runs
    # malformed blocks are no call (reference: HermesToolParser), or failed calls with malformed="failure"
    assert parse_tool_call("<tool_call>\n{bad json\n</tool_call>").status == "no_call"
    assert parse_tool_call("<tool_call>\n{bad json\n</tool_call>", "failure").status == "bad_json"
    assert parse_tool_call('<tool_call>\n{"name": "x", "arguments": {"code": "1"}}').status == "no_call"
    assert parse_tool_call('<tool_call>\n{"name": "x", "arguments": {"code": "1"}}', "failure").status == "unclosed"
    # the first block that parses is the call (a malformed one before it is skipped, as the reference does)
    two = "<tool_call>\nnope\n</tool_call> " + render_tool_call("print(2)")
    assert parse_tool_call(two).code == "print(2)"
    unknown = parse_tool_call('<tool_call>\n{"name": "browser", "arguments": {}}\n</tool_call>')
    assert unknown.status == "unknown_tool" and "browser" in unknown.problem
    # arguments as a JSON string: the reference hands the string to the tool, which fails on it
    as_string = json.dumps({"name": "code_interpreter", "arguments": json.dumps({"code": "print(3)"})})
    assert parse_tool_call(f"<tool_call>\n{as_string}\n</tool_call>").status == "bad_json"
    assert (
        parse_tool_call('<tool_call>\n{"name": "code_interpreter", "arguments": {"code": 5}}\n</tool_call>').status
        == "bad_json"
    )


def test_tool_response_format_and_truncation():
    assert format_tool_response(True, stdout="42") == "Tool call success\nstdout: 42"
    assert format_tool_response(False, stderr="NameError: x", reason="NameError") == (
        "Tool call failure\nreason: NameError\nstderr: NameError: x"
    )
    long = format_tool_response(True, stdout="9" * 1000, limit=256)
    assert len(long) == 256 + len("...(truncated)...") and long.startswith("Tool call success")
    assert middle_truncate("abcdef", 4) == "ab...(truncated)...ef"


def test_call_start_on_token_ids(chat):
    for text in TURNS[:2]:
        ids = chat.encode(text)
        start = chat.call_start(ids)
        assert start > 0
        assert chat.decode(ids[start:]).startswith(CALL_OPEN)
        assert CALL_OPEN not in chat.decode(ids[:start])
    assert chat.call_start(chat.encode(TURNS[2])) == -1


def test_marker_shape_matches_tokenizer(chat):
    single = (
        chat.tokenizer.convert_tokens_to_ids(CALL_OPEN) != chat.tokenizer.unk_token_id and len(chat.marker_ids) == 1
    )
    assert single == (len(chat.marker_ids) == 1)


def test_call_start_never_retokenizes(chat, monkeypatch):
    ids = chat.encode(TURNS[0])
    chat.token_bytes  # the vocabulary table is built once, up front
    monkeypatch.setattr(chat.tokenizer, "encode", lambda *a, **k: pytest.fail("re-tokenized text"))
    monkeypatch.setattr(chat.tokenizer, "__call__", lambda *a, **k: pytest.fail("re-tokenized text"))
    assert chat.call_start(ids) > 0


def test_split_marker_inside_a_token_fails_cleanly():
    # Punctuation right before the marker lets BPE merge ".<" into one token: the call then starts
    # mid-token, there is no boundary on token ids, and the splice must fall back to deep.
    turn = "Compute it.<tool_call>" + render_tool_call("print(1)")[len(CALL_OPEN) :] + IM_END
    chat = ChatFormat(
        train_tokenizer(CORPUS + [turn] * 50, vocab_size=400, single_token_markers=False, merge_across_words=False)
    )
    ids = chat.encode(turn)
    assert any(chat.token_bytes[i] == b".<" for i in ids), "fixture: the tokenizer should merge '.<'"
    assert chat.call_start(ids) == -1
    assert parse_tool_call(chat.decode(ids)).status == "ok"  # the call itself still parses and runs


def test_feedback_ids_decode_to_the_reference_turn(chat):
    text = format_tool_response(False, stderr="NameError: name 'prnt' is not defined", reason="NameError")
    ids = chat.feedback_ids(text)
    assert chat.decode(ids) == tool_response_turn(text)


def test_prompt_uses_chat_template(chat):
    ids = chat.prompt_ids("What is 2 + 3?")
    text = chat.decode(ids)
    assert text.startswith("<|im_start|>system\n") and "code_interpreter" in text
    assert text.endswith("<|im_start|>user\nWhat is 2 + 3?<|im_end|>\n<|im_start|>assistant\n")
