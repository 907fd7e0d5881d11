"""What an import keeps of where its rows came from (issue 46's formats, found by a user's probe): a re-tokenized
import stays not token-exact through an ATIF export and back; a reward the source does not give is refused, not
stored as 0; rows of two verl training steps are not one iteration; verl's left padding is not the prompt; a file
named twice is refused; and a killed export's staging folder is removed by the next export into that folder."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from pipeline.variants import plan_variants
from tests.flow_helpers import refused
from tests.test_import import QUESTION, _foreign_atif, _rows, _store, trl_row


def test_a_retokenized_import_is_not_made_token_exact_by_an_atif_round_trip(tmp_path):
    """An ATIF export of a re-tokenized import said "Token-exact: yes" and importing it back marked the shard
    token_exact: true, which purify then accepted: a way around the refusal of re-tokenized rows."""
    from flows.export_cmd import run_export
    from flows.import_cmd import run_import
    from pipeline.config import DEFAULT_POLICY
    from purifier.stage import run_purify_stage
    from storage.layout import RunLayout
    from storage.shards import ShardError, read_manifest

    source = tmp_path / "trl.jsonl"
    source.write_text(json.dumps(trl_row(reward=1.0)) + "\n")
    cfg = _store(tmp_path)
    assert not run_import(cfg, [source], "trl-completions", "text", tokenizer=DEFAULT_POLICY).token_exact

    run_export(cfg, "text", None, None, "atif", tmp_path / "atif")
    assert "Token-exact: no: the run was imported from text" in (tmp_path / "atif" / "README.md").read_text()
    docs = [json.loads(x) for x in (tmp_path / "atif" / "raw" / "iteration-0000.jsonl").read_text().splitlines()]
    assert [d["extra"]["cleaner"]["token_exact"] for d in docs] == [False]

    again = run_import(cfg, [tmp_path / "atif" / "raw" / "iteration-0000.jsonl"], "atif", "laundered")
    assert not again.token_exact
    assert read_manifest(RunLayout(cfg.storage.root, "laundered").raw_dir(0)).extra["token_exact"] is False
    with pytest.raises(ShardError, match="token_exact: false"):
        run_purify_stage(cfg, "laundered", 0, plan_variants(cfg, ["saar"], [0.5]))
    assert _rows(cfg.storage.root, "laundered")[0]["lived_ids"] == _rows(cfg.storage.root, "text")[0]["lived_ids"]


def test_a_row_without_a_reward_is_refused_not_stored_as_zero(chat, tmp_path, capsys):
    from pipeline.config import DEFAULT_POLICY

    root = tmp_path / "ws"
    base = ["import", "--run", "r", f"storage.root={root}", "--format"]
    trl = tmp_path / "trl.jsonl"
    trl.write_text(json.dumps(trl_row()) + "\n")
    tok = ["--tokenizer", str(DEFAULT_POLICY)]
    refused([*base, "trl-completions", str(trl), *tok], capsys, 2, f"{trl}: line 1", "no reward", "'reward'")
    verl = tmp_path / "verl.jsonl"
    verl.write_text(json.dumps({"input": QUESTION, "output": "\\boxed{42}", "gts": "42", "step": 1}) + "\n")
    refused([*base, "verl-jsonl", str(verl), *tok], capsys, 2, f"{verl}: line 1", "no reward", "'score'")
    doc, _ = _foreign_atif(chat)
    del doc["extra"]["reward"]
    atif = tmp_path / "atif.jsonl"
    atif.write_text(json.dumps(doc) + "\n")
    refused([*base, "atif", str(atif)], capsys, 2, f"{atif}: line 1", "no reward", "extra.reward")
    assert not (root / "runs" / "r" / "raw").exists() or not any((root / "runs" / "r" / "raw").rglob("*.parquet"))


def test_verl_rows_of_two_steps_are_not_one_iteration_and_a_file_named_twice_is_refused(tmp_path, capsys):
    from flows.import_cmd import run_import
    from pipeline.config import DEFAULT_POLICY

    root = tmp_path / "ws"
    row = {"input": QUESTION, "output": "The answer is \\boxed{42}.", "gts": None, "score": 1.0}
    three, four = tmp_path / "3.jsonl", tmp_path / "4.jsonl"
    three.write_text(json.dumps({**row, "step": 3}) + "\n")
    four.write_text(json.dumps({**row, "step": 4}) + "\n")
    base = [
        "import",
        "--run",
        "v",
        f"storage.root={root}",
        "--format",
        "verl-jsonl",
        "--tokenizer",
        str(DEFAULT_POLICY),
    ]
    refused([*base, str(three), str(four)], capsys, 2, f"{four}: line 1", "step 4", "step 3", "--iteration")
    refused([*base, str(three), str(three)], capsys, 2, str(three), "named twice")

    cfg = _store(tmp_path)
    run_import(cfg, [three], "verl-jsonl", "v", tokenizer=DEFAULT_POLICY)
    run_import(cfg, [four], "verl-jsonl", "v", tokenizer=DEFAULT_POLICY, iteration=1)
    assert [r["ground_truth"] for r in _rows(root, "v")] == [""]  # gts: null is no ground truth, not "null"
    assert len(_rows(root, "v", 1)) == 1


def test_verls_left_padding_is_not_part_of_the_imported_prompt(chat, tmp_path):
    """verl's agent loop pads prompts on the left to the batch's length; a dump decoded with special tokens kept
    (what the importer advises for a tokenizer whose tool markers are special) holds the pads."""
    from flows.import_cmd import run_import
    from pipeline.config import DEFAULT_POLICY

    rendered = chat.tokenizer.apply_chat_template(
        [{"role": "user", "content": QUESTION}], tokenize=False, add_generation_prompt=True
    )
    pad = chat.tokenizer.pad_token
    assert pad
    dump = tmp_path / "verl.jsonl"
    output = "The answer is \\boxed{42}.<|im_end|>"
    dump.write_text(json.dumps({"input": pad * 3 + rendered, "output": output, "gts": "42", "score": 1.0}) + "\n")
    run_import(_store(tmp_path), [dump], "verl-jsonl", "padded", tokenizer=DEFAULT_POLICY)
    [row] = _rows(tmp_path / "ws", "padded")
    assert row["prompt_ids"] == chat.encode(rendered)


def test_a_killed_exports_staging_folder_is_removed_by_the_next_export(purified_run, tmp_path):
    """kill -9 left `.OUT.staging-…` with a partial file for good: the next export into that folder removes it, and
    leaves one whose lock a running export holds (a pid would name nothing on another machine sharing the disk)."""
    from storage.staging import locked

    root = purified_run.storage.root
    out = tmp_path / "atif[1]"  # glob characters in the name: matched as text
    code = (
        "import sys\nfrom flows.cli import main\n"
        f"sys.exit(main(['export', '--run', 'w', '--format', 'atif', '--out', {str(out)!r}, "
        f"'storage.root={root}']))"
    )
    dead = tmp_path / ".atif[1].staging-deadbeef"  # what a killed export left: no process holds its lock
    (dead / "raw").mkdir(parents=True)
    (dead / "raw" / "iteration-0000.jsonl").write_text('{"partial": ')
    held = tmp_path / ".atif[1].staging-cafecafe"
    held.mkdir()
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parent.parent)}
    with locked(held.with_name(held.name + ".lock")):  # a live export's
        done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, done.stderr
        assert held.is_dir()
    assert (out / "raw" / "iteration-0000.jsonl").is_file()
    assert not dead.exists() and not (tmp_path / ".atif[1].staging-deadbeef.lock").exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == [".atif[1].staging-cafecafe", "atif[1]"]
