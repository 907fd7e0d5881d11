"""`cleaner eval --samples k` on the committed tiny policy and the world: avg@k equals the mean of k one-sample
evaluations with the same seeds (sample s of the batch is the one-sample run at rollout.seed + s, token for
token); bad input (a task file with a missing or mistyped column, k < 1, k above what the engine batches, an
export without question_id) is one line, and nothing is written."""

from __future__ import annotations

import json

import pyarrow as pa
import pytest

from flows.cli import main
from tests.flow_helpers import refused
from pipeline.chat import load_chat
from pipeline.config import DEFAULT_POLICY, load_config
from rollout_gen.agent import AgentLoop, RolloutIdentity
from rollout_gen.eval_run import evaluate_tasks
from rollout_gen.sandbox import SandboxPool
from rollout_gen.stage import make_engine
from rollout_gen.world.tasks import eval_tasks
from storage.checkpoints import policy_version
from tests.eval_fixtures import LCB_COLUMNS, aime24_file, lcb_rows, lcb_v6_file, write

SEED, K, N_TASKS = 5, 4, 8


def test_avg_at_k_is_the_mean_of_k_single_sample_runs_with_the_same_seeds():
    cfg = load_config(None, [f"rollout.seed={SEED}"])
    tasks = eval_tasks(cfg.world)[:N_TASKS]
    run = evaluate_tasks(cfg, DEFAULT_POLICY, tasks, samples=K, show_progress=False)
    singles = [
        evaluate_tasks(
            load_config(None, [f"rollout.seed={SEED + s}"]), DEFAULT_POLICY, tasks, show_progress=False
        ).metrics
        for s in range(K)
    ]
    avg = run.metrics["benchmarks"]["all"]["pass@1"]
    assert avg == pytest.approx(sum(m["accuracy"] for m in singles) / K, abs=1e-12)
    assert run.metrics["accuracy"] == avg and run.metrics["samples"] == K
    assert 0 < avg < 1  # a real mix of solved and unsolved samples, not a degenerate agreement
    # the samples themselves: sample s of the batch is the plain agent loop's one-sample run at seed SEED + s
    chat = load_chat(DEFAULT_POLICY)
    s = K - 1
    one = load_config(None, [f"rollout.seed={SEED + s}", "rollout.samples_per_prompt=1"])
    with SandboxPool(one.rollout.sandbox) as sandbox:
        plain = AgentLoop(make_engine(one, DEFAULT_POLICY, chat), sandbox, chat, one.rollout).run(
            tasks, RolloutIdentity("eval", 0, policy_version(DEFAULT_POLICY), SEED + s)
        )
    batched = run.trajectories[s::K]
    assert [t.lived_ids for t in batched] == [t.lived_ids for t in plain]
    assert [t.reward for t in batched] == [t.reward for t in plain]
    assert all(t.sample_idx == s and t.seed == SEED + s for t in batched)


def test_bad_k_is_one_line_and_nothing_is_written(tmp_path, capsys):
    ws = tmp_path / "ws"
    base = ["eval", "--world", f"storage.root={ws}"]
    refused([*base, "--samples", "0"], capsys, 2, "--samples 0", ">= 1")
    refused([*base, "--samples", "65"], capsys, 2, "--samples 65", "rollout.engine_tuning.max_in_flight (64)")
    refused(
        [*base, "--samples", "8", "rollout.engine_tuning.max_in_flight=4"],
        capsys,
        2,
        "rollout.engine_tuning.max_in_flight (4)",
    )
    refused([*base, "--samples", "2", "--flow", "--export-lcb", str(tmp_path / "x.json")], capsys, 2, "--export-lcb")
    with pytest.raises(SystemExit):
        main([*base, "--samples", "many"])
    assert "invalid int value: 'many'" in capsys.readouterr().err
    assert not ws.exists() and not (tmp_path / "x.json").exists()


def test_bad_task_files_are_one_line_naming_file_and_column(tmp_path, capsys):
    ws = tmp_path / "ws"
    missing = write(tmp_path / "aime_2024_problems.parquet", [{"data_source": "AIME2024", "Problem": "What is 1+1?"}])
    refused(["eval", "--tasks", str(missing), f"storage.root={ws}"], capsys, 1, str(missing), "missing column 'Answer'")
    mistyped = write(
        tmp_path / "aime_float.parquet", [{"data_source": "AIME2024", "Problem": "What is 1+1?", "Answer": 2.0}]
    )
    refused(
        ["eval", "--tasks", str(mistyped), f"storage.root={ws}"],
        capsys,
        1,
        str(mistyped),
        "column 'Answer' is double, expected a string or an integer",
    )
    rows = lcb_rows()
    for r in rows:
        del r["private_test_cases"]
    no_private = write(tmp_path / "lcb.parquet", rows)
    refused(
        ["eval", "--tasks", str(no_private), f"storage.root={ws}"], capsys, 1, "missing column 'private_test_cases'"
    )
    rows = lcb_rows()
    for r in rows:
        r["metadata"] = 7
    schema = pa.schema([(c, pa.int64() if c == "metadata" else pa.string()) for c in LCB_COLUMNS])
    bad_meta = write(tmp_path / "lcb_meta.parquet", rows, schema)
    refused(["eval", "--tasks", str(bad_meta), f"storage.root={ws}"], capsys, 1, "column 'metadata' is int64")
    bad_gt = write(tmp_path / "v6.parquet", [{"data_source": "LiveCodeBench_v6", "problem": "p", "reward_model": "{}"}])
    refused(["eval", "--tasks", str(bad_gt), f"storage.root={ws}"], capsys, 1, "row 0", "column 'reward_model'")
    assert not ws.exists()


