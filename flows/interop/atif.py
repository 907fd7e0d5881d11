"""ATIF (the Agent Trajectory Interchange Format, https://github.com/harbor-framework/harbor, rfcs/0001) from raw and
purified rows, through the `atif` package's pydantic models, and raw rows back from the ATIF cleaner wrote.

A raw row is one trajectory: a user step (the question), then one agent step per attempt in position order (its
sampled turn's ids and log-probs in `metrics.completion_token_ids` / `metrics.logprobs`, its call in `tool_calls`,
the tool's output in `observation` with the feedback turn's ids), then the final turn. What ATIF has no field for
sits under the `cleaner` key of an `extra`: the attempt index, the position and its outcome, the call boundary,
the error label and class, the context fingerprint, the similarity and splice kind SAAR decides at γ_live, and on
the trajectory the identity, SAAR settings, reward, statistics and the lived sequence as references into the
steps' token lists (literal only where it holds tokens no step has, e.g. a shallow splice's cut). Everything in a
raw row is there, so `raw_row` rebuilds it exactly (tests/test_import.py holds the round trip equal).

A purified row is one trajectory too: its response cut into sampled turns (agent steps) and tool responses (their
observations), each step with the partition's loss mask, old and behaviour log-probs and token origins, the
splices, and `extra.cleaner.raw_trajectory` naming the raw trajectory (id and file) it was purified from.
"""

from __future__ import annotations

import math
import re
from typing import Any, Callable

import numpy as np

from flows.interop.source import InteropError
from flows.interop.trl import assistant_text, response_runs, tool_text
from pipeline.chat import CODE_TOOL_SCHEMA, TOOL_NAME, parse_tool_call
from pipeline.trajectory import row_key

ATIF_VERSION = "ATIF-v1.8"
NEWEST = (1, 8)  # the newest ATIF version the installed `atif` package (1.8.x) models
TOKEN_IDS_SINCE = (1, 3)  # completion_token_ids and logprobs in step metrics
PROMPT_IDS_SINCE = (1, 4)  # prompt_token_ids
KEY = "cleaner"  # the namespace of everything cleaner puts in an `extra`
RAW_FORMAT, PURIFIED_FORMAT = "cleaner-raw/1", "cleaner-purified/1"
_VERSION = re.compile(r"^ATIF-v(\d+)\.(\d+)(\.\d+)?$")

Decode = Callable[[list[list[int]]], list[str]]


def parse_version(text: Any, where: str) -> tuple[int, int]:
    """(major, minor) of an ATIF schema_version this package reads; one line naming `where` otherwise."""
    m = _VERSION.match(text) if isinstance(text, str) else None
    if m is None or (int(m[1]), int(m[2])) > NEWEST or int(m[1]) != 1:
        raise InteropError(
            f"{where}: schema_version {text!r} is not an ATIF version cleaner reads (ATIF-v1.0 to {ATIF_VERSION})"
        )
    return int(m[1]), int(m[2])


def _f(values: Any) -> list[float]:
    return [float(v) for v in values]


def _finite(x: float | None) -> float | None:
    return None if x is None or (isinstance(x, float) and math.isnan(x)) else x


# ---- the lived sequence as references into the steps' token lists ---------------------------------------------

Piece = tuple[int, str, np.ndarray, np.ndarray, np.ndarray]  # step id, "turn"/"feedback", ids, mask, log-probs
MAX_CANDIDATES = 64  # places a token is tried at (a frequent token in a long trajectory has hundreds)


def encode_lived(ids: list[int], mask: list[int], logprobs: list[float], pieces: list[Piece]) -> list[Any]:
    """The lived sequence as [step_id, part, start, end] references to pieces whose ids, mask and log-probs it
    repeats, and {"ids", "mask", "logprobs"} literals for what no piece holds; greedy, longest match first.
    `decode_lived` inverts it exactly, whatever the greedy choice."""
    ids_a, mask_a = np.asarray(ids, np.int64), np.asarray(mask, np.int64)
    lps_a = np.asarray(logprobs, np.float32)
    # every piece's ids end to end, with the piece and offset of each: candidates are found by one vectorised scan
    flat = np.concatenate([p[2] for p in pieces]) if pieces else np.zeros(0, np.int64)
    owner = np.concatenate([np.full(len(p[2]), n) for n, p in enumerate(pieces)]) if pieces else flat
    offset_of = np.concatenate([np.arange(len(p[2])) for p in pieces]) if pieces else flat
    out: list[Any] = []
    c, total = 0, len(ids_a)
    while c < total:
        best, best_len = None, 0
        for at in np.flatnonzero(flat == ids_a[c])[:MAX_CANDIDATES].tolist():
            n, offset = int(owner[at]), int(offset_of[at])
            _, _, p_ids, p_mask, p_lps = pieces[n]
            k = min(len(p_ids) - offset, total - c)
            same = (
                (p_ids[offset : offset + k] == ids_a[c : c + k])
                & (p_mask[offset : offset + k] == mask_a[c : c + k])
                & (p_lps[offset : offset + k] == lps_a[c : c + k])
            )
            length = k if same.all() else int(np.argmin(same))
            if length > best_len:
                best, best_len = (n, offset), length
        if best is None:
            if not out or not isinstance(out[-1], dict):
                out.append({"ids": [], "mask": [], "logprobs": []})
            out[-1]["ids"].append(int(ids_a[c]))
            out[-1]["mask"].append(int(mask_a[c]))
            out[-1]["logprobs"].append(float(lps_a[c]))
            c += 1
            continue
        step_id, part = pieces[best[0]][0], pieces[best[0]][1]
        out.append([step_id, part, best[1], best[1] + best_len])
        c += best_len
    return out


