"""`cleaner export` (issue 45 §1): a real run of the tiny policy (tests/conftest.py `purified_run`: 16 tasks × 4
samples, purified at saar γ=0.5) exported in every format and read back by the consumers' own libraries:
`datasets.load_dataset` offline, TRL's SFTTrainer data preparation and collator, the `atif` package's models,
cleaner's own task loader for verl prompts. Bad input gets one line and leaves nothing behind."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.flow_helpers import refused

PARTITION = "mode=saar/gamma=0.50"


@pytest.fixture()
def offline(tmp_path, monkeypatch):
    """Hugging Face libraries with no network and caches under tmp_path (what HF_DATASETS_OFFLINE=1 sets)."""
    for name in ("HF_DATASETS_OFFLINE", "HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"):
        monkeypatch.setenv(name, "1")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    import datasets.config

    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)
    return tmp_path / "hf-cache"


def _load(folder: Path, cache: Path):
    from datasets import load_dataset

    return load_dataset(str(folder), split="train", cache_dir=str(cache))


def _purified(cfg):
    from storage.layout import RunLayout
    from storage.schemas import PURIFIED
    from storage.shards import read_shard

    return read_shard(RunLayout(cfg.storage.root, "w").iteration_dir(0) / "purified" / PARTITION, PURIFIED).to_pylist()


def _raw(cfg):
    from storage.layout import RunLayout
    from storage.schemas import RAW
    from storage.shards import read_shard

    return read_shard(RunLayout(cfg.storage.root, "w").raw_dir(0), RAW).to_pylist()


def test_trl_sft_is_what_trl_trains(purified_run, tmp_path, offline):
    """input_ids = prompt + purified response, completion_mask = 0s + loss mask; `datasets` loads it offline from the
    dataset card, and TRL's own data path (SFTTrainer's preparation, then its collator) trains exactly the
    partition's loss mask."""
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import SFTConfig, SFTTrainer

    from flows.export_cmd import run_export
    from pipeline.config import DEFAULT_POLICY

    out = tmp_path / "sft"
    done = run_export(purified_run, "w", None, PARTITION, "trl-sft", out, batch_rows=7)  # several row groups
    rows = _purified(purified_run)
    assert done.rows == len(rows) > 0
    card = (out / "README.md").read_text()
    assert "configs:" in card and "data/*.parquet" in card and "completion_mask" in card and "saar" in card
    assert "γ = 0.5" in card and "policy versions" in card
    assert "reward > 0" in card  # SFT imitates every row: the card says how to keep successes only

    ds = _load(out, offline)
    assert len(ds) == len(rows)
    by_key = {(r["prompt_id"], r["sample_idx"]): r for r in rows}
    for got in ds:
        want = by_key[(got["prompt_id"], got["sample_idx"])]
        assert got["input_ids"] == want["prompt_ids"] + want["response_ids"]
        assert got["completion_mask"] == [0] * len(want["prompt_ids"]) + want["loss_mask"]
        assert got["advantage"] == pytest.approx(want["advantage"])

    tokenizer = AutoTokenizer.from_pretrained(DEFAULT_POLICY)
    model = AutoModelForCausalLM.from_pretrained(DEFAULT_POLICY)
    # TRL's default settings (completion_only_loss None: it reads completion_mask only for prompt-completion
    # datasets, so the export's labels are what holds the mask) and completion_only_loss=True
    for completion_only_loss in (None, True):
        trainer = SFTTrainer(
            model=model,
            processing_class=tokenizer,
            train_dataset=ds,
            args=SFTConfig(
                output_dir=str(tmp_path / "trl"),
                max_length=None,
                report_to="none",
                completion_only_loss=completion_only_loss,
                per_device_train_batch_size=4,
                use_cpu=True,
            ),
        )
        prepared = trainer.train_dataset
        examples = [prepared[i] for i in range(len(prepared))]
        batch = trainer.data_collator(examples)
        trained = batch["labels"] != -100
        masked_somewhere = False
        for i, got in enumerate(examples):
            want = by_key[(got["prompt_id"], got["sample_idx"])]
            expected = [0] * len(want["prompt_ids"]) + want["loss_mask"]
            n = len(expected)
            assert trained[i, :n].tolist() == [bool(m) for m in expected], (completion_only_loss, i)
            assert not trained[i, n:].any()  # padding never trains
            assert batch["input_ids"][i, :n].tolist() == want["prompt_ids"] + want["response_ids"]
            masked_somewhere |= 0 in want["loss_mask"]
        assert masked_somewhere  # tool responses are in the responses and must not train


