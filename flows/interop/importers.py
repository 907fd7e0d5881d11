"""Foreign rollouts as raw rows: ATIF trajectories, TRL completions and verl rollout dumps (JSON Lines).

Each source line (or document) becomes one raw row (storage/schemas.py RAW) of a run of its own, so `inspect`, the
viewer, `replay` and `filter` read it like any other. A failed tool call followed by the model's next call is an
in-context retry: the next attempt at the same position (live mode `raw`: every attempt and error stays in the
lived sequence, as the source lived it).

Token exactness: ATIF written by cleaner (`extra.cleaner.format` = cleaner-raw/1) is rebuilt exactly
(flows/interop/atif.py). Other ATIF ≥ 1.3 keeps each step's sampled ids and log-probs; its prompt and tool-response
ids are exact when the steps carry prompt_token_ids (≥ 1.4) that extend each other, else re-tokenized. Text sources
(trl-completions, verl-jsonl, ATIF without ids) are re-tokenized with the named tokenizer, their log-probs unknown
(0), and the shard's manifest says `token_exact: false`: purifying them is refused unless the import allowed it.
"""

from __future__ import annotations

import functools
import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator

from flows.interop import atif as atif_format
from flows.interop.source import InteropError
from flows.interop.trl import unframed
from pipeline.answers import last_boxed
from pipeline.chat import (
    CALL_OPEN,
    EOS,
    IM_END,
    IM_START,
    RESPONSE_CLOSE,
    RESPONSE_OPEN,
    TOOL_NAME,
    ChatFormat,
    parse_tool_call,
    render_tool_call,
)
from pipeline.trajectory import fingerprint
from storage.errors import first_line
from storage.schemas import STATS

FORMATS = ("atif", "trl-completions", "verl-jsonl")
FAILURE_MARKS = ("Tool call failure", "Traceback (most recent call last)")
_ERROR_NAME = re.compile(r"\b([A-Z]\w*(?:Error|Exception))\b")


# ---- reading the files ------------------------------------------------------------------------------------------


def documents(path: Path) -> Iterator[tuple[str, dict[str, Any]]]:
    """(where, object) for each JSON object of a file: each line of a .jsonl file, or the document of a .json file
    (an object, or a list of objects). One line naming the file and line for anything else."""
    path = Path(path)
    if not path.is_file():
        raise InteropError(f"{path}: " + ("is a folder, not a file" if path.is_dir() else "does not exist"))
    if path.suffix.lower() == ".json":
        try:
            data = json.loads(path.read_text())
        except (ValueError, UnicodeDecodeError) as e:
            raise InteropError(f"{path}: not JSON ({first_line(e)})") from None
        items = data if isinstance(data, list) else [data]
        for n, item in enumerate(items):
            where = f"{path}" + (f": item {n}" if isinstance(data, list) else "")
            if not isinstance(item, dict):
                raise InteropError(f"{where}: not a JSON object (a {type(item).__name__})")
            yield where, item
        return
    with open(path, encoding="utf-8", errors="strict") as f:
        try:
            for n, line in enumerate(f, 1):
                if not line.strip():
                    continue
                where = f"{path}: line {n}"
                try:
                    item = json.loads(line)
                except ValueError as e:
                    raise InteropError(f"{where}: not JSON ({first_line(e)})") from None
                if not isinstance(item, dict):
                    raise InteropError(f"{where}: not a JSON object (a {type(item).__name__}); each line must be one")
                yield where, item
        except UnicodeDecodeError as e:
            raise InteropError(f"{path}: not UTF-8 text ({first_line(e)})") from None


def validated_atif(doc: dict[str, Any], where: str):
    """The document as the `atif` package's Trajectory, with its (major, minor) version; one line naming the first
    field that is wrong otherwise."""
    import atif
    import pydantic

    version = atif_format.parse_version(doc.get("schema_version"), where)
    try:
        return atif.Trajectory.model_validate(doc), version
    except pydantic.ValidationError as e:
        err = e.errors()[0]
        loc = ".".join(str(x) for x in err["loc"]) or "the document"
        raise InteropError(f"{where}: invalid ATIF ({doc.get('schema_version')}): {loc}: {err['msg']}") from None


# ---- turns -> a raw row -----------------------------------------------------------------------------------------


@dataclass
class Turn:
    """One assistant turn of a foreign trajectory and the tool response after it."""

    ids: list[int]
    logprobs: list[float]
    code: str | None
    result_text: str | None = None  # None: no tool response followed
    failed: bool = False
    error_label: str | None = None
    feedback_ids: list[int] = field(default_factory=list)


