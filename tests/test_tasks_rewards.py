"""Task loaders for the reference data layouts, and rewards (math, code through the real sandbox)."""

from __future__ import annotations

import json
import threading

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from rollout_gen.math_verify_worker import MathVerifier
from rollout_gen.rewards import VERIFIER, code_reward, math_reward
from pipeline.answers import last_boxed
from rollout_gen.tasks import TaskFileError, load_task_parquet


def test_open_agentrl_layout(tmp_path):
    path = tmp_path / "train.parquet"
    pq.write_table(
        pa.Table.from_pylist(
            [
                {
                    "prompt": [{"role": "system", "content": "sys"}, {"role": "user", "content": "What is 2+2?"}],
                    "data_source": "math_dapo",
                    "reward_model": {"ground_truth": "4", "style": "rule"},
                },
                {
                    "prompt": [{"role": "user", "content": "Write a program."}],
                    "data_source": "livecodebench",
                    "reward_model": {"ground_truth": '[{"input": "", "output": "1"}]', "style": "rule"},
                },
            ]
        ),
        path,
    )
    a, b = load_task_parquet(path)
    assert (a.question, a.ground_truth, a.source, a.kind) == ("What is 2+2?", "4", "math_dapo", "math")
    assert b.kind == "code" and json.loads(b.ground_truth) == [{"input": "", "output": "1"}]
    assert a.prompt_id != b.prompt_id and load_task_parquet(path)[0].prompt_id == a.prompt_id


def test_flat_eval_layouts(tmp_path):
    path = tmp_path / "aime24.parquet"
    pq.write_table(pa.Table.from_pylist([{"problem": "Find x.", "answer": "17"}]), path)
    (t,) = load_task_parquet(path)
    assert (t.question, t.ground_truth, t.source) == ("Find x.", "17", "aime24")
    gpqa = tmp_path / "gpqa_diamond.parquet"
    pq.write_table(pa.Table.from_pylist([{"question": "Which? (A) x (B) y", "answer": "B"}]), gpqa)
    assert load_task_parquet(gpqa)[0].ground_truth == "B"


def test_bad_task_files_name_file_row_and_field(tmp_path):
    with pytest.raises(TaskFileError, match="does not exist"):
        load_task_parquet(tmp_path / "missing.parquet")
    path = tmp_path / "bad.parquet"
    pq.write_table(
        pa.Table.from_pylist(
            [
                {"prompt": "ok", "reward_model": {"ground_truth": "1"}},
                {"prompt": "no truth", "reward_model": {"ground_truth": None}},
            ]
        ),
        path,
    )
    with pytest.raises(TaskFileError, match=r"bad\.parquet: row 1: missing reward_model\.ground_truth"):
        load_task_parquet(path)
    path2 = tmp_path / "bad2.parquet"
    pq.write_table(pa.Table.from_pylist([{"text": "x"}]), path2)
    with pytest.raises(TaskFileError, match="row 0: no 'prompt'"):
        load_task_parquet(path2)


def test_code_reward_runs_tests_in_the_sandbox(sandbox):
    tests = json.dumps(
        [{"input": "3\n", "output": "6"}, {"input": "5\n", "output": "10"}, {"input": "1\n", "output": "3"}]
    )
    good = "```python\nn = int(input())\nprint(n * 2)\n```"
    assert code_reward(good, tests, sandbox) == pytest.approx(2 / 3)
    assert code_reward("no code here", tests, sandbox) == -1.0
    assert code_reward("```python\nprint(\n```", tests, sandbox) == 0.0


def test_cli_evaluates_a_task_file(tmp_path, capsys):
    from flows.cli import main

    path = tmp_path / "aime_like.parquet"
    pq.write_table(
        pa.Table.from_pylist(
            [{"problem": "What is 12 + 30?", "answer": "42"}, {"problem": "What is 7 * 6?", "answer": "42"}]
        ),
        path,
    )
    assert main(["eval", "--tasks", str(path), "--json"]) == 0
    metrics = json.loads(capsys.readouterr().out)  # stdout holds the JSON document alone
    # the command reports exactly what the library measures on those tasks (sampling is seeded)
    from pipeline.config import DEFAULT_POLICY, load_config
    from flows.eval_cmd import TIMING_FIELDS
    from rollout_gen.eval_run import evaluate_tasks

    want = json.loads(
        json.dumps(
            evaluate_tasks(load_config(None), DEFAULT_POLICY, load_task_parquet(path), show_progress=False).metrics
        )
    )
    assert metrics["trajectories"] == 2 and "accuracy" in metrics
    assert {k: v for k, v in metrics.items() if k not in TIMING_FIELDS} == {
        k: v for k, v in want.items() if k not in TIMING_FIELDS + ("settings",)
    }


# -- math rewards: the last \\boxed{} in the final 100 characters, equivalence by math-verify ----------------


