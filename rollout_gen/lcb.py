"""LiveCodeBench code generation, scored as LiveCodeBench scores it, and its custom-evaluation export.

Checked against LiveCodeBench's own code at commit 28fef95 (2025-07-16; lcb_runner/evaluation/testing_util.py,
lcb_runner/benchmarks/code_generation.py, lcb_runner/runner/custom_evaluator.py):
- the program is the text between the last two lines holding ``` (extraction_utils.extract_code);
- a problem counts as solved only when every test passes;
- stdin tests (no `func_name` in the problem's metadata): the program runs with the test's input on stdin,
  after LiveCodeBench's prelude of star imports; its stdout matches when, after stripping, it has as many
  lines as the expected output and each line is equal, or equal as a list of Decimals;
- call-based tests (LeetCode): the code runs as a module after the prelude; with `class Solution` in it,
  the method `func_name` of a `Solution()` is called, else the module's function; each input line is one
  JSON argument, the output is JSON, a tuple result is compared as a list;
- a per-test time limit (LiveCodeBench's default is 6 s): here the sandbox's `timeout_s`.

Model code never runs in this process: every test is its own call into the sandbox pool (a trusted harness
around the program, run there); the harness reports its verdict on a line that starts with a per-call nonce.
Unlike LiveCodeBench, a stdin program runs as a script (its `if __name__ == "__main__":` block included)
rather than wrapped in a function, and `open(0)` is not mocked.
"""
from __future__ import annotations

import base64
import io
import json
import pickle
import secrets
import zlib
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

# LiveCodeBench's import_string: star imports then plain imports, so programs that use `sqrt`, `deque`,
# `lru_cache` … without importing them run as they do there.
_MODULES = ("string", "re", "datetime", "collections", "heapq", "bisect", "copy", "math", "random", "statistics",
            "itertools", "functools", "operator", "io", "sys", "json")
PRELUDE = ("".join(f"from {m} import *\n" for m in (*_MODULES, "builtins", "typing"))
           + "".join(f"import {m}\n" for m in _MODULES) + "sys.setrecursionlimit(50000)\n")

# The trusted side of one test, run in the sandbox around the model's program (passed in `_spec`).
_HARNESS = r'''import io as _io, json as _json, sys as _sys
from decimal import Decimal as _Decimal
_spec = _json.loads(%r)
def _lines(s):
    return [x.strip() for x in s.strip().split("\n")]
def _decimals(line):
    try:
        return [_Decimal(x) for x in line.split()]
    except Exception:
        return None
def _same(got, want):
    a, b = _lines(got), _lines(want)
    if len(a) != len(b):
        return False
    for x, y in zip(a, b):
        if x != y:
            dx, dy = _decimals(x), _decimals(y)
            if dx is None or dy is None or dx != dy:
                return False
    return True
_captured = _io.StringIO()
_sys.stdout = _captured
_ok, _why = False, "wrong answer"
try:
    if _spec["fn"] is None:
        _sys.stdin = _io.TextIOWrapper(_io.BytesIO(_spec["input"].encode()), encoding="utf-8")
        _ns = {"__name__": "__main__"}
        exec(_spec["prelude"], _ns)
        try:
            exec(compile(_spec["code"], "<solution>", "exec"), _ns)
        except SystemExit:
            pass
        _ok = _same(_captured.getvalue(), _spec["output"])
    else:
        _ns = {"__name__": "tmp_sol"}
        exec(compile(_spec["prelude"] + "\n\n" + _spec["code"], "<solution>", "exec"), _ns)
        _obj = _ns["Solution"]() if "class Solution" in _spec["code"] else None
        _method = getattr(_obj, _spec["fn"], None) if _obj is not None else _ns.get(_spec["fn"])
        if _method is None:
            _why = "no function " + _spec["fn"]
        else:
            _args = [_json.loads(line) for line in _spec["input"].split("\n")]
            _got = _method(*_args)
            if isinstance(_got, tuple):
                _got = list(_got)
            _ok = _got == _json.loads(_spec["output"])
except BaseException as _e:
    _why = "runtime error: " + type(_e).__name__
_sys.stdout = _sys.__stdout__
_sys.__stdout__.write("\n" + _spec["nonce"] + _json.dumps([bool(_ok), "" if _ok else _why]) + "\n")
_sys.__stdout__.flush()
'''


class LCBFormatError(ValueError):
    """Test cases or metadata that are not in LiveCodeBench's format."""


@dataclass(frozen=True)
class CodeTests:
    """A code task's tests: LiveCodeBench's `input_output` (inputs, outputs, fn_name) and its question_id."""

    inputs: list[str]
    outputs: list[str]
    fn_name: str | None = None
    question_id: str | None = None

    def to_json(self) -> str:
        return json.dumps({"inputs": self.inputs, "outputs": self.outputs, "fn_name": self.fn_name,
                           "question_id": self.question_id})


@dataclass(frozen=True)
class TestResult:
    passed: bool
    why: str = ""  # "" when passed; wrong answer, runtime error: X, time limit exceeded, …


def parse_tests(ground_truth: str) -> CodeTests:
    """A code task's ground truth: {"inputs", "outputs", "fn_name"?, "question_id"?} (LiveCodeBench's
    input_output, as Open-AgentRL-Eval stores it) or the older list of {"input", "output"} stdin tests."""
    try:
        data = json.loads(ground_truth)
    except (json.JSONDecodeError, TypeError) as e:
        raise LCBFormatError(f"tests are not JSON ({e})") from None
    if isinstance(data, list):
        if not all(isinstance(t, dict) for t in data):
            raise LCBFormatError("a test list must hold {input, output} objects")
        return CodeTests([str(t.get("input", "")) for t in data], [str(t.get("output", "")) for t in data])
    if not isinstance(data, dict) or not isinstance(data.get("inputs"), list) or not isinstance(data.get("outputs"), list):
        raise LCBFormatError("tests must be {inputs: [...], outputs: [...]} or a list of {input, output}")
    if len(data["inputs"]) != len(data["outputs"]):
        raise LCBFormatError(f"{len(data['inputs'])} inputs but {len(data['outputs'])} outputs")
    return code_tests(data["inputs"], data["outputs"], data.get("fn_name"), data.get("question_id"))