def decode_lived(segments: list[Any], pieces: dict[tuple[int, str], Piece], where: str) -> tuple[list, list, list]:
    ids: list[int] = []
    mask: list[int] = []
    lps: list[float] = []
    for seg in segments:
        if isinstance(seg, dict):
            ids += seg["ids"]
            mask += seg["mask"]
            lps += seg["logprobs"]
            continue
        step_id, part, start, end = seg
        piece = pieces.get((step_id, part))
        if piece is None or end > len(piece[2]):
            raise InteropError(
                f"{where}: extra.cleaner.lived refers to step {step_id} {part} [{start}:{end}], "
                "which the trajectory does not hold"
            )
        ids += piece[2][start:end].tolist()
        mask += piece[3][start:end].tolist()
        lps += piece[4][start:end].tolist()
    return ids, mask, lps


def _piece(step_id: int, part: str, ids: list[int], logprobs: list[float] | None) -> Piece:
    arr = np.asarray(ids, np.int64)
    if part == "turn":
        return step_id, part, arr, np.ones(len(arr), np.int64), np.asarray(logprobs, np.float32)
    return step_id, part, arr, np.zeros(len(arr), np.int64), np.zeros(len(arr), np.float32)


# ---- raw rows -> ATIF ------------------------------------------------------------------------------------------

ATTEMPT_FIELDS = ("attempt_idx", "call_start", "call_status", "context_len", "context_fingerprint", "finish_reason")
RESULT_FIELDS = ("status", "error_label", "error_class", "exit_code", "duration_s", "timed_out")
RAW_FIELDS = (
    "run_id",
    "iteration",
    "prompt_id",
    "sample_idx",
    "policy_version",
    "seed",
    "task_source",
    "question",
    "ground_truth",
    "saar_gate",
    "gate_p",
    "live_mode",
    "gamma_live",
    "max_retries",
    "final_answer",
    "reward",
    "finish_reason",
    "stats",
    "reward_reason",
)


def agent_of(policy_version: str, checkpoint: str | None, version: str) -> dict[str, Any]:
    return {
        "name": "cleaner",
        "version": version,
        "model_name": policy_version,
        "tool_definitions": [CODE_TOOL_SCHEMA],
        "extra": {KEY: {"checkpoint": checkpoint}},
    }


def _attempt_step(
    step_id: int, a: dict[str, Any], text: str | None, extra: dict[str, Any], prompt_ids: list[int] | None
) -> dict[str, Any]:
    call_id = f"call-{step_id}"
    result = a["result"]
    attempt = {k: a[k] for k in ATTEMPT_FIELDS}
    attempt["result"] = None if result is None else {k: result[k] for k in RESULT_FIELDS}
    step: dict[str, Any] = {
        "step_id": step_id,
        "source": "agent",
        "message": "" if text is None else assistant_text(text),
        "metrics": {
            "prompt_tokens": a["context_len"],
            "completion_tokens": len(a["turn_ids"]),
            "completion_token_ids": list(a["turn_ids"]),
            "logprobs": _f(a["logprobs"]),
            **({"prompt_token_ids": list(prompt_ids)} if prompt_ids is not None else {}),
        },
        "extra": {KEY: {**extra, **attempt, "feedback_token_ids": list(a["feedback_ids"])}},
    }
    if a["code"] is not None:
        step["tool_calls"] = [
            {
                "tool_call_id": call_id,
                "function_name": TOOL_NAME,
                "arguments": {"code": a["code"]},
                "extra": {KEY: {"call_status": a["call_status"]}},
            }
        ]
    if result is not None:
        step["observation"] = {
            "results": [
                {
                    "source_call_id": call_id if a["code"] is not None else None,
                    "content": result["text"],
                    "extra": {
                        KEY: {
                            "status": result["status"],
                            "error_label": result["error_label"],
                            "error_class": result["error_class"],
                        }
                    },
                }
            ]
        }
    return step


