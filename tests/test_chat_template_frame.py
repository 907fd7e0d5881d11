"""The turn after a tool result opens as the checkpoint's own chat template opens it (issue #34).

Qwen3-4B-Thinking-2507 opens every assistant turn with `<think>\\n`; cleaner used to append
`<|im_start|>assistant\\n` after every tool response whatever the template said, so from the second turn
on a Thinking-2507 policy generated in a context it was never trained in.
"""

from __future__ import annotations

import pytest
from transformers import AutoTokenizer

from pipeline.chat import (
    CODE_TOOL_SCHEMA,
    DEFAULT_SYSTEM,
    HERMES_FRAME,
    TOOL_NAME,
    ChatFormat,
    TemplateError,
    format_tool_response,
    load_chat,
    render_tool_call,
    tool_response_turn,
)
from pipeline.config import DEFAULT_POLICY
from pipeline.qwen3_tokenizer import TOKENIZER_DIR, chat_template

QUESTION = "What is (2 + 3) * 7?"
# (reasoning, code, tool result) of each call the model makes, then its final answer
CALLS = [
    ("Add first.", "print(2 + 3)", format_tool_response(True, stdout="5")),
    ("Now multiply.", "print(5 * 7)", format_tool_response(False, stderr="NameError: x", reason="NameError")),
]
FINAL = ("It is 35.", "The answer is \\boxed{35}.")


def qwen3_tokenizer(family: str):
    tok = AutoTokenizer.from_pretrained(TOKENIZER_DIR)
    tok.chat_template = chat_template(family)
    return tok


def test_thinking_2507_incremental_ids_equal_the_templates_render_at_every_generation_point():
    tok = qwen3_tokenizer("thinking-2507")
    chat = ChatFormat(tok)
    assert chat.frame.generation_prompt == "<|im_start|>assistant\n<think>\n"
    messages = [{"role": "system", "content": DEFAULT_SYSTEM}, {"role": "user", "content": QUESTION}]
    ids = chat.prompt_ids(QUESTION)
    points = 0
    for reasoning, code, result in CALLS:
        want = tok.apply_chat_template(
            messages, tools=[CODE_TOOL_SCHEMA], add_generation_prompt=True, tokenize=True, return_dict=True
        )["input_ids"]
        assert ids == want, f"generation point {points}: {tok.decode(ids)!r} vs {tok.decode(want)!r}"
        points += 1
        # what a Thinking-2507 model samples after its generation prompt's "<think>\n"
        ids += chat.encode(f"{reasoning}\n</think>\n\n" + render_tool_call(code)) + [chat.im_end_id]
        ids += chat.feedback_ids(result)
        messages += [
            {
                "role": "assistant",
                "content": f"<think>\n{reasoning}\n</think>\n\n",
                "tool_calls": [{"type": "function", "function": {"name": TOOL_NAME, "arguments": {"code": code}}}],
            },
            {"role": "tool", "content": result},
        ]
    want = tok.apply_chat_template(
        messages, tools=[CODE_TOOL_SCHEMA], add_generation_prompt=True, tokenize=True, return_dict=True
    )["input_ids"]
    assert ids == want and points == 2
    assert tok.decode(ids).endswith("</tool_response><|im_end|>\n<|im_start|>assistant\n<think>\n")
    # the old hard-coded turn would have left the <think> out after a tool result
    assert chat.feedback_ids(CALLS[0][2]) != chat.encode(tool_response_turn(CALLS[0][2]))
    # and the whole conversation, final answer included, is what the template renders for the transcript
    ids += chat.encode(f"{FINAL[0]}\n</think>\n\n{FINAL[1]}") + [chat.im_end_id]
    messages.append({"role": "assistant", "content": f"<think>\n{FINAL[0]}\n</think>\n\n{FINAL[1]}"})
    full = tok.apply_chat_template(messages, tools=[CODE_TOOL_SCHEMA], tokenize=True, return_dict=True)["input_ids"]
    assert full == ids + chat.encode("\n")


@pytest.mark.parametrize(
    "checkpoint",
    [TOKENIZER_DIR, DEFAULT_POLICY, DEFAULT_POLICY.parent / "world-recovery"],
    ids=["qwen3", "tiny-tool-policy", "world-recovery"],
)
def test_qwen3_and_committed_policies_keep_todays_ids(checkpoint):
    """Qwen3-4B (and Instruct-2507, whose generation prompt is the same) and the committed policies: the
    derived frame is the Hermes turn cleaner always appended, so every id stays as it was."""
    chat = load_chat(checkpoint)
    assert chat.frame == HERMES_FRAME
    text = format_tool_response(False, stderr="NameError: name 'prnt' is not defined", reason="NameError")
    assert chat.feedback_ids(text) == chat.encode(tool_response_turn(text))