def code_tests(inputs: list, outputs: list, fn_name: object, question_id: object) -> CodeTests:
    """CodeTests of LiveCodeBench's input_output values: inputs and outputs as text (JSON unless strings)."""
    def text(value: object) -> str:
        return value if isinstance(value, str) else json.dumps(value)
    return CodeTests([text(x) for x in inputs], [text(x) for x in outputs], str(fn_name) if fn_name else None,
                     None if question_id is None else str(question_id))


class _NoGlobals(pickle.Unpickler):
    """Unpickles plain data only: a pickle that names any class or function (code to run) is refused."""

    def find_class(self, module: str, name: str):
        raise pickle.UnpicklingError(f"refused: the pickle names {module}.{name}")


def decode_test_cases(value: str) -> list[dict]:
    """`public_test_cases` / `private_test_cases` of code_generation_lite: a JSON list of {input, output,
    testtype}, or (private, from release v2 on) that JSON string pickled, zlib-compressed and base64-encoded."""
    try:
        cases = json.loads(value)
    except json.JSONDecodeError:
        try:
            inner = _NoGlobals(io.BytesIO(zlib.decompress(base64.b64decode(value.encode())))).load()
            cases = json.loads(inner) if isinstance(inner, str) else None
        except pickle.UnpicklingError as e:  # a refusal says what the pickle named; other failures, their type
            raise LCBFormatError(f"neither JSON nor base64/zlib/pickle-encoded JSON (UnpicklingError: {e})") from None
        except Exception as e:  # noqa: BLE001 - any failure of the three decodings is a format error
            raise LCBFormatError(f"neither JSON nor base64/zlib/pickle-encoded JSON ({type(e).__name__})") from None
    if not isinstance(cases, list) or not all(isinstance(c, dict) and "input" in c and "output" in c for c in cases):
        raise LCBFormatError("not a list of {input, output, testtype} objects")
    return cases


def extract_code(text: str) -> str:
    """LiveCodeBench's extraction for chat models: the lines between the last two lines holding ```."""
    lines = text.split("\n")
    fences = [i for i, line in enumerate(lines) if "```" in line]
    if len(fences) < 2:
        return ""
    return "\n".join(lines[fences[-2] + 1: fences[-1]])


def _run_one(sandbox, program: str, tests: CodeTests, i: int) -> TestResult:
    nonce = "@@lcb-" + secrets.token_hex(8) + "@@"
    spec = {"code": program, "input": tests.inputs[i], "output": tests.outputs[i], "fn": tests.fn_name,
            "prelude": PRELUDE, "nonce": nonce}
    ex = sandbox.execute(_HARNESS % json.dumps(spec))
    if ex.infra_error is not None:  # never blamed on the program: the reward says so (reward_error)
        raise RuntimeError(f"the sandbox could not run test {i}: {ex.infra_error}")
    if ex.timed_out:
        return TestResult(False, "time limit exceeded")
    for line in reversed(ex.stdout.splitlines()):
        if line.startswith(nonce):
            ok, why = json.loads(line[len(nonce):])
            return TestResult(bool(ok), why)
    return TestResult(False, f"no verdict (exit code {ex.exit_code})")


def run_tests(program: str, tests: CodeTests, sandbox) -> list[TestResult]:
    """Every test in the sandbox, `workers` at a time. A time limit exceeded ends the run: the tests not yet
    started count as failed (LiveCodeBench stops at the first failure; a looping program would otherwise
    cost the limit once per test)."""
    workers = max(1, getattr(getattr(sandbox, "cfg", None), "workers", 1))
    results: list[TestResult] = []
    with ThreadPoolExecutor(max_workers=workers) as pool:
        for start in range(0, len(tests.inputs), workers):
            chunk = range(start, min(start + workers, len(tests.inputs)))
            results += pool.map(lambda i: _run_one(sandbox, program, tests, i), chunk)
            if any(r.why == "time limit exceeded" for r in results):
                results += [TestResult(False, "not run (an earlier test timed out)")] * (len(tests.inputs) - len(results))
                break
    return results


def score(response_text: str, ground_truth: str, sandbox) -> float:
    """Share of tests passed (1.0: solved as LiveCodeBench counts it); −1 without a code block or tests."""
    program = extract_code(response_text)
    try:
        tests = parse_tests(ground_truth)
    except LCBFormatError:
        return -1.0
    if not program.strip() or not tests.inputs:
        return -1.0
    results = run_tests(program, tests, sandbox)
    return sum(r.passed for r in results) / len(results)


def custom_output(entries: list[tuple[str, list[str]]]) -> list[dict]:
    """LiveCodeBench's custom-evaluation file for code generation: a JSON list of {"question_id",
    "code_list"} (custom_evaluator.py sorts it by str(question_id) and zips it with the benchmark's
    problems sorted by question_id, so it must hold every problem of the release evaluated, once)."""
    seen: set[str] = set()
    for qid, _ in entries:
        if qid in seen:
            raise LCBFormatError(f"question_id {qid!r} appears twice")
        seen.add(qid)
    return [{"question_id": qid, "code_list": list(codes)} for qid, codes in sorted(entries, key=lambda e: str(e[0]))]