def failure_of(text: str | None, explicit: bool | None = None) -> tuple[bool, str | None]:
    """(failed, error label) of a tool response: as the source says when it says, else from the text (cleaner's
    "Tool call failure" header, a Python traceback)."""
    if text is None:
        return False, None
    failed = explicit if explicit is not None else any(m in text for m in FAILURE_MARKS)
    if not failed:
        return False, None
    names = _ERROR_NAME.findall(text)
    return True, names[-1] if names else "tool_error"


def raw_row(
    *,
    run_id: str,
    iteration: int,
    prompt_id: str,
    sample_idx: int,
    policy_version: str,
    source: str,
    question: str,
    ground_truth: str,
    reward: float,
    prompt_ids: list[int],
    turns: list[Turn],
    chat: ChatFormat | None,
    final_text: str | None,
) -> dict[str, Any]:
    """A raw row of turns as lived in context: a call after a failed call is its retry (same position)."""
    lived: list[int] = []
    mask: list[int] = []
    lps: list[float] = []
    positions: list[dict[str, Any]] = []
    final = None
    stats = dict.fromkeys(STATS.names, 0)
    previous_failed = False
    for n, t in enumerate(turns):
        context = prompt_ids + lived
        result = None
        if t.result_text is not None:
            result = {
                "status": "failure" if t.failed else "success",
                "text": t.result_text,
                "error_label": t.error_label,
                "error_class": "model" if t.failed else None,
                "exit_code": None,
                "duration_s": 0.0,
                "timed_out": False,
            }
        attempt = {
            "attempt_idx": 0,
            "turn_ids": t.ids,
            "logprobs": t.logprobs,
            "call_start": chat.call_start(t.ids) if chat is not None and t.code is not None else -1,
            "call_status": "ok" if t.code is not None else "no_call",
            "context_len": len(context),
            "context_fingerprint": fingerprint(context),
            "code": t.code,
            "result": result,
            "feedback_ids": t.feedback_ids,
            "finish_reason": "stop",
        }
        lived += t.ids + t.feedback_ids
        mask += [1] * len(t.ids) + [0] * len(t.feedback_ids)
        lps += list(t.logprobs) + [0.0] * len(t.feedback_ids)
        stats["turns"] += 1
        stats["generated_tokens"] += len(t.ids)
        if t.code is None and n == len(turns) - 1 and not t.feedback_ids:
            final = attempt
            break
        if t.code is not None:
            stats["tool_calls"] += 1
            stats["model_failures"] += int(t.failed)
        if t.code is not None and previous_failed and positions:
            attempt["attempt_idx"] = len(positions[-1]["attempts"])
            positions[-1]["attempts"].append(attempt)
            stats["retries"] += 1
        else:
            positions.append({"position_idx": len(positions), "attempts": [attempt], "outcome": "success"})
            stats["first_attempt_failures"] += int(t.failed)
        previous_failed = t.code is not None and t.failed
    for p in positions:
        last, retried = p["attempts"][-1], len(p["attempts"]) > 1
        if last["result"] is None:
            p["outcome"] = "success" if last["call_status"] == "no_call" else "truncated"
        elif last["result"]["status"] == "failure":
            p["outcome"] = "exhausted" if retried else "not_retried"
        else:
            p["outcome"] = "recovered" if retried else "success"
        stats["recovered"] += p["outcome"] == "recovered"
        stats["exhausted"] += p["outcome"] == "exhausted"
    stats["response_tokens"] = len(lived)
    return {
        "run_id": run_id,
        "iteration": iteration,
        "prompt_id": prompt_id,
        "sample_idx": sample_idx,
        "policy_version": policy_version,
        "seed": 0,
        "task_source": source,
        "question": question,
        "ground_truth": ground_truth,
        "saar_gate": False,
        "gate_p": 0.0,
        "live_mode": "raw",
        "gamma_live": 0.0,
        "max_retries": max([len(p["attempts"]) - 1 for p in positions], default=0),
        "prompt_ids": prompt_ids,
        "lived_ids": lived,
        "lived_mask": mask,
        "lived_logprobs": lps,
        "positions": positions,
        "final_turn": final,
        "final_answer": last_boxed(final_text) if final_text else None,
        "reward": float(reward),
        "finish_reason": "stop",
        "stats": stats,
    }