def raw_trajectory(
    row: dict[str, Any],
    decode: Decode | None,
    agent: dict[str, Any],
    splices: dict[tuple[int, int], dict[str, Any]] | None = None,
    token_exact: bool = True,
) -> dict[str, Any]:
    """One raw row as an ATIF trajectory (a dict the `atif` models validate). `splices` maps (position, attempt)
    to the splice SAAR decides there at γ_live ({kind, similarity}), when known. `token_exact` False (a row of a
    re-tokenized import): recorded as `extra.cleaner.token_exact`, so importing it back keeps its shard's
    `token_exact: false`."""
    attempts = [(p["position_idx"], p["outcome"], a) for p in row["positions"] for a in p["attempts"]]
    final = row["final_turn"]
    turns = [a["turn_ids"][: a["call_start"]] if a["call_start"] >= 0 else a["turn_ids"] for _, _, a in attempts]
    texts = decode(turns + ([final["turn_ids"]] if final else [])) if decode else [None] * (len(turns) + bool(final))
    steps: list[dict[str, Any]] = [{"step_id": 1, "source": "user", "message": row["question"]}]
    pieces: list[Piece] = []
    for n, (pos, outcome, a) in enumerate(attempts):
        step_id = len(steps) + 1
        extra = {"position_idx": pos, "position_outcome": outcome}
        if a["attempt_idx"] > 0:
            extra["retry_of_step"] = step_id - 1
            extra.update((splices or {}).get((pos, a["attempt_idx"]), {}))
        steps.append(_attempt_step(step_id, a, texts[n], extra, row["prompt_ids"] if n == 0 else None))
        pieces += [
            _piece(step_id, "turn", a["turn_ids"], a["logprobs"]),
            _piece(step_id, "feedback", a["feedback_ids"], None),
        ]
    if final is not None:
        step_id = len(steps) + 1
        steps.append(
            _attempt_step(step_id, final, texts[-1], {"final_turn": True}, row["prompt_ids"] if not attempts else None)
        )
        pieces += [
            _piece(step_id, "turn", final["turn_ids"], final["logprobs"]),
            _piece(step_id, "feedback", final["feedback_ids"], None),
        ]
    fields = {k: row[k] for k in RAW_FIELDS}
    fields["final_answer"] = row["final_answer"]
    if not token_exact:
        fields["token_exact"] = False
    if len(steps) == 1:  # nothing sampled (a prompt too long): the prompt's ids have no agent step to sit on
        fields["prompt_token_ids"] = list(row["prompt_ids"])
    lived = encode_lived(row["lived_ids"], row["lived_mask"], row["lived_logprobs"], pieces)
    key = row_key(row["run_id"], row["iteration"], row["prompt_id"], row["sample_idx"])
    return {
        "schema_version": ATIF_VERSION,
        "session_id": row["run_id"],
        "trajectory_id": key,
        "agent": agent,
        "steps": steps,
        "extra": {KEY: {"format": RAW_FORMAT, **fields, "lived": lived}},
        "final_metrics": {"total_completion_tokens": row["stats"]["generated_tokens"], "total_steps": len(steps)},
    }


# ---- ATIF -> raw rows (what raw_trajectory wrote) ----------------------------------------------------------------


def is_cleaner_raw(doc: dict[str, Any]) -> bool:
    return ((doc.get("extra") or {}).get(KEY) or {}).get("format") == RAW_FORMAT


def raw_is_token_exact(doc: dict[str, Any]) -> bool:
    """Whether a trajectory `raw_trajectory` wrote holds the ids a policy sampled: not when it was exported from a
    re-tokenized import (an export from before this record was a cleaner run's own, or said nothing of it)."""
    return doc["extra"][KEY].get("token_exact") is not False


def raw_row(doc: dict[str, Any], run_id: str, where: str) -> dict[str, Any]:
    """The raw row a trajectory written by `raw_trajectory` holds, under run `run_id`; one line naming `where`
    and the field when one is missing."""
    try:
        return _raw_row(doc, run_id, where)
    except (KeyError, TypeError, ValueError) as e:
        raise InteropError(f"{where}: not a cleaner raw trajectory ({type(e).__name__}: {e})") from None