def test_enable_thinking_false_opens_every_turn_with_an_empty_think_block():
    chat = ChatFormat(qwen3_tokenizer("qwen3"), template_kwargs={"enable_thinking": False})
    assert chat.frame.generation_prompt == "<|im_start|>assistant\n<think>\n\n</think>\n\n"
    assert chat.decode(chat.prompt_ids("Hi")).endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert chat.decode(chat.feedback_ids("Tool call success")).endswith(
        "</tool_response><|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"
    )


def test_rollout_config_passes_template_kwargs(tmp_path):
    from pipeline.config import load_config

    cfg = load_config(None, ["rollout.chat_template_kwargs={enable_thinking: false}"])
    assert cfg.rollout.chat_template_kwargs == {"enable_thinking": False}
    assert load_chat(TOKENIZER_DIR, cfg.rollout.chat_template_kwargs).frame.generation_prompt.endswith("</think>\n\n")


def test_no_chat_template_is_one_clear_error():
    tok = qwen3_tokenizer("qwen3")
    tok.chat_template = None
    with pytest.raises(TemplateError, match="has no chat template"):
        ChatFormat(tok, where="checkpoint /x")


def test_template_without_a_derivable_generation_prompt_is_one_clear_error():
    tok = qwen3_tokenizer("qwen3")
    tok.chat_template = "{% for m in messages %}{{ m.content }}{% endfor %}"  # ignores add_generation_prompt
    with pytest.raises(TemplateError, match="cannot derive the generation prompt"):
        ChatFormat(tok)
    tok.chat_template = (
        "{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}{% if add_generation_prompt %}A:{% endif %}"
    )
    with pytest.raises(TemplateError, match="cannot derive the tool turn"):
        ChatFormat(tok)
    tok.chat_template = "{{ raise_exception('no tools here') }}"
    with pytest.raises(TemplateError, match="failed to render a probe conversation"):
        ChatFormat(tok)


def test_a_template_that_ignores_the_tools_it_is_given_is_one_clear_error():
    """A chat template without tool support (a base model's ChatML) renders the prompt without the tool's schema:
    the policy would never be told the tool exists. Refused when the chat format is built, naming the checkpoint."""
    tok = qwen3_tokenizer("qwen3")
    tok.chat_template = (
        "{% for m in messages %}<|im_start|>{{ 'user' if m.role == 'tool' else m.role }}\n"
        "{{ m.content }}<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n"
        "{% endif %}"
    )  # a tool turn it can frame, and no `tools` anywhere
    with pytest.raises(TemplateError, match=r"checkpoint /x ignores the tools it is given .*'code_interpreter'"):
        ChatFormat(tok, where="checkpoint /x")


def test_init_policy_writes_a_thinking_2507_checkpoint(tmp_path):
    import json

    from tests.flow_helpers import run_cleaner

    out = tmp_path / "thinking"
    run = run_cleaner(["init-policy", "--out", str(out), "--template", "thinking-2507"])
    assert run.returncode == 0, run.stderr
    assert json.loads((out / "PROVENANCE.json").read_text())["chat_template"] == "thinking-2507"
    assert load_chat(out).frame.generation_prompt == "<|im_start|>assistant\n<think>\n"
    bad = run_cleaner(["init-policy", "--out", str(tmp_path / "x"), "--template", "nope"])
    assert bad.returncode != 0 and "invalid choice: 'nope'" in bad.stderr and not (tmp_path / "x").exists()


def test_init_policy_never_writes_over_an_existing_folder(tmp_path):
    """`--out` naming a model folder replaced its weights and left its other files (metrics.json of the old model)
    beside them; `--out policies/tiny-tool-policy` would have destroyed the shipped policy."""
    import shutil

    from pipeline.config import DEFAULT_POLICY
    from tests.flow_helpers import run_cleaner

    mine = tmp_path / "mine"
    shutil.copytree(DEFAULT_POLICY, mine)
    before = {p.name: p.read_bytes() for p in mine.iterdir()}
    run = run_cleaner(["init-policy", "--out", str(mine)])
    assert run.returncode == 1, run.stderr
    assert run.stderr.strip() == (
        f"cleaner init-policy: --out {mine} already exists and holds files: init-policy "
        "writes a new folder; choose another, or remove it first"
    ), run.stderr
    assert {p.name: p.read_bytes() for p in mine.iterdir()} == before
    empty = tmp_path / "empty"
    empty.mkdir()
    run = run_cleaner(["init-policy", "--out", str(empty), "--random"])
    assert run.returncode == 0, run.stderr
    assert (empty / "model.safetensors").is_file() and not list(tmp_path.glob(".*.tmp"))