@pytest.mark.parametrize(
    "text,answer",
    [
        ("so \\boxed{\\frac{1}{2}}.", "\\frac{1}{2}"),  # nested braces (the old regex found no box here)
        ("\\boxed{\\sqrt{\\frac{a}{b}}}", "\\sqrt{\\frac{a}{b}}"),
        ("\\boxed{1} and \\boxed{\\dfrac{3}{4}}", "\\dfrac{3}{4}"),  # the last box
        ("\\boxed{7} then \\boxed{8", None),  # the last box never closes: no answer (the paper's scorer)
        ("a \\boxed{ 7 }", "7"),
        ("\\boxed{\\boxed{5}}", "5"),
        ("no box", None),
        ("\\boxed{42}" + "x" * 100, None),  # outside the final 100 characters
        ("\\boxed{4" + "x" * 100 + "}", None),  # opens before the window
    ],
)
def test_last_boxed_balances_braces_within_the_window(text, answer):
    assert last_boxed(text) == answer


@pytest.mark.parametrize(
    "answer,truth",
    [
        ("\\frac{1}{2}", "\\frac{1}{2}"),
        ("0.5", "\\frac12"),
        ("\\frac12", "0.5"),
        ("1/2", "\\frac{1}{2}"),
        ("\\dfrac{1}{2}", "0.5"),
        ("\\frac{\\sqrt{2}}{2}", "\\sqrt{2}/2"),
        ("2\\pi", "\\pi \\cdot 2"),
        ("(1,2)", "(1, 2)"),
        ("042", "42"),
        ("-0", "0"),
        ("x = 17", "17"),
    ],
)
def test_equivalent_forms_score_plus_one(answer, truth):
    assert math_reward(f"The answer is \\boxed{{{answer}}}.", truth) == 1.0


@pytest.mark.parametrize(
    "answer,truth",
    [
        ("\\frac{1}{3}", "\\frac12"),
        ("0.49", "0.5"),
        ("41", "42"),
        ("-42", "42"),
        ("\\sqrt{2}", "2"),
        ("(2,1)", "(1,2)"),
        ("x", "42"),
        ("{{", "42"),
        ("", "42"),
        ("\\text{forty-two}", "42"),
    ],
)
def test_wrong_answers_score_minus_one(answer, truth):
    assert math_reward(f"The answer is \\boxed{{{answer}}}.", truth) == -1.0


def test_box_rule_no_box_and_window():
    assert math_reward("The answer is 42.", "42") == -1.0  # no box
    assert math_reward("\\boxed{42} then \\boxed{41}", "42") == -1.0  # the last box counts
    assert math_reward("\\boxed{\\frac{1}{2}}" + " " * 81, "0.5") == 1.0  # 100 characters: inside the window
    assert math_reward("\\boxed{\\frac{1}{2}}" + " " * 82, "0.5") == -1.0  # 101: its backslash falls outside


@pytest.mark.parametrize(
    "answer,score",
    [
        ("C", 1.0),
        ("(C)", 1.0),
        ("\\text{C}", 1.0),
        ("\\textbf{(C)}", 1.0),
        ("c", 1.0),
        ("C.", 1.0),
        ("B", -1.0),
        ("C or D", -1.0),
        ("CD", -1.0),
        ("3", -1.0),
    ],
)
def test_gpqa_letters(answer, score):
    assert math_reward(f"so the choice is \\boxed{{{answer}}}", "C") == score


def test_integer_answers_score_exactly_as_string_equality_did():
    """World answers are integers: each pair scores +1 exactly when the strings are equal (the old rule),
    except for numerals that only differ in leading zeros or the sign of zero, which math-verify also
    calls equal."""
    for a in ("0", "7", "-7", "42", "1000", "-1000", "123456789012345678901234567890"):
        for b in ("0", "7", "-7", "42", "1000", "-1000", "123456789012345678901234567890"):
            assert math_reward(f"\\boxed{{{a}}}", b) == (1.0 if a == b else -1.0)
    assert VERIFIER.equal("42", "042") is True and VERIFIER.equal("0", "-0") is True  # the shortcut agrees


def test_a_pathological_answer_is_minus_one_never_a_hang_or_an_error(caplog):
    """The verdict is None, whichever limit stopped sympy: math-verify's own in the child (2 s, an error
    reply) or, on a loaded machine, the parent's timeout_s (the child killed); the bound itself is the
    parent's, as the SIGSTOP test below shows without reading a clock."""
    v = MathVerifier(timeout_s=4)
    with caplog.at_level("WARNING", logger="cleaner.rewards"):
        assert v.equal("42", "9^{9^{9^{9}}}") is None and v.failures == 1
    assert any("no verdict on '9^{9^{9^{9}}}'" in r.getMessage() for r in caplog.records), caplog.text
    assert v.equal("\\frac12", "0.5") is True  # and the checker goes on
    v.close()