def test_trl_messages_render_with_the_policy_template(purified_run, tmp_path, offline):
    """The conversational form: the question, assistant turns with their calls, tool messages with the tool's
    output; `datasets` loads it offline and the policy's chat template renders it with the tools."""
    from transformers import AutoTokenizer

    from flows.export_cmd import run_export

    out = tmp_path / "messages"
    run_export(purified_run, "w", None, PARTITION, "trl-messages", out)
    ds = _load(out, offline)
    raws = {(r["prompt_id"], r["sample_idx"]): r for r in _raw(purified_run)}
    assert len(ds) == len(_purified(purified_run))
    # Qwen3's own template (it renders tools and tool_calls; the tiny policy's renders content only)
    tokenizer = AutoTokenizer.from_pretrained(Path(__file__).resolve().parent.parent / "policies" / "qwen3-tokenizer")
    tool_messages = 0
    for row in ds:
        raw = raws[(row["prompt_id"], row["sample_idx"])]
        messages = row["messages"]
        assert messages[0] == {"role": "user", "content": raw["question"], "tool_calls": None, "name": None}
        codes = {a["code"] for p in raw["positions"] for a in p["attempts"] if a["code"] is not None}
        outputs = [a["result"]["text"] for p in raw["positions"] for a in p["attempts"] if a["result"]]
        for m in messages[1:]:
            assert m["role"] in ("assistant", "tool")
            for call in m["tool_calls"] or []:
                assert call["function"]["name"] == "code_interpreter" and call["function"]["arguments"]["code"] in codes
            if m["role"] == "tool":
                tool_messages += 1
                assert m["content"] in outputs or any(m["content"].startswith(o + "\n\nNote:") for o in outputs)
        assert row["tools"][0]["function"]["name"] == "code_interpreter"
        text = tokenizer.apply_chat_template(
            [{k: v for k, v in m.items() if v is not None} for m in messages], tools=row["tools"], tokenize=False
        )
        assert raw["question"] in text and '"name": "code_interpreter"' in text
        for m in messages:
            for call in m["tool_calls"] or []:
                assert (
                    call["function"]["arguments"]["code"] in text
                    or json.dumps(call["function"]["arguments"]["code"]) in text
                )
    assert tool_messages > 0