def _raw_row(doc: dict[str, Any], run_id: str, where: str) -> dict[str, Any]:
    meta = doc["extra"][KEY]
    row: dict[str, Any] = {k: meta.get(k) for k in RAW_FIELDS}
    row["run_id"] = run_id
    positions: dict[int, dict[str, Any]] = {}
    pieces: dict[tuple[int, str], Piece] = {}
    final = None
    prompt_ids = meta.get("prompt_token_ids")
    for step in doc["steps"][1:]:
        x, metrics = step["extra"][KEY], step["metrics"]
        result = x.get("result")
        obs = (step.get("observation") or {}).get("results") or []
        if result is not None:
            result = {**{k: result.get(k) for k in RESULT_FIELDS}, "text": obs[0].get("content") if obs else ""}
        calls = step.get("tool_calls") or []
        attempt = {
            **{k: x.get(k) for k in ATTEMPT_FIELDS},
            "turn_ids": list(metrics["completion_token_ids"]),
            "logprobs": _f(metrics["logprobs"]),
            "code": calls[0]["arguments"]["code"] if calls else None,
            "result": result,
            "feedback_ids": list(x["feedback_token_ids"]),
        }
        if prompt_ids is None:
            prompt_ids = metrics.get("prompt_token_ids")
        pieces[(step["step_id"], "turn")] = _piece(step["step_id"], "turn", attempt["turn_ids"], attempt["logprobs"])
        pieces[(step["step_id"], "feedback")] = _piece(step["step_id"], "feedback", attempt["feedback_ids"], None)
        if x.get("final_turn"):
            final = attempt
            continue
        pos = positions.setdefault(
            x["position_idx"], {"position_idx": x["position_idx"], "attempts": [], "outcome": x["position_outcome"]}
        )
        pos["attempts"].append(attempt)
    if prompt_ids is None:
        raise InteropError(f"{where}: no prompt_token_ids (neither on the first agent step nor in extra.cleaner)")
    row["prompt_ids"] = list(prompt_ids)
    row["positions"] = [positions[k] for k in sorted(positions)]
    row["final_turn"] = final
    row["lived_ids"], row["lived_mask"], row["lived_logprobs"] = decode_lived(meta["lived"], pieces, where)
    return row


# ---- purified rows -> ATIF ---------------------------------------------------------------------------------------


def purified_trajectory(
    row: dict[str, Any], question: str, decode: Decode | None, agent: dict[str, Any], partition: str, raw_file: str
) -> dict[str, Any]:
    """One purified row as an ATIF trajectory pointing at the raw trajectory it was purified from."""
    runs = response_runs(row["token_origin"], row["loss_mask"])
    ids = row["response_ids"]
    texts = decode([ids[s:e] for s, e, _ in runs]) if decode and runs else [None] * len(runs)
    steps: list[dict[str, Any]] = [{"step_id": 1, "source": "user", "message": question}]
    columns = ("loss_mask", "old_logprobs", "logprob_valid", "token_origin")
    splices = [{k: _finite(v) for k, v in s.items()} for s in row["splices"]]
    for (start, end, sampled), text in zip(runs, texts):
        cut = {c: (row[c] or [])[start:end] for c in columns}
        if not sampled and len(steps) > 1:  # a tool response: the observation of the turn before it
            last = steps[-1]
            last["observation"] = {
                "results": [
                    {
                        "source_call_id": (last.get("tool_calls") or [{}])[0].get("tool_call_id"),
                        "content": "" if text is None else tool_text(text),
                        "extra": {KEY: {"token_ids": ids[start:end], "response_start": start, **cut}},
                    }
                ]
            }
            continue
        step_id = len(steps) + 1
        step: dict[str, Any] = {
            "step_id": step_id,
            "source": "agent",
            "message": "" if text is None else assistant_text(text),
            "metrics": {
                "completion_tokens": end - start,
                "completion_token_ids": ids[start:end],
                "logprobs": _f((row["behaviour_logprobs"] or row["old_logprobs"])[start:end]),
                **({"prompt_token_ids": list(row["prompt_ids"])} if step_id == 2 else {}),
            },
            "extra": {
                KEY: {
                    "response_start": start,
                    **cut,
                    "sampled": sampled,
                    "splices": [s for s in splices if start <= s["first_recomputed"] < end],
                }
            },
        }
        if text is not None:
            call = parse_tool_call(text)
            if call.code is not None:
                step["tool_calls"] = [
                    {"tool_call_id": f"call-{step_id}", "function_name": TOOL_NAME, "arguments": {"code": call.code}}
                ]
        steps.append(step)
    meta = {
        k: _finite(row[k]) if isinstance(row[k], float) else row[k]
        for k in (
            "run_id",
            "iteration",
            "prompt_id",
            "sample_idx",
            "mode",
            "gamma",
            "is_threshold",
            "reward",
            "advantage",
            "recompute_from",
            "tokens_forwarded",
            "gate",
        )
    }
    return {
        "schema_version": ATIF_VERSION,
        "session_id": row["run_id"],
        "trajectory_id": f"{row['raw_key']}@{partition}",
        "agent": agent,
        "steps": steps,
        "extra": {
            KEY: {
                "format": PURIFIED_FORMAT,
                "partition": partition,
                **meta,
                "splices": splices,
                "raw_trajectory": {"trajectory_id": row["raw_key"], "path": raw_file},
            }
        },
        "final_metrics": {"total_completion_tokens": sum(row["loss_mask"]), "total_steps": len(steps)},
    }