# ---- text sources: messages re-tokenized ------------------------------------------------------------------------


def _content(message: dict[str, Any], where: str) -> str:
    content = message.get("content")
    if content is None:
        return ""
    if isinstance(content, list):  # content parts: their text
        return "".join(p.get("text", "") for p in content if isinstance(p, dict))
    if not isinstance(content, str):
        raise InteropError(f"{where}: a message's content is a {type(content).__name__}, expected text")
    return content


def _call_code(call: Any, where: str) -> str:
    function = call.get("function", call) if isinstance(call, dict) else None
    args = function.get("arguments") if isinstance(function, dict) else None
    if isinstance(args, str):
        try:
            args = json.loads(args)
        except ValueError:
            raise InteropError(f"{where}: a tool call's arguments are not JSON") from None
    if not isinstance(args, dict):
        raise InteropError(f"{where}: a tool call without arguments (expected function.arguments)")
    return code_argument(args, function.get("name"), where)


def code_argument(args: dict[str, Any], name: Any, where: str) -> str:
    """The Python a call runs: cleaner's policy has one tool, an interpreter taking `code`; a call to another tool
    would be stored as code it never was."""
    code = args.get("code")
    if not isinstance(code, str):
        raise InteropError(
            f"{where}: a call to tool {name!r} with arguments {sorted(args)} has no `code` string: cleaner rows hold "
            f"calls to one Python tool ({TOOL_NAME!r}, argument `code`)"
        )
    return code


def one_call(calls: list[Any], where: str) -> Any:
    if len(calls) > 1:
        raise InteropError(
            f"{where}: {len(calls)} tool calls in one message: cleaner rows hold one call per assistant turn, its "
            "result in the next tool message"
        )
    return calls[0]


def text_turns(messages: list[Any], chat: ChatFormat, where: str) -> tuple[list[Turn], str | None]:
    """Assistant and tool messages as re-tokenized turns (the turn as the template renders it, stop token
    included; each tool response as the template's tool turn); and the last assistant text."""
    turns: list[Turn] = []
    last_text = None
    for n, m in enumerate(messages):
        if not isinstance(m, dict):
            raise InteropError(f"{where}: message {n} is not an object")
        role, text = m.get("role"), _content(m, f"{where}: message {n}")
        if role == "assistant":
            calls = m.get("tool_calls") or []
            code = _call_code(one_call(calls, f"{where}: message {n}"), f"{where}: message {n}") if calls else None
            body = text.replace(IM_END, "").replace(EOS, "")
            rendered = body + (
                ("\n" if body else "") + render_tool_call(code)
                if code is not None and "<tool_call>" not in body
                else ""
            )
            if code is None:
                code = parse_tool_call(rendered).code
            ids = chat.encode(rendered + IM_END)
            turns.append(Turn(ids, [0.0] * len(ids), code))
            last_text = rendered
        elif role in ("tool", "ipython", "function"):
            if not turns:
                raise InteropError(f"{where}: message {n} is a tool response before any assistant turn")
            t = turns[-1]
            t.result_text = text if t.result_text is None else t.result_text + "\n" + text
            t.failed, t.error_label = failure_of(
                t.result_text, m.get("error") if isinstance(m.get("error"), bool) else None
            )
            t.feedback_ids = chat.feedback_ids(t.result_text)
        elif role == "user" and turns:  # a user turn between calls: shown to the model like a tool response
            raise InteropError(
                f"{where}: message {n}: a user message after the first assistant turn (cleaner "
                "rows have one question and tool responses after it)"
            )
    return turns, last_text


def question_of(prompt: Any, where: str) -> tuple[str, list[dict[str, Any]]]:
    """(the question, the prompt as messages) of a TRL prompt: text, or messages whose last user message asks."""
    if isinstance(prompt, str):
        return prompt, [{"role": "user", "content": prompt}]
    if isinstance(prompt, list):
        users = [_content(m, where) for m in prompt if isinstance(m, dict) and m.get("role") == "user"]
        if users:
            return users[-1], [m for m in prompt if isinstance(m, dict)]
    raise InteropError(f"{where}: field 'prompt' has no user message")


