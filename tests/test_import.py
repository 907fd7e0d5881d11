"""`cleaner import` (issue 45 §2, §3): ATIF, TRL completions and verl rollout dumps into raw shards of a run of their
own. The round trip: a real run of the tiny policy exported to ATIF and imported as a new run has the same raw rows
and purifies to the same partition. Foreign sources: a failed call followed by the next call is an in-context
retry; text is re-tokenized, marked token_exact: false, and not purified unless the import allowed it. Bad input
gets one line naming the file, line or field, and nothing is written."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from pipeline.variants import plan_variants
from tests.flow_helpers import refused

QUESTION = "What is 6 * 7?"
FAILED = "Tool call failure\nreason: SyntaxError: '(' was never closed"
OK = "Tool call success\nstdout: 42"


def _rows(root: Path, run_id: str, iteration: int = 0) -> list[dict]:
    from storage.layout import RunLayout
    from storage.schemas import RAW
    from storage.shards import read_shard

    return sorted(
        read_shard(RunLayout(root, run_id).raw_dir(iteration), RAW).to_pylist(),
        key=lambda r: (r["prompt_id"], r["sample_idx"]),
    )


def _partition(root: Path, run_id: str) -> list[dict]:
    from storage.layout import RunLayout
    from storage.schemas import PURIFIED
    from storage.shards import read_shard

    rows = read_shard(RunLayout(root, run_id).purified_dir(0, "saar", 0.5), PURIFIED).to_pylist()
    for r in rows:  # the run's name is all that differs
        assert r.pop("run_id") == run_id and r.pop("raw_key").startswith(f"{run_id}/0/")
    return sorted(rows, key=lambda r: (r["prompt_id"], r["sample_idx"]))


def _store(tmp_path: Path, like=None):
    from pipeline.config import load_config

    if like is None:
        return load_config(None, [f"storage.root={tmp_path / 'ws'}"])
    cfg = like.model_copy(deep=True)
    cfg.storage.root = tmp_path / "ws"
    return cfg


def test_atif_round_trip_gives_the_same_raw_rows_and_partitions(purified_run, tmp_path, capsys):
    from flows.export_cmd import run_export
    from flows.import_cmd import run_import
    from pipeline.config import DEFAULT_POLICY
    from purifier.stage import run_purify_stage
    from storage.layout import RunLayout, resolve_recorded
    from storage.shards import read_manifest

    out = tmp_path / "atif"
    run_export(purified_run, "w", None, None, "atif", out)
    cfg = _store(tmp_path, purified_run)
    done = run_import(cfg, [out / "raw" / "iteration-0000.jsonl"], "atif", "copy")
    assert done.iterations == {0: "written"} and done.token_exact

    original, imported = _rows(purified_run.storage.root, "w"), _rows(cfg.storage.root, "copy")
    assert len(imported) == len(original) > 0
    for r in imported:
        assert r["run_id"] == "copy"
        r["run_id"] = "w"
    assert imported == original  # ids, masks, log-probs, positions and attempts, outcomes, rewards, statistics

    raw_dir = RunLayout(cfg.storage.root, "copy").raw_dir(0)
    manifest = read_manifest(raw_dir)
    assert manifest.extra["source_format"] == "atif" and manifest.extra["token_exact"] is True
    assert resolve_recorded(cfg.storage.root, manifest.inputs[0]).resolve() == Path(DEFAULT_POLICY).resolve()

    run_purify_stage(cfg, "copy", 0, plan_variants(cfg, ["saar"], [0.5]))
    assert _partition(cfg.storage.root, "copy") == _partition(purified_run.storage.root, "w")  # decisions too

    from flows.cli import main  # the imported run is a run like any other to the catalog

    capsys.readouterr()
    assert (
        main(
            [
                "inspect",
                f"storage.root={cfg.storage.root}",
                "--sql",
                "SELECT count(*) AS n, sum(stats.retries) AS r FROM raw_trajectories WHERE run_id = 'copy'",
            ]
        )
        == 0
    )
    shown = capsys.readouterr().out
    assert str(len(original)) in shown and str(sum(r["stats"]["retries"] for r in original)) in shown

    # the tokenizer that sampled them passes the check that the ids are its own
    assert run_import(
        cfg, [out / "raw" / "iteration-0000.jsonl"], "atif", "checked", tokenizer=DEFAULT_POLICY
    ).rows == len(original)

    again = run_import(cfg, [out / "raw" / "iteration-0000.jsonl"], "atif", "copy")  # a rerun: nothing rewritten
    assert again.iterations == {0: "already imported"}
    assert read_manifest(raw_dir).created_at == manifest.created_at


def trl_row(**fields) -> dict:
    """A TRL prompt-completion row: a call that fails, its retry (arguments as a JSON string, as OpenAI's API writes
    them), the answer; `fields` added (e.g. its reward)."""
    call = {"type": "function", "function": {"name": "code_interpreter", "arguments": {"code": "print(6 * 7"}}}
    fixed = {
        "type": "function",
        "function": {"name": "code_interpreter", "arguments": json.dumps({"code": "print(6*7)"})},
    }
    return {
        "prompt": [{"role": "user", "content": QUESTION}],
        "ground_truth": "42",
        "completion": [
            {"role": "assistant", "content": "Let me compute.", "tool_calls": [call]},
            {"role": "tool", "content": FAILED},
            {"role": "assistant", "content": "", "tool_calls": [fixed]},
            {"role": "tool", "content": OK},
            {"role": "assistant", "content": "The answer is \\boxed{42}."},
        ],
        **fields,
    }


def _foreign_atif(chat, version: str = "ATIF-v1.4") -> tuple[dict, tuple[list[int], ...]]:
    """A trajectory another framework logged (ATIF v1.4: ids, log-probs and each step's prompt ids): a call that
    fails, its retry, the answer."""
    from pipeline.chat import IM_END, render_tool_call

    prompt = chat.prompt_ids(QUESTION)
    t1 = chat.encode("Let me compute.\n" + render_tool_call("print(6 * 7") + IM_END)
    t2 = chat.encode(render_tool_call("print(6 * 7)") + IM_END)
    t3 = chat.encode("The answer is \\boxed{42}." + IM_END)
    f1, f2 = chat.feedback_ids(FAILED), chat.feedback_ids(OK)

    def agent(step_id, context, ids, message, code=None, result=None):
        step = {
            "step_id": step_id,
            "source": "agent",
            "message": message,
            "metrics": {
                "prompt_token_ids": context,
                "completion_token_ids": ids,
                "logprobs": [-0.25 - 0.5 * (i % 3) for i in range(len(ids))],
            },
        }
        if code is not None:
            step["tool_calls"] = [
                {"tool_call_id": f"c{step_id}", "function_name": "code_interpreter", "arguments": {"code": code}}
            ]
            step["observation"] = {"results": [{"source_call_id": f"c{step_id}", "content": result}]}
        return step

    return {
        "schema_version": version,
        "agent": {"name": "other-rl", "version": "0.3", "model_name": "tiny"},
        "steps": [
            {"step_id": 1, "source": "user", "message": QUESTION},
            agent(2, prompt, t1, "Let me compute.", "print(6 * 7", FAILED),
            agent(3, prompt + t1 + f1, t2, "", "print(6 * 7)", OK),
            agent(4, prompt + t1 + f1 + t2 + f2, t3, "The answer is \\boxed{42}."),
        ],
        "extra": {"reward": 1.0, "ground_truth": "42", "data_source": "arith"},
    }, (prompt, t1, f1, t2, f2, t3)


def test_foreign_atif_imports_exactly_with_its_retry(chat, tmp_path):
    from flows.import_cmd import run_import
    from pipeline.config import DEFAULT_POLICY

    doc, (prompt, t1, f1, t2, f2, t3) = _foreign_atif(chat)
    path = tmp_path / "other.jsonl"
    path.write_text(json.dumps(doc) + "\n")
    cfg = _store(tmp_path)
    done = run_import(cfg, [path], "atif", "foreign", tokenizer=DEFAULT_POLICY)
    assert done.token_exact
    [row] = _rows(cfg.storage.root, "foreign")
    assert row["prompt_ids"] == prompt and row["lived_ids"] == t1 + f1 + t2 + f2 + t3
    assert row["lived_mask"] == [1] * len(t1) + [0] * len(f1) + [1] * len(t2) + [0] * len(f2) + [1] * len(t3)
    [position] = row["positions"]
    assert position["outcome"] == "recovered" and [a["attempt_idx"] for a in position["attempts"]] == [0, 1]
    failed, retry = position["attempts"]
    assert failed["result"]["status"] == "failure" and failed["result"]["error_label"] == "SyntaxError"
    assert failed["feedback_ids"] == f1 and retry["code"] == "print(6 * 7)" and retry["call_start"] >= 0
    assert retry["logprobs"] == doc["steps"][2]["metrics"]["logprobs"]
    assert row["final_turn"]["turn_ids"] == t3 and row["final_answer"] == "42" and row["reward"] == 1.0
    assert row["stats"]["retries"] == 1 and row["stats"]["recovered"] == 1

    # ATIF v1.3: ids and log-probs of the sampled turns, no prompt ids: the prompt and tool responses are
    # re-tokenized, and the import says it is not token-exact
    older = json.loads(json.dumps(doc))
    older["schema_version"] = "ATIF-v1.3"
    for step in older["steps"][1:]:
        del step["metrics"]["prompt_token_ids"]
    path.write_text(json.dumps(older) + "\n")
    assert not run_import(cfg, [path], "atif", "older", tokenizer=DEFAULT_POLICY).token_exact
    [again] = _rows(cfg.storage.root, "older")
    assert again["lived_ids"] == row["lived_ids"] and again["prompt_ids"] == prompt  # the same template renders
    assert again["positions"][0]["attempts"][1]["logprobs"] == retry["logprobs"]


def test_text_sources_are_retokenized_and_not_purified_unless_allowed(chat, tmp_path, capsys):
    """TRL completions and verl's rollout dump: re-tokenized with the named tokenizer, the retry found in context,
    marked token_exact: false; purify refuses them in one line, unless imported with --allow-purify; filter reads
    them through the catalog."""
    from flows.filter_cmd import pass_rates
    from flows.import_cmd import run_import
    from pipeline.chat import IM_END, IM_START, render_tool_call
    from pipeline.config import DEFAULT_POLICY
    from purifier.stage import run_purify_stage
    from storage.layout import RunLayout
    from storage.shards import ShardError, read_manifest

    trl = tmp_path / "trl.jsonl"
    trl.write_text(json.dumps(trl_row(reward=1.0)) + "\n")
    cfg = _store(tmp_path)
    done = run_import(cfg, [trl], "trl-completions", "from-trl", tokenizer=DEFAULT_POLICY)
    assert not done.token_exact
    [row] = _rows(cfg.storage.root, "from-trl")
    [position] = row["positions"]
    assert position["outcome"] == "recovered" and [a["code"] for a in position["attempts"]] == [
        "print(6 * 7",
        "print(6*7)",
    ]
    assert chat.decode(row["lived_ids"]).count("<tool_response>") == 2 and row["final_answer"] == "42"
    assert row["prompt_ids"] == chat.prompt_ids(QUESTION)  # no system message given: cleaner's own
    raw_dir = RunLayout(cfg.storage.root, "from-trl").raw_dir(0)
    assert read_manifest(raw_dir).extra["token_exact"] is False
    with pytest.raises(ShardError, match="token_exact: false") as e:
        run_purify_stage(cfg, "from-trl", 0, plan_variants(cfg, ["saar"], [0.5]))
    assert "\n" not in str(e.value) and "--allow-purify" in str(e.value)
    assert [r["prompt_id"] for r in pass_rates(cfg.storage.root, "from-trl")] == [row["prompt_id"]]

    rendered = chat.tokenizer.apply_chat_template(
        [{"role": "user", "content": QUESTION}], tokenize=False, add_generation_prompt=True
    )
    frame = f"{IM_END}\n{IM_START}user\n<tool_response>\n"
    output = (
        f"Let me compute.\n{render_tool_call('print(6 * 7')}{frame}{FAILED}\n</tool_response>{IM_END}\n"
        f"{IM_START}assistant\n{render_tool_call('print(6 * 7)')}{frame}{OK}\n</tool_response>{IM_END}\n"
        f"{IM_START}assistant\nThe answer is \\boxed{{42}}.{IM_END}"
    )
    verl = tmp_path / "verl.jsonl"
    # verl decodes its dump without special tokens by default: the second line is the same rollout so
    skipped = {
        "input": rendered.replace(IM_START, "").replace(IM_END, ""),
        "output": output.replace(IM_START, "").replace(IM_END, ""),
        "gts": "42",
        "score": 1.0,
        "step": 3,
    }
    verl.write_text(
        json.dumps({"input": rendered, "output": output, "gts": "42", "score": 1.0, "step": 3})
        + "\n"
        + json.dumps(skipped)
        + "\n"
    )
    run_import(cfg, [verl], "verl-jsonl", "from-verl", tokenizer=DEFAULT_POLICY, allow_purify=True)
    row, plain = _rows(cfg.storage.root, "from-verl")
    assert row["prompt_ids"] == chat.encode(rendered) and row["question"] == plain["question"] == QUESTION
    [position] = row["positions"]
    assert position["outcome"] == "recovered" and position["attempts"][0]["result"]["text"] == FAILED
    turns = [[(a["turn_ids"], a["code"], a["feedback_ids"]) for a in p["attempts"]] for p in row["positions"]]
    assert plain["lived_ids"] == row["lived_ids"] and turns == [
        [(a["turn_ids"], a["code"], a["feedback_ids"]) for a in p["attempts"]] for p in plain["positions"]
    ]
    assert plain["prompt_ids"] == chat.prompt_ids(QUESTION)  # rendered again: the text lost its special tokens
    [result] = run_purify_stage(cfg, "from-verl", 0, plan_variants(cfg, ["saar"], [0.5]))  # allowed: purified
    assert result.rows == 2


def test_a_verl_dump_that_lost_its_tool_markup_is_refused(chat, tmp_path, capsys):
    """verl decodes its dump with skip_special_tokens=True. Qwen3's <tool_call> and <tool_response> are not special
    tokens, so its calls survive (imported as calls); the tiny policy's are, so the dump keeps the calls' JSON but
    not their markers, and the import took each rollout as one answer with no call. Now: one line naming the file,
    the line and what to dump instead, and nothing written."""
    from flows.import_cmd import run_import
    from pipeline.chat import IM_END, IM_START, load_chat, render_tool_call
    from pipeline.config import DEFAULT_POLICY
    from storage.layout import RunLayout

    frame = f"{IM_END}\n{IM_START}user\n<tool_response>\n"
    lived = (
        f"Let me compute.\n{render_tool_call('print(6 * 7')}{frame}{FAILED}\n</tool_response>{IM_END}\n"
        f"{IM_START}assistant\n{render_tool_call('print(6 * 7)')}{frame}{OK}\n</tool_response>{IM_END}\n"
        f"{IM_START}assistant\nThe answer is \\boxed{{42}}.{IM_END}"
    )

    def dump(tokenizer: Path, name: str) -> Path:
        c = load_chat(tokenizer)
        prompt = c.tokenizer.apply_chat_template(
            [{"role": "user", "content": QUESTION}], tokenize=False, add_generation_prompt=True
        )
        decoded = {  # as verl's dump decodes them
            "input": c.tokenizer.decode(c.encode(prompt), skip_special_tokens=True),
            "output": c.tokenizer.decode(c.encode(lived), skip_special_tokens=True),
            "gts": "42",
            "score": 1.0,
            "step": 1,
        }
        path = tmp_path / name
        path.write_text(json.dumps({**decoded, "output": "The answer is \\boxed{42}."}) + "\n" + json.dumps(decoded))
        return path

    qwen3 = Path(__file__).resolve().parent.parent / "policies" / "qwen3-tokenizer"
    cfg = _store(tmp_path)
    run_import(cfg, [dump(qwen3, "qwen3.jsonl")], "verl-jsonl", "kept", tokenizer=qwen3)
    called = [r for r in _rows(cfg.storage.root, "kept") if r["positions"]]
    assert len(called) == 1 and [a["code"] for a in called[0]["positions"][0]["attempts"]] == [
        "print(6 * 7",
        "print(6 * 7)",
    ]

    path = dump(DEFAULT_POLICY, "tiny.jsonl")
    root = tmp_path / "ws2"
    base = ["import", "--run", "lost", f"storage.root={root}", "--format", "verl-jsonl"]
    refused(
        [*base, str(path), "--tokenizer", str(DEFAULT_POLICY)],
        capsys,
        2,
        f"{path}: line 2",
        "field 'output'",
        "<tool_call>",
        "skip_special_tokens=False",
    )
    trl = tmp_path / "trl.jsonl"  # TRL's GRPOTrainer decodes its completions the same way
    decoded = chat.tokenizer.decode(
        chat.encode(f"Let me compute.\n{render_tool_call('print(6*7)')}"), skip_special_tokens=True
    )
    trl.write_text(json.dumps({"prompt": QUESTION, "completion": decoded, "reward": 0.0}) + "\n")
    refused(
        [*base[:-1], "trl-completions", str(trl), "--tokenizer", str(DEFAULT_POLICY)],
        capsys,
        2,
        f"{trl}: line 1",
        "field 'completion'",
        "skip_special_tokens=False",
    )
    raw = RunLayout(root, "lost").raw_dir(0)
    assert not raw.exists() or not any(raw.iterdir())


def test_bad_input_is_one_line_and_writes_nothing(chat, tmp_path, capsys):
    from storage.layout import RunLayout
    from pipeline.config import DEFAULT_POLICY

    root = tmp_path / "ws"
    doc, _ = _foreign_atif(chat)
    base = ["import", "--run", "bad", f"storage.root={root}", "--format"]

    def lines(name: str, *items: object) -> str:
        path = tmp_path / name
        path.write_text("".join((i if isinstance(i, str) else json.dumps(i)) + "\n" for i in items))
        return str(path)

    path = lines("future.jsonl", doc, {**doc, "schema_version": "ATIF-v2.0"})
    refused([*base, "atif", path], capsys, 2, f"{path}: line 2", "ATIF-v2.0")
    path = lines("nine.jsonl", {**doc, "schema_version": "ATIF-v1.9"})
    refused([*base, "atif", path], capsys, 2, f"{path}: line 1", "ATIF-v1.9")
    broken = json.loads(json.dumps(doc))
    broken["steps"][2]["step_id"] = 7
    path = lines("broken.jsonl", doc, broken)
    refused([*base, "atif", path], capsys, 2, f"{path}: line 2", "invalid ATIF", "steps")
    path = lines("list.jsonl", "[1, 2]")
    refused([*base, "atif", path], capsys, 2, f"{path}: line 1", "not a JSON object")
    path = lines("verl.jsonl", {"input": "q", "output": "a", "score": 1.0}, '"just text"')
    refused(
        [*base, "verl-jsonl", path, "--tokenizer", str(DEFAULT_POLICY)],
        capsys,
        2,
        f"{path}: line 2",
        "not a JSON object",
    )
    path = lines("trl.jsonl", {"prompt": QUESTION})
    refused(
        [*base, "trl-completions", path, "--tokenizer", str(DEFAULT_POLICY)],
        capsys,
        2,
        f"{path}: line 1",
        "'completion'",
    )
    refused([*base, "trl-completions", path], capsys, 2, f"{path}: line 1", "--tokenizer")
    path = lines("other.jsonl", doc)
    qwen3 = Path(__file__).resolve().parent.parent / "policies" / "qwen3-tokenizer"
    refused(
        [*base, "atif", path, "--tokenizer", str(qwen3)], capsys, 2, f"{path}: line 1", "does not match the token ids"
    )
    raw = RunLayout(root, "bad").raw_dir(0)
    assert not raw.exists() or not any(raw.iterdir())  # nothing half-written


def test_an_import_never_overwrites_another_one(chat, tmp_path, capsys):
    from flows.import_cmd import run_import
    from flows.interop.source import InteropError
    from pipeline.config import DEFAULT_POLICY

    doc, _ = _foreign_atif(chat)
    first, second = tmp_path / "a.jsonl", tmp_path / "b.jsonl"
    first.write_text(json.dumps(doc) + "\n")
    second.write_text(json.dumps({**doc, "extra": {"reward": 0.0}}) + "\n")
    cfg = _store(tmp_path)
    run_import(cfg, [first], "atif", "r", tokenizer=DEFAULT_POLICY)
    with pytest.raises(InteropError, match="other files or settings"):
        run_import(cfg, [second], "atif", "r", tokenizer=DEFAULT_POLICY)
    assert [r["reward"] for r in _rows(cfg.storage.root, "r")] == [1.0]

    # cleaner's own trajectories keep their ids: one named twice is refused (two samples of another framework are
    # two samples)
    from flows.interop.atif import agent_of, raw_trajectory
    from pipeline.trajectory import trajectory_to_row
    from tests.synthetic import synthetic_trajectories

    ours = tmp_path / "ours.jsonl"
    ours.write_text(
        "".join(
            json.dumps(raw_trajectory(trajectory_to_row(t), None, agent_of("v", None, "test"))) + "\n"
            for t in synthetic_trajectories(3)
        )
    )
    with pytest.raises(InteropError, match="ours.jsonl: named twice"):  # before any row: a verl or TRL file too
        run_import(cfg, [ours, ours], "atif", "r2")
    copy = tmp_path / "copy.jsonl"
    copy.write_text(ours.read_text())
    with pytest.raises(InteropError, match="already imported from .*ours.jsonl: line 1"):
        run_import(cfg, [ours, copy], "atif", "r2")
    assert run_import(cfg, [ours], "atif", "r3").rows == 3


def _ours(tmp_path, name: str, checkpoints: dict[int, str | None], n: int = 2) -> Path:
    """cleaner's own ATIF of `n` synthetic raw rows per iteration, each iteration naming its checkpoint."""
    from flows.interop.atif import agent_of, raw_trajectory
    from pipeline.trajectory import trajectory_to_row
    from tests.synthetic import synthetic_trajectories

    docs = []
    for it, checkpoint in checkpoints.items():
        for t in synthetic_trajectories(n):
            row = trajectory_to_row(t)
            row["iteration"] = it
            docs.append(raw_trajectory(row, None, agent_of(f"v{it}", checkpoint, "test")))
    path = tmp_path / name
    path.write_text("".join(json.dumps(d) + "\n" for d in docs))
    return path


def test_several_files_on_the_command_line_are_all_imported(chat, tmp_path, capsys):
    """`cleaner import --format atif a.jsonl b.jsonl --run R` (docs/formats.md's example): argparse gave every file
    but the last to the KEY=VALUE positional, which refused the first as an override."""
    from flows.cli import main
    from pipeline.config import DEFAULT_POLICY

    doc, _ = _foreign_atif(chat)
    a, b = tmp_path / "a.jsonl", tmp_path / "b.jsonl"
    a.write_text(json.dumps(doc) + "\n")
    b.write_text(json.dumps({**doc, "extra": {**doc["extra"], "reward": 0.0}}) + "\n")
    root = tmp_path / "ws"
    argv = ["import", "--format", "atif", str(a), str(b), "--run", "two", "--tokenizer", str(DEFAULT_POLICY)]
    assert main([*argv, f"storage.root={root}"]) == 0, capsys.readouterr().err
    assert "imported 2 trajectories" in capsys.readouterr().out
    assert sorted(r["reward"] for r in _rows(root, "two")) == [0.0, 1.0]


def test_each_iteration_records_the_checkpoint_that_sampled_it(tmp_path):
    """A file of several iterations recorded iteration 0's checkpoint for all of them, so replay recomputed later
    iterations with the wrong policy. Two checkpoints named in one iteration are refused."""
    import shutil

    from flows.import_cmd import run_import
    from flows.interop.source import InteropError
    from pipeline.config import DEFAULT_POLICY
    from storage.layout import RunLayout, resolve_recorded
    from storage.shards import read_manifest

    later = tmp_path / "later-policy"
    shutil.copytree(DEFAULT_POLICY, later)
    path = _ours(tmp_path, "two.jsonl", {0: str(DEFAULT_POLICY), 1: str(later)})
    cfg = _store(tmp_path)
    assert run_import(cfg, [path], "atif", "both").iterations == {0: "written", 1: "written"}
    layout = RunLayout(cfg.storage.root, "both")
    for it, want in ((0, DEFAULT_POLICY), (1, later)):
        (recorded,) = read_manifest(layout.raw_dir(it)).inputs
        assert resolve_recorded(cfg.storage.root, recorded).resolve() == Path(want).resolve()
    with pytest.raises(InteropError, match="iteration is sampled by one policy"):
        run_import(cfg, [path], "atif", "forced", iteration=3)
    assert not RunLayout(cfg.storage.root, "forced").raw_dir(3).exists()


def test_rows_that_would_break_later_stages_are_refused_in_one_line(chat, tmp_path, capsys):
    """Each was stored and crashed replay, purify or the viewer later (a traceback), or was stored as something it
    never was; now one line naming the file and line, and nothing written."""
    from pipeline.config import DEFAULT_POLICY
    from storage.layout import RunLayout

    root = tmp_path / "ws"
    doc, _ = _foreign_atif(chat)
    tok = ["--tokenizer", str(DEFAULT_POLICY)]

    def lines(name: str, *items: object) -> str:
        path = tmp_path / name
        path.write_text("".join(json.dumps(i) + "\n" for i in items))
        return str(path)

    def refuse(fmt: str, path: str, *words: str, extra: tuple[str, ...] = ()) -> None:
        refused(["import", "--run", "bad", f"storage.root={root}", "--format", fmt, path, *extra], capsys, 2, *words)

    ours = json.loads(_ours(tmp_path, "ours.jsonl", {0: str(DEFAULT_POLICY)}, n=1).read_text())
    no_reward = json.loads(json.dumps(ours))
    del no_reward["extra"]["cleaner"]["reward"]
    refuse("atif", lines("no-reward.jsonl", no_reward), "line 1", "reward is missing")
    word = json.loads(json.dumps(ours))
    word["extra"]["cleaner"]["iteration"] = "zero"
    refuse("atif", lines("word.jsonl", word), "line 1", "iteration is 'zero'")
    big = json.loads(json.dumps(ours))  # no --tokenizer: the checkpoint it names has 1,024 ids
    big["steps"][1]["metrics"]["completion_token_ids"][0] = 10_000_000
    refuse("atif", lines("big.jsonl", big), "line 1", "id 10000000", "1,024 ids")
    negative = json.loads(json.dumps(doc))
    negative["steps"][1]["metrics"]["completion_token_ids"][0] = -5
    refuse("atif", lines("negative.jsonl", negative), "line 1", "id -5", extra=tuple(tok))
    twice = {**doc, "trajectory_id": "t-1"}
    refuse("atif", lines("twice.jsonl", twice, twice), "line 2", "trajectory_id 't-1'", "line 1", extra=tuple(tok))
    search = {"type": "function", "function": {"name": "web_search", "arguments": {"query": "world cup"}}}
    completion = [{"role": "assistant", "content": "", "tool_calls": [search]}, {"role": "tool", "content": "x"}]
    path = lines("search.jsonl", {"prompt": QUESTION, "completion": completion, "reward": 0.0})
    refuse("trl-completions", path, "line 1", "'web_search'", "no `code`", extra=tuple(tok))
    call = {"type": "function", "function": {"name": "code_interpreter", "arguments": {"code": "print(1)"}}}
    completion = [{"role": "assistant", "content": "", "tool_calls": [call, call]}, {"role": "tool", "content": "1"}]
    path = lines("parallel.jsonl", {"prompt": QUESTION, "completion": completion, "reward": 0.0})
    refuse("trl-completions", path, "line 1", "2 tool calls in one message", extra=tuple(tok))
    nan = lines("nan.jsonl", {"input": QUESTION, "output": "\\boxed{42}", "score": float("nan")})
    refuse("verl-jsonl", nan, "line 1", "reward is nan", extra=tuple(tok))
    raw = RunLayout(root, "bad").raw_dir(0)
    assert not raw.exists() or not any(raw.iterdir())

    # a training run's next iteration is its own rollout: resuming it would find an import there
    RunLayout(root, "trained").run_dir.mkdir(parents=True)
    RunLayout(root, "trained").run_json.write_text("{}")
    ok = lines("ok.jsonl", doc)
    argv = ["import", "--run", "trained", f"storage.root={root}", "--format", "atif", ok, *tok]
    refused(argv, capsys, 2, "training run", "new --run")
    with pytest.raises(SystemExit):
        from flows.cli import main

        main(["import", "--run", "x", "--iteration", "-1", "--format", "atif", ok, f"storage.root={root}"])
    assert "0 or more" in capsys.readouterr().err


def test_an_import_says_how_many_rows_run_past_the_policys_context(tmp_path, capsys):
    """Imported rows are not bounded by cleaner's rollout settings: one longer than the sampling checkpoint's
    max_position_embeddings was imported and trained without a word. Counted in the manifest and said."""
    import shutil

    from flows.cli import main
    from pipeline.config import DEFAULT_POLICY
    from storage.layout import RunLayout
    from storage.shards import read_manifest

    policy = tmp_path / "short"
    shutil.copytree(DEFAULT_POLICY, policy)
    config = json.loads((policy / "config.json").read_text())
    (policy / "config.json").write_text(json.dumps({**config, "max_position_embeddings": 96}))
    rows = [
        {"prompt": QUESTION, "completion": "The answer is \\boxed{42}.", "reward": 1.0},
        {"prompt": QUESTION, "completion": "Let me think. " * 40 + "The answer is \\boxed{42}.", "reward": 1.0},
    ]
    path = tmp_path / "trl.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    root = tmp_path / "ws"
    capsys.readouterr()
    argv = ["import", "--run", "long", f"storage.root={root}", "--format", "trl-completions", str(path)]
    assert main([*argv, "--tokenizer", str(policy)]) == 0
    out = capsys.readouterr().out
    assert read_manifest(RunLayout(root, "long").raw_dir(0)).extra["past_max_positions"] == 1
    assert "1 trajectory runs past the policy's max_position_embeddings (96)" in out, out