def test_atif_trajectories_validate_and_point_at_their_raw_ones(purified_run, tmp_path):
    import atif

    from flows.export_cmd import run_export

    out = tmp_path / "atif"
    run_export(purified_run, "w", [0], PARTITION, "atif", out)
    raws = {f"w/0/{r['prompt_id']}/{r['sample_idx']}": r for r in _raw(purified_run)}
    raw_docs = [
        atif.Trajectory.model_validate_json(line)
        for line in (out / "raw" / "iteration-0000.jsonl").read_text().splitlines()
    ]
    assert {d.trajectory_id for d in raw_docs} == set(raws)
    retries = failures = 0
    for doc in raw_docs:
        raw = raws[doc.trajectory_id]
        attempts = [a for p in raw["positions"] for a in p["attempts"]]
        agent_steps = [s for s in doc.steps if s.source == "agent"]
        assert len(agent_steps) == len(attempts) + (raw["final_turn"] is not None)
        if agent_steps:
            assert agent_steps[0].metrics.prompt_token_ids == raw["prompt_ids"]
        for step, a in zip(agent_steps, attempts):
            x = step.extra["cleaner"]
            assert step.metrics.completion_token_ids == a["turn_ids"] and step.metrics.logprobs == a["logprobs"]
            assert x["attempt_idx"] == a["attempt_idx"]
            if a["code"] is not None:
                assert step.tool_calls[0].arguments == {"code": a["code"]}
            if a["result"] is not None:
                assert step.observation.results[0].content == a["result"]["text"]
                assert x["result"]["error_class"] == a["result"]["error_class"]
                failures += a["result"]["status"] == "failure"
            if a["attempt_idx"] > 0:
                retries += 1
                assert x["retry_of_step"] == step.step_id - 1
                assert x["splice_kind"] in ("shallow", "deep") and 0.0 <= x["similarity"] <= 1.0
    assert retries > 0 and failures > 0  # the tiny policy fails a quarter of its first calls

    purified = _purified(purified_run)
    lines = (out / "purified" / PARTITION / "iteration-0000.jsonl").read_text().splitlines()
    assert len(lines) == len(purified)
    spliced = 0
    for line in lines:
        doc = atif.Trajectory.model_validate_json(line)
        x = doc.extra["cleaner"]
        assert x["raw_trajectory"] == {
            "trajectory_id": x["raw_trajectory"]["trajectory_id"],
            "path": "raw/iteration-0000.jsonl",
        }
        assert x["raw_trajectory"]["trajectory_id"] in raws and x["mode"] == "saar" and x["gamma"] == 0.5
        row = next(r for r in purified if r["raw_key"] == x["raw_trajectory"]["trajectory_id"])
        ids, mask = [], []
        for step in doc.steps[1:]:
            ids += step.metrics.completion_token_ids
            mask += step.extra["cleaner"]["loss_mask"]
            if step.observation:
                ids += step.observation.results[0].extra["cleaner"]["token_ids"]
                mask += step.observation.results[0].extra["cleaner"]["loss_mask"]
        assert ids == row["response_ids"] and mask == row["loss_mask"]
        spliced += len(x["splices"])
    assert spliced > 0


def test_verl_prompts_from_a_filter_task_file_and_from_the_run(purified_run, tmp_path, offline):
    """verl's layout from `cleaner filter`'s task file and from the run: `datasets` loads both offline, and a task file
    loader (cleaner's own, which reads verl's layout) reads the same tasks back."""
    import pyarrow.parquet as pq

    from flows.export_cmd import run_export
    from flows.filter_cmd import run_filter
    from rollout_gen.tasks import load_task_parquet

    tasks = tmp_path / "tasks.parquet"
    kept, seen = run_filter(purified_run.storage.root, "w", None, 0.0, 1.0, tasks)
    out = tmp_path / "verl"
    run_export(purified_run, None, None, None, "verl", out, tasks=tasks)
    ds = _load(out, offline)
    assert len(ds) == kept
    assert set(ds.column_names) == {"data_source", "agent_name", "prompt", "ability", "reward_model", "extra_info"}
    filtered = {r["prompt_id"]: r for r in pq.read_table(tasks).to_pylist()}
    for row in ds:
        assert row["reward_model"]["style"] == "rule" and row["agent_name"] == "tool_agent"
        assert [m["role"] for m in row["prompt"]] == ["system", "user"]
        assert row["extra_info"]["pass_rate"] == pytest.approx(
            next(f["pass_rate"] for f in filtered.values() if f["prompt"][0]["content"] == row["prompt"][1]["content"])
        )
    assert [t.question for t in load_task_parquet(out / "data" / "train.parquet")] == [
        t.question for t in load_task_parquet(tasks)
    ]

    whole = tmp_path / "verl-run"
    done = run_export(purified_run, "w", None, None, "verl", whole)
    assert done.rows == seen and len(_load(whole, offline)) == seen
    card = (whole / "README.md").read_text()  # prompts: no tokens to be exact about; verl needs a scorer for them
    assert "Token-exact: n/a" in card and "custom_reward_function" in card and "tool_config_path" in card