def prompt_ids_of(chat: ChatFormat, messages: list[dict[str, Any]]) -> list[int]:
    """The prompt as cleaner renders one (its tool schema; the source's system message when it has one)."""
    from pipeline.chat import CODE_TOOL_SCHEMA

    if not any(m.get("role") == "system" for m in messages):
        messages = [{"role": "system", "content": chat.system_prompt}, *messages]
    out = chat.tokenizer.apply_chat_template(
        [{"role": m["role"], "content": _content(m, "")} for m in messages],
        tools=[CODE_TOOL_SCHEMA],
        add_generation_prompt=True,
        tokenize=True,
        **chat.template_kwargs,
    )
    if isinstance(out, dict) or hasattr(out, "input_ids"):
        out = out["input_ids"]
    return list(out)


# verl decodes its dump with skip_special_tokens=True: <|im_end|> and <|im_start|> may be gone, the role names stay
_TOOL_TURN_OPENING = re.compile(r"(?:<\|im_end\|>)?\s*(?:<\|im_start\|>)?user\n$")
_NEXT_TURN_OPENING = re.compile(r"^\s*(?:<\|im_end\|>)?\s*(?:<\|im_start\|>)?assistant\n")


def split_rendered(output: str) -> list[dict[str, Any]]:
    """A rendered response (verl's dump: turns and tool responses as one text, with or without the special tokens)
    as assistant and tool messages."""
    messages: list[dict[str, Any]] = []
    rest = output
    while rest:
        start = rest.find(RESPONSE_OPEN)
        if start < 0:
            messages.append({"role": "assistant", "content": rest})
            break
        end = rest.find(RESPONSE_CLOSE, start)
        end = len(rest) if end < 0 else end
        turn = _TOOL_TURN_OPENING.sub("", rest[:start])  # the assistant turn ends where the tool turn opens
        messages.append({"role": "assistant", "content": turn.removesuffix(IM_END)})
        messages.append({"role": "tool", "content": unframed(rest[start + len(RESPONSE_OPEN) : end])})
        rest = rest[end + len(RESPONSE_CLOSE) :]
        opening = _NEXT_TURN_OPENING.search(rest)
        rest = rest[opening.end() :] if opening else ""
    return [m for m in messages if m["role"] == "tool" or m["content"].strip()]


_BARE_CALL = re.compile(
    r'\{\s*(?:"name"\s*:\s*"[^"]*"\s*,\s*"arguments"\s*:|"arguments"\s*:\s*\{.*?\}\s*,\s*"name"\s*:)', re.S
)


@functools.lru_cache(maxsize=8)
def _markers_are_special(tokenizer: Any) -> bool:
    """Whether a decode with skip_special_tokens=True drops this tokenizer's <tool_call> (once per tokenizer)."""
    return not tokenizer.decode(tokenizer.encode(CALL_OPEN, add_special_tokens=False), skip_special_tokens=True).strip()


def check_markup(output: str, chat: ChatFormat, where: str, field: str = "output") -> None:
    """Refuse a dump whose calls lost their markers: decoded with skip_special_tokens=True under a tokenizer whose
    <tool_call> is a special token (the tiny policy's; Qwen3's is not), a call and its tool response read as the
    answer's text, and the rollout would be stored as one with no call."""
    if CALL_OPEN in output or not _BARE_CALL.search(output):
        return
    if not _markers_are_special(chat.tokenizer):
        return  # the markers survive such a decode: a bare call is the model's own malformed text
    raise InteropError(
        f"{where}: field {field!r} has a tool call without its {CALL_OPEN} markers: the text was decoded with "
        f"skip_special_tokens=True and this tokenizer's {CALL_OPEN} is a special token, so calls and tool "
        "responses cannot be told from the answer (decode the rollouts with skip_special_tokens=False)"
    )


_USER_TURN = re.compile(r"(?:<\|im_start\|>)?user\n(.*?)(?:<\|im_end\|>|\n(?:<\|im_start\|>)?assistant\n|$)", re.S)


def rendered_question(text: str) -> str:
    """The last user message of a rendered prompt (verl's dump), or the whole text when it has none."""
    found = _USER_TURN.findall(text)
    return found[-1].strip("\n") if found else text


def without_left_padding(text: str, chat: ChatFormat) -> str:
    """A rendered prompt without the pad tokens verl's agent loop pads it with on the left (to the batch's prompt
    length): they are not the prompt the policy saw; a dump decoded with skip_special_tokens=False keeps them."""
    pad = getattr(chat.tokenizer, "pad_token", None)
    while pad and text.startswith(pad):
        text = text[len(pad) :]
    return text


def renders_special_tokens(text: str) -> bool:
    """Whether a rendered prompt kept its special tokens (then its ids are re-tokenized from it as it is; without
    them the prompt is rendered again from its question with the tokenizer's template)."""
    return IM_START in text


