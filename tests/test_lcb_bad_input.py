"""Bad input on LiveCodeBench rows: tests that cannot be decoded, a program that floods its output, a program that
forks. Each is one reward of 0 with its reason, never a crash of the rollout and never a pass: scored through the
real agent loop (a scripted policy, tests/doubles.py) and the real sandbox."""

from __future__ import annotations

import json

import pytest

from pipeline.config import RolloutConfig
from rollout_gen.agent import AgentLoop, RolloutIdentity
from rollout_gen.lcb import OUTPUT_LIMIT_MB, CodeTests, run_tests
from rollout_gen.rewards import reward_outcome
from rollout_gen.tasks import Task
from tests.doubles import ScriptedEngineDouble

SUM = CodeTests(["1 2\n", "3 4\n"], ["3\n", "7\n"]).to_json()
GOOD = "a, b = map(int, input().split())\nprint(a + b)"
FLOOD = "a, b = map(int, input().split())\nprint(a + b)\nwhile True:\n    print('x' * 1_000_000)"
FORK = "import os\na, b = map(int, input().split())\nif os.fork() == 0:\n    print(a + b)\nprint(a + b)"
MULTIPROCESS = (
    "from multiprocessing import Process\na, b = map(int, input().split())\n"
    "p = Process(target=print, args=(a + b,))\np.start()\np.join()"
)


def answer(code: str) -> str:
    return f"Reading the input.\n```python\n{code}\n```\nDone."


def rollout(chat, sandbox, tasks: list[Task], program: str):
    engine = ScriptedEngineDouble(chat, lambda text, n: answer(program))
    loop = AgentLoop(engine, sandbox, chat, RolloutConfig(samples_per_prompt=1, max_prompt_tokens=512))
    return loop.run(tasks, RolloutIdentity("bad", 0, "v"))


UNDECODABLE = {
    "not JSON": "inputs: 1 2",
    "inputs without outputs": json.dumps({"inputs": ["1 2\n"], "outputs": []}),
    "no tests": json.dumps({"inputs": [], "outputs": []}),
    "a call-based output that is not JSON": json.dumps({"inputs": ["1"], "outputs": ["[1,"], "fn_name": "f"}),
}


@pytest.mark.parametrize("name", list(UNDECODABLE))
def test_tests_that_cannot_be_decoded_score_zero_with_the_reason(name, chat, sandbox):
    task = Task(f"bad-{name}", "livecodebench", "Add two numbers.", UNDECODABLE[name], "code")
    outcome = reward_outcome(task, answer(GOOD), sandbox)
    assert outcome.value == 0.0 and outcome.reason.startswith("tests cannot be decoded: "), outcome
    (t,) = rollout(chat, sandbox, [task], GOOD)  # the rollout goes on: the row's reward is 0, not a reward error
    assert t.reward == 0.0 and not t.finish_reason.startswith(("reward_error", "agent_error")), t.finish_reason
    assert t.reward_reason == outcome.reason  # recorded on the raw row (reward_reason)


def test_a_program_that_floods_its_output_scores_zero(chat, sandbox):
    task = Task("flood", "livecodebench", "Add two numbers.", SUM, "code")
    outcome = reward_outcome(task, answer(FLOOD), sandbox)
    assert outcome == type(outcome)(0.0, "test 1 of 2: output limit exceeded")
    (flood,) = rollout(chat, sandbox, [task], FLOOD)
    assert flood.reward == 0.0 and not flood.finish_reason.startswith(("reward_error", "agent_error"))
    assert flood.reward_reason == "test 1 of 2: output limit exceeded"


def test_output_over_the_limit_across_tests_fails_the_tests_it_cut(sandbox):
    half = OUTPUT_LIMIT_MB * 2**20 * 2 // 3  # each test alone is within the limit, all of them together are not
    tests = CodeTests(["1\n", "2\n", "3\n"], ["x\n"] * 3)
    results = run_tests(f"input()\nprint('y' * {half})", tests, sandbox)
    assert [r.passed for r in results] == [False] * 3
    assert results[0].why == "wrong answer" and results[-1].why == "output limit exceeded", results


@pytest.mark.parametrize(
    ("program", "where"), [(FORK, "os.fork()"), (MULTIPROCESS, "multiprocessing")], ids=["os.fork", "multiprocessing"]
)
def test_a_program_that_forks_scores_zero_and_says_where(program, where, chat, sandbox):
    task = Task("fork", "livecodebench", "Add two numbers.", SUM, "code")
    outcome = reward_outcome(task, answer(program), sandbox)
    assert outcome.value == 0.0 and outcome.reason.startswith("test 1 of 2: runtime error: "), outcome
    assert where in outcome.reason, outcome.reason  # the line it failed on
    (t,) = rollout(chat, sandbox, [task], program)
    assert t.reward == 0.0 and not t.finish_reason.startswith(("reward_error", "agent_error"))
    assert t.reward_reason == outcome.reason


def test_task_files_a_user_found_scored_wrong_are_refused_in_one_line(tmp_path):
    """Each loaded and scored wrongly: a test list without outputs (a missing output read as "" passed a program that
    printed nothing), tests cut mid-JSON (read as a math answer: every sample -1, silently), a blank AIME answer (an
    empty box matched it), text that is not UTF-8 (a UnicodeDecodeError traceback)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from rollout_gen.lcb import LCBFormatError, parse_tests
    from rollout_gen.tasks import TaskFileError, load_task_parquet

    with pytest.raises(LCBFormatError, match="test 0 has no 'output'"):
        parse_tests('[{"input": "1"}]')
    with pytest.raises(LCBFormatError, match="test 0 has no 'input'"):
        parse_tests('[{"output": "5"}]')

    def refused(name: str, table: pa.Table, *words: str) -> None:
        path = tmp_path / name
        pq.write_table(table, path)
        with pytest.raises(TaskFileError) as e:
            load_task_parquet(path)
        line = str(e.value)
        assert "\n" not in line and str(path) in line, line
        for w in words:
            assert w in line, line

    refused("no-output.parquet", pa.table({"question": ["Add."], "answer": ['[{"input": "1"}]']}), "row 0", "output")
    cut = '{"inputs": ["1"], "outputs": '
    refused("cut.parquet", pa.table({"question": ["Add."], "answer": [cut]}), "row 0", "not JSON")
    refused("blank.parquet", pa.table({"Problem": ["What is 1+1?"], "Answer": ["  "]}), "row 0", "'Answer' is empty")
    bad = pa.array([b"caf\xe9 1+1?"], pa.binary()).view(pa.string())
    refused("latin1.parquet", pa.table({"question": bad, "answer": ["2"]}), "row 0", "'question'", "not UTF-8")
    refused("latin1-aime.parquet", pa.table({"Problem": bad, "Answer": ["2"]}), "row 0", "'Problem'", "not UTF-8")


def test_a_returned_object_that_fakes_its_class_fails_its_test_and_the_run_goes_on(sandbox):
    """A __class__ property that says list fooled isinstance into list's reader, which raised: the run died and no
    test had a verdict of its own. Read by its type it is not plain data, and the next test still runs."""
    program = (
        "class X:\n    @property\n    def __class__(self):\n        return list\n"
        "class Solution:\n    def f(self, k):\n        return X() if k == 1 else [k]\n"
    )
    results = run_tests(program, CodeTests(["1", "2"], ["[1]", "[2]"], "f"), sandbox, time_limit_s=1)
    assert results[0].why == "wrong answer: returned a X, not plain data", results