def test_an_export_without_question_id_is_refused_before_running(tmp_path, capsys):
    out = tmp_path / "gen.json"
    v6 = lcb_v6_file(tmp_path / "lcb_v6_2502_2505.parquet", with_question_id=False)
    refused(["eval", "--tasks", str(v6), "--export-lcb", str(out)], capsys, 2, "row 0", "no question_id")
    aime = aime24_file(tmp_path / "aime.parquet")
    refused(["eval", "--tasks", str(aime), "--export-lcb", str(out)], capsys, 2, "has no code task")
    v6 = lcb_v6_file(tmp_path / "with_id.parquet")
    refused(
        ["eval", "--tasks", str(v6), "--export-lcb", str(tmp_path / "nope" / "gen.json")], capsys, 2, "does not exist"
    )
    assert not out.exists() and not (tmp_path / "nope").exists()


def test_flow_eval_settings_are_checked_when_the_config_is_read(tmp_path):
    from pipeline.config import ConfigError

    with pytest.raises(ConfigError, match="flow.eval_samples"):
        load_config(None, ["flow.eval_samples=0"])
    with pytest.raises(ConfigError, match="flow.eval_every"):
        load_config(None, ["flow.eval_every=-1"])
    cfg = load_config(None, ["flow.eval_every=2", "flow.eval_samples=4", "flow.eval_limit=10"])
    assert json.loads(json.dumps(cfg.flow.model_dump()))["eval_saar_off"] is True


def test_bad_rows_and_options_found_by_trying_it_as_a_user_are_one_line_before_anything_runs(tmp_path, capsys):
    """Each was a traceback, a silent wrong number or a run thrown away at its end."""
    ws = tmp_path / "ws"
    root = f"storage.root={ws}"
    flat = [{"problem": "What is 1+1?", "answer": "2"}, {"problem": "What is 2+2?", "answer": "4"}]
    null_q = write(
        tmp_path / "nullq.parquet",
        [flat[0], {"problem": None, "answer": "4"}],
        pa.schema([("problem", pa.string()), ("answer", pa.string())]),
    )
    refused(["eval", "--tasks", str(null_q), root], capsys, 1, str(null_q), "row 1: column 'problem' is empty")
    int_q = write(tmp_path / "intq.parquet", [{"problem": 7, "answer": "4"}])
    refused(["eval", "--tasks", str(int_q), root], capsys, 1, "row 0: column 'problem' is a int, expected a string")
    empty_q = write(tmp_path / "emptyq.parquet", [flat[0], {"problem": " ", "answer": "4"}])
    refused(["eval", "--tasks", str(empty_q), root], capsys, 1, "row 1: the question is empty")
    no_rows = write(tmp_path / "none.parquet", [], pa.schema([("Problem", pa.string()), ("Answer", pa.int64())]))
    refused(["eval", "--tasks", str(no_rows), root], capsys, 1, str(no_rows), "no rows")
    named_all = write(tmp_path / "all.parquet", [dict(flat[0], data_source="all")])
    refused(["eval", "--tasks", str(named_all), root], capsys, 1, "row 0: data_source 'all'")
    long_q = write(tmp_path / "long.parquet", [flat[0], {"problem": "What is 1+1? " * 200, "answer": "2"}])
    refused(
        ["eval", "--tasks", str(long_q), root],
        capsys,
        2,
        "1 of 2 tasks have prompts longer than rollout.max_prompt_tokens (256",
        "the first row 1",
        "raise rollout.max_prompt_tokens",
    )
    v6 = lcb_v6_file(tmp_path / "v6.parquet")
    row = pa.parquet.read_table(v6).to_pylist()[0]
    twice = write(tmp_path / "twice.parquet", [row, dict(row, problem="Read a and b and print a * b.")])
    refused(
        ["eval", "--tasks", str(twice), "--export-lcb", str(tmp_path / "g.json"), root],
        capsys,
        2,
        "row 1: question_id 'abc400_a' repeats row 0's",
    )
    ok = write(tmp_path / "ok.parquet", flat)
    refused(["eval", "--world", "--tasks", str(ok), root], capsys, 2, "not both")
    refused(["eval", "--tasks", str(ok), "--write", root], capsys, 2, "--tasks writes no metrics.json")
    refused(["eval", "--world", "--flow", "--write", root], capsys, 2, "--flow writes no metrics.json")
    for limit in ("0", "-1"):
        for flow in ([], ["--flow"]):
            with pytest.raises(SystemExit):
                main(["eval", "--world", *flow, "--limit", limit, root])
            assert f"invalid count '{limit}'" in capsys.readouterr().err
    assert not ws.exists() and not (tmp_path / "g.json").exists()


def test_a_task_is_graded_by_its_ground_truth_not_by_its_source_name(tmp_path):
    """'code' in a source's name made arithmetic tasks code tasks (scored 0); a code set named e.g. taco was math."""
    from rollout_gen.tasks import load_task_parquet

    tests = json.dumps({"inputs": ["1 2\n"], "outputs": ["3\n"]})
    f = write(
        tmp_path / "t.parquet",
        [
            {"problem": "What is 1+1?", "reward_model": {"ground_truth": "2"}, "data_source": "barcode_math"},
            {"problem": "Print a+b.", "reward_model": {"ground_truth": tests}, "data_source": "taco"},
        ],
    )
    assert [t.kind for t in load_task_parquet(f)] == ["math", "code"]