# ---- foreign ATIF with token ids --------------------------------------------------------------------------------


def atif_turns(traj, chat: ChatFormat | None, where: str) -> tuple[list[int] | None, list[Turn], bool, str | None]:
    """(prompt ids, turns, token-exact, last agent text) of a foreign ATIF trajectory: each agent step's sampled
    ids and log-probs; prompt and tool-response ids from prompt_token_ids that extend each other, else
    re-tokenized (not exact). Without ids on a step, the step is re-tokenized from its message (not exact)."""
    agents = [s for s in traj.steps if s.source == "agent"]
    exact = True
    prompt_ids = agents[0].metrics.prompt_token_ids if agents and agents[0].metrics else None
    turns: list[Turn] = []
    context = list(prompt_ids or [])
    for n, step in enumerate(agents):
        metrics = step.metrics
        ids = metrics.completion_token_ids if metrics else None
        message = step.message if isinstance(step.message, str) else ""
        code = None
        if step.tool_calls:
            call = one_call(step.tool_calls, f"{where}: step {step.step_id}")
            code = code_argument(call.arguments, call.function_name, f"{where}: step {step.step_id}")
        if ids is None:
            if chat is None:
                raise InteropError(
                    f"{where}: step {step.step_id} has no completion_token_ids; name the tokenizer "
                    "to re-tokenize its text (--tokenizer)"
                )
            exact = False
            body = message + (("\n" if message else "") + render_tool_call(code) if code is not None else "")
            ids = chat.encode(body + IM_END)
            lps = [0.0] * len(ids)
        else:
            lps = metrics.logprobs
            if lps is None or len(lps) != len(ids):
                exact = False
                lps = [0.0] * len(ids)
        results = step.observation.results if step.observation else []
        text = None
        explicit = None
        if results:
            text = "\n".join(r.content if isinstance(r.content, str) else "" for r in results)
            flags = [((r.extra or {}).get("error") or (r.extra or {}).get("is_error")) for r in results]
            explicit = True if any(f is True for f in flags) else None
        t = Turn(list(ids), [float(x) for x in lps], code, text)
        t.failed, t.error_label = failure_of(text, explicit)
        nxt = agents[n + 1].metrics.prompt_token_ids if n + 1 < len(agents) and agents[n + 1].metrics else None
        grown = context + t.ids
        if text is not None:
            if nxt is not None and prompt_ids is not None and nxt[: len(grown)] == grown:
                t.feedback_ids = list(nxt[len(grown) :])
            elif chat is not None:
                t.feedback_ids = chat.feedback_ids(text)
                exact = False
            else:
                raise InteropError(
                    f"{where}: step {step.step_id}: its tool response has no token ids (no "
                    "prompt_token_ids on the next step); name the tokenizer (--tokenizer)"
                )
        context = grown + t.feedback_ids
        turns.append(t)
    last = agents[-1].message if agents and isinstance(agents[-1].message, str) else None
    return prompt_ids, turns, exact and prompt_ids is not None, last


def check_tokenizer(doc: dict[str, Any], chat: ChatFormat, tokenizer: Path, where: str) -> None:
    """The named tokenizer must be the one the ids were sampled with: every id within its vocabulary, and the ids of
    the agent steps that carry a message decode to text that holds it."""
    size = len(chat.tokenizer)
    checked = matched = 0
    first_miss = None
    for step in doc.get("steps") or []:
        ids = (step.get("metrics") or {}).get("completion_token_ids")
        if not ids:
            continue
        big = max(ids)
        if min(ids) < 0:
            raise InteropError(f"{where}: step {step.get('step_id')}: completion_token_ids holds id {min(ids)} (< 0)")
        if big >= size:
            raise InteropError(
                f"{where}: step {step.get('step_id')}: completion_token_ids holds id {big}, beyond "
                f"the {size:,} ids of tokenizer {tokenizer}: it is not the tokenizer that sampled them"
            )
        message = step.get("message")
        if isinstance(message, str) and message.strip():
            checked += 1
            text = chat.decode(ids)
            if message.strip() in text:
                matched += 1
            elif first_miss is None:
                first_miss = (step.get("step_id"), text[:40], message.strip()[:40])
    if checked and not matched:
        step_id, got, want = first_miss
        raise InteropError(
            f"{where}: tokenizer {tokenizer} does not match the token ids: step {step_id}'s ids decode "
            f"to {got!r}…, its message says {want!r}…"
        )