def test_verl_prompts_are_rendered_as_cleaners_rollouts_were(purified_run, tmp_path):
    """The verl export gave the question alone (no system prompt, no tool): verl's tool agent loop would render a
    prompt the policy never saw and offer it no tool. Now the prompt is cleaner's system message and the question,
    and tool_config.yaml gives verl cleaner's code tool schema: rendered with the policy's template and that
    schema, the prompt is token for token the one cleaner's rollouts start from."""
    import pyarrow.parquet as pq
    import yaml

    from flows.export_cmd import run_export
    from pipeline.chat import load_chat

    out = tmp_path / "verl"
    run_export(purified_run, "w", None, None, "verl", out)
    config = yaml.safe_load((out / "tool_config.yaml").read_text())
    [tool] = config["tools"]
    assert tool["class_name"] == "verl.tools.sandbox_fusion_tools.SandboxFusionTool"
    assert tool["tool_schema"]["function"]["name"] == "code_interpreter" and "sandbox_fusion_url" in tool["config"]
    assert tool["config"]["type"] == "native"  # verl's initialize_tools_from_config: ToolType(config.type)
    chat = load_chat(purified_run.rollout.policy)
    rows = pq.read_table(out / "data" / "train.parquet").to_pylist()
    assert rows
    for row in rows:
        rendered = chat.tokenizer.apply_chat_template(
            row["prompt"], tools=[tool["tool_schema"]], add_generation_prompt=True, tokenize=True
        )
        rendered = rendered["input_ids"] if not isinstance(rendered, list) else rendered
        assert list(rendered) == chat.prompt_ids(row["extra_info"]["question"])


def test_a_partition_is_named_as_its_threshold_reads(purified_run, tmp_path):
    """gamma=0.5 is the folder gamma=0.50 (it was refused as a partition the run does not have)."""
    from flows.export_cmd import run_export

    short = run_export(purified_run, "w", None, PARTITION.replace("0.50", "0.5"), "trl-sft", tmp_path / "a")
    assert short.rows == run_export(purified_run, "w", None, PARTITION, "trl-sft", tmp_path / "b").rows > 0


def test_bad_selections_are_refused_in_one_line_and_write_nothing(purified_run, tmp_path, capsys):
    root = purified_run.storage.root
    out = tmp_path / "out"
    base = ["export", "--run", "w", "--out", str(out), f"storage.root={root}"]
    refused([*base, "--format", "trl-sft", "--iteration", "7"], capsys, 2, "no iteration 7", "its iterations: 0")
    refused(
        [*base, "--format", "trl-sft", "--partition", "mode=saar/gamma=0.30"],
        capsys,
        2,
        "no committed partition mode=saar/gamma=0.30",
        "mode=saar/gamma=0.50",
    )
    refused([*base, "--format", "atif", "--partition", "saar-0.5"], capsys, 2, "--partition 'saar-0.5'")
    refused(
        ["export", "--run", "nope", "--out", str(out), "--format", "atif", f"storage.root={root}"],
        capsys,
        2,
        "run 'nope' does not exist",
    )
    assert not out.exists()
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    refused([*base, "--format", "atif"], capsys, 2, str(out), "not empty")
    assert [p.name for p in out.iterdir()] == ["keep.txt"]
    assert not list(tmp_path.glob(".out.staging-*"))

    from flows.cli import main

    fresh = tmp_path / "fresh"
    assert (
        main(
            [
                "export",
                "--run",
                "w",
                "--iteration",
                "0",
                "--format",
                "trl-sft",
                "--out",
                str(fresh),
                f"storage.root={root}",
            ]
        )
        == 0
    )  # the run's train partition (saar, γ 0.5) by default
    said = capsys.readouterr().out
    assert said.startswith(f"exported {len(_purified(purified_run))} rows of run w as trl-sft to {fresh}")
    assert (fresh / "README.md").is_file()


def test_a_failed_export_leaves_no_folder(tmp_path):
    """A store whose checkpoint has no tokenizer (synthetic): trl-messages (text) fails after the staging folder was
    made; neither --out nor the staging folder is left. trl-sft (token ids only) works on it."""
    from benchmarks.store_generator import build
    from flows.export_cmd import run_export
    from flows.interop.source import InteropError
    from pipeline.config import load_config

    build(tmp_path / "ws", 1, rows=8, tokens=64, run_id="syn", log=None)
    cfg = load_config(None, [f"storage.root={tmp_path / 'ws'}"])
    with pytest.raises(InteropError, match="no tokenizer.json"):
        run_export(cfg, "syn", None, PARTITION, "trl-messages", tmp_path / "m")
    assert not (tmp_path / "m").exists() and not list(tmp_path.glob(".m.staging-*"))
    done = run_export(cfg, "syn", None, PARTITION, "trl-sft", tmp_path / "s")
    assert done.rows == 8