def test_a_hung_or_dead_checker_is_killed_and_restarted(monkeypatch):
    v = MathVerifier(timeout_s=1)
    assert v.equal("1", "1.0") is True
    hung = v._proc
    hung.send_signal(19)  # SIGSTOP: the child hangs as a C-level sympy loop would
    assert v.equal("\\frac12", "0.5") is None  # returns: the parent's timeout_s, not the child, ends the wait
    assert hung.returncode == -9 and v._proc is None  # the hung child was killed (SIGKILL), none is kept
    assert v.equal("\\frac12", "0.5") is True and v._proc.pid != hung.pid  # a fresh child
    v._proc.kill()  # died between two answers (killed, out of memory on an earlier one): not this answer's doing
    v._proc.wait()
    # a fresh child answers it: the broken pipe scored a correct answer -1 (a CI run's flake, reproduced here)
    assert v.equal("\\frac12", "0.5") is True and v.failures == 1
    v.close()


def test_rewards_work_from_a_worker_thread():
    """math-verify's own timeouts use SIGALRM, which fails outside the main thread (a Prefect task's
    thread): the child process is the main thread of its own process, so a thread gets real verdicts."""
    out = []
    t = threading.Thread(
        target=lambda: out.extend([math_reward("\\boxed{0.5}", "\\frac12"), math_reward("\\boxed{0.4}", "\\frac12")])
    )
    t.start()
    t.join(60)
    assert out == [1.0, -1.0]


# -- rollout.answer_match: math-verify's equivalence, or the CLEANER paper's exact box ------------------------


@pytest.mark.parametrize(
    "answer,truth,equivalent,exact",
    [
        ("204", "204", 1.0, 1.0),
        (" 204 ", "204", 1.0, -1.0),  # the paper's scorer compares the box's text as written
        ("\\frac12", "0.5", 1.0, -1.0),
        ("x=3", "3", 1.0, -1.0),
        ("007", "7", 1.0, -1.0),
        ("(C)", "C", 1.0, -1.0),  # GPQA: no letter leniency
        ("\\frac{1}{2}", "\\frac{1}{2}", 1.0, 1.0),
        ("41", "42", -1.0, -1.0),
    ],
)
def test_answer_match_exact_is_the_papers_string_equality(answer, truth, equivalent, exact):
    text = f"So the answer is \\boxed{{{answer}}}"
    assert math_reward(text, truth) == math_reward(text, truth, "equivalent") == equivalent
    assert math_reward(text, truth, "exact") == exact
    assert math_reward(f"\\boxed{{{truth}}} then \\boxed{{{truth}", truth, "exact") == -1.0  # the last box never closes


def test_the_answer_window_is_counted_on_the_policys_text_without_its_end_of_turn_token(chat):
    """verl decodes a response with special tokens skipped before it takes the last 100 characters; the `<|im_end|>`
    that ended the turn took 10 of them here, so a box 90–100 characters from the end scored −1."""
    from rollout_gen.agent import model_text

    turn = "The answer is \\boxed{42}" + "." * 85  # the box starts 95 characters from the end of the text
    ids = chat.encode(turn) + [chat.im_end_id]
    text = model_text(chat, ids, [1] * len(ids))
    assert text == turn
    assert math_reward(text, "42") == math_reward(text, "42", "exact") == 1.0


def test_an_answer_setting_at_its_default_keeps_the_identities_committed_before_it():
    """rollout.answer_match is hashed only when it is set: a raw shard committed before it existed keeps its
    identity, and `exact` is another rollout."""
    import hashlib
    import json

    from pipeline.config import PLACEMENT_SETTINGS, CleanerConfig

    cfg = CleanerConfig()
    before = {s: getattr(cfg, s).model_dump(mode="json", exclude=set(PLACEMENT_SETTINGS)) for s in ("rollout", "world")}
    del before["rollout"]["answer_match"]  # the sections as an earlier cleaner dumped them
    digest = hashlib.sha256(json.dumps(before, sort_keys=True).encode()).hexdigest()[:16]
    assert cfg.section_hash("rollout", "world") == digest
    cfg.rollout.answer_match = "exact"
    assert cfg.section_hash("rollout", "world") != digest


@pytest.mark.parametrize("answer_match, reward", [("equivalent", 1.0), ("exact", -1.0)])
def test_a_rollout_scores_its_answers_by_rollout_answer_match(answer_match, reward, chat, sandbox):
    from pipeline.config import RolloutConfig
    from rollout_gen.agent import AgentLoop, RolloutIdentity
    from rollout_gen.tasks import Task
    from tests.doubles import ScriptedEngineDouble

    engine = ScriptedEngineDouble(chat, lambda text, n: "So the answer is \\boxed{\\frac12}.")
    loop = AgentLoop(engine, sandbox, chat, RolloutConfig(samples_per_prompt=1, answer_match=answer_match))
    (t,) = loop.run([Task("half", "world", "What is 1/2?", "0.5")], RolloutIdentity("r", 0, "v"))
    assert t.reward == reward and t.final_answer == "\\frac12"
