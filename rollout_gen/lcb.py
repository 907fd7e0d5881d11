"""LiveCodeBench code generation, scored as LiveCodeBench's own harness scores it, and its custom-evaluation export.

Reproduces the harness at commit 28fef95 (2025-07-16) of github.com/LiveCodeBench/LiveCodeBench
(lcb_runner/evaluation/testing_util.py and compute_code_generation_metrics.py), quirks included, because every
published LiveCodeBench number is made with them (docs/eval.md lists them, and what still differs):
- the program is the text between the last two lines holding ``` (extraction_utils.extract_code);
- all of a program's tests run one after the other in one process, each under a 6 s alarm, the whole run under
  (6 + 1) × tests + 5 s; the first runtime error or time-out ends the run; the problem is solved when every
  test passes;
- stdin programs are rewritten into a function (imports hoisted, a last `if __name__ == '__main__':` block
  unwrapped) after LiveCodeBench's prelude of star imports, and called with its stand-ins for stdin and
  `open` and with stdout captured in a StringIO; the output matches when, stripped, it has as many lines as
  the expected output and each line is equal, or equal as a list of Decimals;
- call-based (LeetCode) programs run as a module after the prelude; with `class Solution` in the text one
  `Solution()` serves every test; each input line is one JSON argument; a tuple result counts as a list;
- the harness's guard: `quit` is None, so are the os functions it removes; ints print up to 50,000 digits.

Verdicts a program cannot forge: the expected outputs never enter the process that runs model code. The
sandboxed run (RUNNER, in the sandbox) only reports what the program produced — each test's captured stdout,
or its return value as tagged plain data — on a channel of lines; the comparison with the expected output
happens here, in the pipeline's process (`_compare`).
"""

from __future__ import annotations

import base64
import io
import json
import math
import pickle
import zlib
from dataclasses import dataclass, field
from decimal import Decimal

TIME_LIMIT_S = 6.0  # the harness's default `timeout` per test (and per compile)
INT_MAX_STR_DIGITS = 50_000  # compute_code_generation_metrics raises the int<->str digit limit to this
# The harness sets no memory limit. A cap stays here so that one runaway program cannot take the machine the
# rollout runs on: 4 GiB of address space, the figure the harness's own comment names (docs/eval.md).
MEMORY_MB = 4096
# What one test may print, and what all of a program's tests may print together (the harness keeps it in
# memory, uncapped): past it the test, or the tests left without a result, fail as "output limit exceeded".
OUTPUT_LIMIT_MB = 32

# LiveCodeBench's import_string: star imports then plain imports, so programs that use `sqrt`, `deque`,
# `lru_cache` … without importing them run as they do there.
_MODULES = (
    "string",
    "re",
    "datetime",
    "collections",
    "heapq",
    "bisect",
    "copy",
    "math",
    "random",
    "statistics",
    "itertools",
    "functools",
    "operator",
    "io",
    "sys",
    "json",
)
PRELUDE = (
    "".join(f"from {m} import *\n" for m in (*_MODULES, "builtins", "typing"))
    + "".join(f"import {m}\n" for m in _MODULES)
    + "sys.setrecursionlimit(50000)\n"
)
# What the harness's reliability_guard sets to None before the program runs (os.kill … os.chdir).
_GUARDED_OS = (
    "kill",
    "system",
    "putenv",
    "remove",
    "removedirs",
    "rmdir",
    "fchdir",
    "setuid",
    "fork",
    "forkpty",
    "killpg",
    "rename",
    "renames",
    "truncate",
    "replace",
    "unlink",
    "fchmod",
    "fchown",
    "chmod",
    "chown",
    "chroot",
    "lchflags",
    "lchmod",
    "lchown",
    "getcwd",
    "chdir",
)
_GUARDED_MODULES = ("ipdb", "joblib", "resource", "psutil", "tkinter")

# The sandboxed side of one program's run. It knows the program, the test inputs and the time limit, never an
# expected output; it writes one JSON line per event to a private copy of fd 1 (fd 1 itself goes to /dev/null,
# as the harness's real stdout is not what it compares). Lines: {"test": i, "stdout": text} or
# {"test": i, "value": tagged data}, {"test": i, "error": why} (ends the run), {"fatal": why} (no test ran).
RUNNER = r'''
import ast as _ast, builtins as _builtins, io as _io, json as _json, os as _os, signal as _signal, sys as _sys
import types as _types
from unittest.mock import mock_open as _mock_open, patch as _patch

_spec = _json.loads(__SPEC__)
_channel = _os.dup(1)
_null = _os.open(_os.devnull, _os.O_WRONLY)
_os.dup2(_null, 1)
_os.close(_null)
_write, _setitimer, _ITIMER_REAL = _os.write, _signal.setitimer, _signal.ITIMER_REAL


def _emit(record):
    data = (_json.dumps(record) + "\n").encode()
    while data:
        data = data[_write(_channel, data):]


class TimeoutException(Exception):  # the harness's name: it tells a time-out by "timeoutexception" in repr(e)
    pass


class OutputLimitExceeded(Exception):
    pass


def _on_alarm(signum, frame):
    # the harness's handler prints this before it raises: in a stdin test it lands in the captured output, so a
    # program that catches the time-out and prints the answer still fails there on the extra line
    print("timeout occured: alarm went off")
    raise TimeoutException


_capture = [None]  # the running test's captured stdout, watched for a flood on a CPU-time tick


def _on_tick(signum, frame):
    captured = _capture[0]
    if captured is not None and captured.tell() > _spec["output_limit"]:
        raise OutputLimitExceeded  # on every tick while it lasts: a program that catches it cannot go on for long


def _alarm(seconds):
    _setitimer(_ITIMER_REAL, seconds)
    _setitimer(_signal.ITIMER_PROF, 0.05 if seconds else 0, 0.05 if seconds else 0)


_source = [""]  # the text being run, to name the line an error came from


def _failure(e):
    if "timeoutexception" in repr(e).lower():
        return "time limit exceeded"
    if isinstance(e, OutputLimitExceeded):
        return "output limit exceeded"
    why = "runtime error: " + type(e).__name__
    try:
        why += (": " + str(e))[:120] if str(e) else ""
        tb, line = e.__traceback__, 0
        while tb is not None:
            if tb.tb_frame.f_code.co_filename == "<string>":
                line = tb.tb_lineno
            tb = tb.tb_next
        text = _source[0].split("\n")[line - 1].strip() if line else ""
        return why + (" (at `" + text[:120] + "`)" if text else "")
    except Exception:
        return why


class _StdinBuffer:  # the harness's stand-in for sys.stdin.buffer: all of it, or its first line, every time
    def __init__(self, text):
        self.data = text.encode("utf-8")

    def read(self, *args):
        return self.data

    def readline(self, *args):
        return self.data.split(b"\n")[0] + b"\n"


class _Stdin:  # the harness's stand-in for sys.stdin: read() is all of it (even after readline()), not iterable
    def __init__(self, text):
        self.text = text
        self._lines = _io.StringIO(text)
        self.buffer = _StdinBuffer(text)

    def read(self, *args):
        return self.text

    def readline(self, *args):
        return self._lines.readline(*args)

    def readlines(self, *args):
        return self.text.split("\n")

    def __getattr__(self, name):
        return getattr(self._lines, name)


def _as_function(code):
    """The harness's rewrite of a stdin program: a last `if __name__ == '__main__':` block unwrapped, top-level
    imports hoisted after the prelude, every other statement the body of `wrapped_function`."""
    try:
        tree = _ast.parse(code)
        last = tree.body[-1]
        if isinstance(last, _ast.If) and _ast.unparse(last.test).strip() == "__name__ == '__main__'":
            code = _ast.unparse(tree.body[:-1]) + "\n" + _ast.unparse(last.body)
    except Exception:
        pass
    try:
        tree = _ast.parse(code)
        imports = [s for s in tree.body if isinstance(s, (_ast.Import, _ast.ImportFrom))]
        body = [s for s in tree.body if not isinstance(s, (_ast.Import, _ast.ImportFrom))]
        fn = _ast.FunctionDef(name="wrapped_function", body=body, decorator_list=[], lineno=-1,
                              args=_ast.arguments(posonlyargs=[], args=[], kwonlyargs=[], kw_defaults=[], defaults=[]))
        return _spec["prelude"] + "\n" + _ast.unparse(imports) + "\n" + _ast.unparse(fn)
    except Exception:
        return code


def _load(code):
    _source[0] = code
    _alarm(_spec["time_limit"])
    try:
        module = _types.ModuleType("tmp_sol", "")
        exec(code, module.__dict__)
        return module.Solution() if "class Solution" in code else module
    finally:
        _alarm(0)


def _call_with_stdin(method, text):
    lines = iter(text.split("\n"))
    # Entered in the harness's order: the real stdin's read/readlines/readline first (what `from sys import stdin`
    # holds), then sys.stdin itself, then builtins.open (programs see the prelude's own `open`, unpatched).
    with _patch("sys.stdin.read", lambda *a: text), _patch("sys.stdin.readlines", lambda *a: text.split("\n")), \
            _patch("sys.stdin.readline", lambda *a: next(lines)), _patch("sys.stdin", _Stdin(text)), \
            _patch("builtins.open", _mock_open(read_data=text)):
        try:
            method()
        except SystemExit:
            pass


class _Unplain(Exception):
    pass


def _tagged(v, depth=0):
    """A return value as JSON that keeps Python's equality: a JSON object is always a tag."""
    if depth > 500:
        raise _Unplain("nested too deeply")
    t = type(v)
    if v is None or t is bool or t is str:
        return v
    if t is int:
        return v if -2**53 < v < 2**53 else {"int": hex(v)}
    if t is float:
        return v if v == v and v not in (float("inf"), float("-inf")) else {"float": repr(v)}
    if t is list:
        return [_tagged(x, depth + 1) for x in v]
    if t is tuple:
        return {"tuple": [_tagged(x, depth + 1) for x in v]}
    if issubclass(t, dict):  # a subclass (Counter, defaultdict) by its storage: dict.items, never its keys() or items()
        return {"dict": [[_tagged(k, depth + 1), _tagged(x, depth + 1)] for k, x in dict.items(v)]}
    if t is set or t is frozenset:
        return {t.__name__: [_tagged(x, depth + 1) for x in v]}
    if t is bytes:
        return {"bytes": v.hex()}
    numpy = _sys.modules.get("numpy")
    if numpy is not None and issubclass(t, numpy.generic) and not issubclass(t, numpy.ndarray):
        if issubclass(t, numpy.bool_):
            return bool(v)
        if issubclass(t, numpy.integer):
            return _tagged(int(v), depth)
        if issubclass(t, numpy.floating):
            return _tagged(float(v), depth)
    for base, value in _BASE_VALUES:
        if issubclass(t, base):  # a subclass (IntEnum, a str, list or set subclass): the builtin value
            # it holds, read from its storage by the base type's own code, never by a method the program wrote
            # (__eq__, __iter__, keys); its type, not isinstance, which a __class__ property can fake
            return _tagged(value(v), depth)
    raise _Unplain("returned a " + t.__name__ + ", not plain data")


_BASE_VALUES = (
    (int, int.__int__),
    (float, float.__float__),
    (str, str.__str__),
    (list, list.copy),
    (tuple, lambda v: tuple.__getitem__(v, slice(None))),
    (set, set.copy),
    (frozenset, frozenset.copy),
    (bytes, lambda v: bytes(memoryview(v))),
)


def _main():
    _sys.set_int_max_str_digits(_spec["digits"])
    _signal.signal(_signal.SIGALRM, _on_alarm)
    _signal.signal(_signal.SIGPROF, _on_tick)
    if "numpy" in _spec["code"]:  # the harness has numpy loaded before its guard (which numpy's import trips)
        import numpy
    _builtins.quit = None
    _os.environ["OMP_NUM_THREADS"] = "1"
    for name in _spec["guarded_os"]:
        setattr(_os, name, None)
    _builtins.help = None
    for name in _spec["guarded_modules"]:
        _sys.modules[name] = None
    fn = _spec["fn"]
    try:
        if fn is None:
            method = getattr(_load(_as_function(_spec["code"])), "wrapped_function", None)
            if method is None:
                return _emit({"fatal": "no function wrapped_function"})
        else:
            sol = _load(_spec["prelude"] + "\n\n" + _spec["code"])
            method = getattr(sol, fn) if hasattr(sol, fn) else None
            if method is None:
                return _emit({"fatal": "no function " + fn})
            calls = [[_json.loads(line) for line in text.split("\n")] for text in _spec["inputs"]]
    except BaseException as e:
        return _emit({"fatal": _failure(e)})
    for i, text in enumerate(_spec["inputs"]):
        if fn is None:
            captured = _io.StringIO()
            captured.close = lambda _unused: 1  # the harness's no-op close (which takes an argument)
            saved = _sys.stdout
            _sys.stdout = _capture[0] = captured
            _alarm(_spec["time_limit"])
            try:
                _call_with_stdin(method, text)
                _alarm(0)
            except BaseException as e:
                _alarm(0)
                _sys.stdout, _capture[0] = saved, None
                return _emit({"test": i, "error": _failure(e)})
            _sys.stdout, _capture[0] = saved, None
            if captured.tell() > _spec["output_limit"]:
                return _emit({"test": i, "error": "output limit exceeded"})
            _emit({"test": i, "stdout": captured.getvalue()})
        else:
            _alarm(_spec["time_limit"])
            try:
                got = method(*calls[i])
                # still under the alarm: reading the value can run the program's code (a dict key's __hash__)
                if issubclass(type(got), tuple):
                    got = list(tuple.__getitem__(got, slice(None)))
                record = {"test": i, "value": _tagged(got)}
                _alarm(0)
            except (_Unplain, RecursionError, ValueError) as e:
                _alarm(0)
                record = {"test": i, "error": "wrong answer: " + (str(e) if isinstance(e, _Unplain) else "unreadable")}
            except BaseException as e:
                _alarm(0)
                return _emit({"test": i, "error": _failure(e)})
            _emit(record)
    _emit({"done": len(_spec["inputs"])})  # every test reported: a run cut short without it is not trusted


_main()
_os._exit(0)
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
        return json.dumps(
            {"inputs": self.inputs, "outputs": self.outputs, "fn_name": self.fn_name, "question_id": self.question_id}
        )


@dataclass(frozen=True)
class TestResult:
    __test__ = False  # a result, not a pytest test class

    passed: bool
    why: str = ""  # "" when passed; wrong answer, runtime error: X, time limit exceeded, …


@dataclass(frozen=True)
class Verdict:
    """A response's score and, when it is not a full pass, why (the first failed test's reason)."""

    score: float
    reason: str = ""
    results: list[TestResult] = field(default_factory=list)


def parse_tests(ground_truth: str) -> CodeTests:
    """A code task's ground truth: {"inputs", "outputs", "fn_name"?, "question_id"?} (LiveCodeBench's
    input_output, as Open-AgentRL-Eval stores it) or the older list of {"input", "output"} stdin tests."""
    try:
        data = json.loads(ground_truth)
    except (json.JSONDecodeError, TypeError) as e:
        raise LCBFormatError(f"tests are not JSON ({e})") from None
    if isinstance(data, list):
        if not data:
            raise LCBFormatError("the test list is empty")
        for k, t in enumerate(data):  # a missing output read as "" passed every program that printed nothing
            if not isinstance(t, dict) or "input" not in t or "output" not in t:
                what = (
                    "not an object"
                    if not isinstance(t, dict)
                    else "has no " + repr("output" if "input" in t else "input")
                )
                raise LCBFormatError(f"test {k} {what}: a test list must hold {{input, output}} objects")
        return CodeTests([str(t["input"]) for t in data], [str(t["output"]) for t in data])
    if (
        not isinstance(data, dict)
        or not isinstance(data.get("inputs"), list)
        or not isinstance(data.get("outputs"), list)
    ):
        raise LCBFormatError("tests must be {inputs: [...], outputs: [...]} or a list of {input, output}")
    if len(data["inputs"]) != len(data["outputs"]):
        raise LCBFormatError(f"{len(data['inputs'])} inputs but {len(data['outputs'])} outputs")
    return code_tests(data["inputs"], data["outputs"], data.get("fn_name"), data.get("question_id"))


def code_tests(inputs: list, outputs: list, fn_name: object, question_id: object) -> CodeTests:
    """CodeTests of LiveCodeBench's input_output values: inputs and outputs as text (JSON unless strings)."""

    def text(value: object) -> str:
        return value if isinstance(value, str) else json.dumps(value)

    return CodeTests(
        [text(x) for x in inputs],
        [text(x) for x in outputs],
        str(fn_name) if fn_name else None,
        None if question_id is None else str(question_id),
    )


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
    return "\n".join(lines[fences[-2] + 1 : fences[-1]])


# ---- the comparison, in this process --------------------------------------------------------------------


def _lines(text: str) -> list[str]:
    return [x.strip() for x in text.strip().split("\n")]


def _decimals(line: str) -> list[Decimal] | None:
    try:
        return [Decimal(x) for x in line.split()]
    except Exception:  # noqa: BLE001 - the harness treats any failure as "not numbers"
        return None


def stdout_matches(got: str, want: str) -> bool:
    """The harness's rule: the same number of stripped lines, each equal or equal as a list of Decimals."""
    a, b = _lines(got), _lines(want)
    if len(a) != len(b):
        return False
    for x, y in zip(a, b):
        if x != y:
            dx, dy = _decimals(x), _decimals(y)
            if dx is None or dy is None or dx != dy:
                return False
    return True


def _int(digits: str) -> int:
    """A JSON integer as the harness reads it (its digit limit, 50,000), whatever this process's limit is."""
    sign, body = (-1, digits[1:]) if digits.startswith("-") else (1, digits)
    if len(body) > INT_MAX_STR_DIGITS:
        raise ValueError(f"an integer of {len(body)} digits (the harness reads at most {INT_MAX_STR_DIGITS})")
    value = 0
    for start in range(0, len(body), 4000):
        chunk = body[start : start + 4000]
        value = value * 10 ** len(chunk) + int(chunk)
    return sign * value


def expected_value(text: str) -> object:
    """An expected call-based output: JSON, read as the harness reads it."""
    return json.loads(text, parse_int=_int)


def _untagged(v: object, depth: int = 0) -> object:
    if depth > 600:
        raise ValueError("nested too deeply")
    if isinstance(v, list):
        return [_untagged(x, depth + 1) for x in v]
    if not isinstance(v, dict):
        return v
    ((tag, payload),) = v.items()
    if tag == "int":
        return int(payload, 16)
    if tag == "float":
        return float(payload)
    if tag == "bytes":
        return bytes.fromhex(payload)
    items = [_untagged(x, depth + 1) for x in payload]
    if tag == "tuple":
        return tuple(items)
    if tag == "set":
        return set(items)
    if tag == "frozenset":
        return frozenset(items)
    if tag == "dict":
        return dict(items)
    raise ValueError(f"unknown tag {tag!r}")


def _compare(record: dict, want: str, call_based: bool) -> TestResult:
    if "error" in record:
        return TestResult(False, str(record["error"]))
    try:
        if call_based:
            got = _untagged(record["value"])
            same = got == expected_value(want)
            if not isinstance(same, bool):
                raise ValueError("not plain data")
        else:
            same = stdout_matches(str(record["stdout"]), want)
    except Exception as e:  # noqa: BLE001 - a record the program garbled is its wrong answer, never a pass
        return TestResult(False, f"wrong answer: unreadable result ({type(e).__name__})")
    return TestResult(True) if same else TestResult(False, "wrong answer")


def _read_channel(ex, tests: CodeTests) -> tuple[dict[int, TestResult], str, str]:
    """(results, why the run ended early or "", why the records are not the runner's or ""). The runner writes
    exactly: {"fatal"} alone, or one record per test in order — the first "error" ends the run — then {"done": n}.
    The program runs in the same process and can write on the channel too (a record of its own for a test it
    printed nothing for); any line out of that order, or a run that exits 0 without "done" (os._exit after a
    record of its own), voids the run. A program that rewrites the runner's own functions is not caught here:
    that needs the program in a process of its own (docs/eval.md)."""
    n = len(tests.inputs)
    lines = ex.stdout.splitlines()
    cut = getattr(ex, "stdout_bytes", 0) >= OUTPUT_LIMIT_MB * 2**20  # the last line may be a cut record
    results: dict[int, TestResult] = {}
    for k, line in enumerate(lines):
        try:
            record = json.loads(line)
        except ValueError:
            record = None
        if not isinstance(record, dict):
            if cut and k == len(lines) - 1:
                return results, "", ""
            return results, "", f"line {k + 1} is not a record"
        if not results and set(record) == {"fatal"}:
            return results, str(record["fatal"]), ""
        if set(record) == {"done"}:
            if record["done"] != n or len(results) != n:
                return results, "", f"'done' after {len(results)} of {n} tests"
            return results, "", ""
        kind = set(record) - {"test"}
        if record.get("test") != len(results) or len(kind) != 1 or not kind <= {"stdout", "value", "error"}:
            return results, "", f"line {k + 1}: a record out of the runner's order"
        results[len(results)] = _compare(record, tests.outputs[len(results)], tests.fn_name is not None)
        if "error" in record:
            return results, "not run (an earlier test failed)", ""
    if len(results) == n and ex.exit_code == 0 and not ex.timed_out:
        return results, "", "the run ended without the runner's last record"
    if ex.exit_code == 0 and not ex.timed_out and not cut:
        return results, "", "the run ended before every test ran, with exit code 0"
    return results, "", ""


def run_tests(program: str, tests: CodeTests, sandbox, time_limit_s: float = TIME_LIMIT_S) -> list[TestResult]:
    """Every test of one program, in one sandbox call, as the harness runs them; compared here."""
    n = len(tests.inputs)
    spec = {
        "code": program,
        "inputs": tests.inputs,
        "fn": tests.fn_name,
        "prelude": PRELUDE,
        "time_limit": time_limit_s,
        "digits": INT_MAX_STR_DIGITS,
        "output_limit": OUTPUT_LIMIT_MB * 2**20,
        "guarded_os": _GUARDED_OS,
        "guarded_modules": _GUARDED_MODULES,
    }
    ex = sandbox.execute(
        RUNNER.replace("__SPEC__", repr(json.dumps(spec)), 1),
        timeout_s=(math.ceil(time_limit_s) + 1) * n + 5,
        memory_mb=MEMORY_MB,
        max_file_mb=OUTPUT_LIMIT_MB,
        output_chars=OUTPUT_LIMIT_MB * 2**20,
    )
    if ex.infra_error is not None:  # never blamed on the program: the reward says so (reward_error)
        raise RuntimeError(f"the sandbox could not run the tests: {ex.infra_error}")
    results, ended, forged = _read_channel(ex, tests)
    if forged:  # the program wrote on the channel itself: nothing it says can be trusted
        return [TestResult(False, f"the program wrote on the scorer's channel ({forged})")] * n
    if not ended:
        if getattr(ex, "stdout_bytes", 0) >= OUTPUT_LIMIT_MB * 2**20 or "File too large" in ex.stderr:
            ended = "output limit exceeded"
        elif ex.timed_out:
            ended = "time limit exceeded"
        else:
            ended = f"no result (the run ended with exit code {ex.exit_code})"
    return [results.get(i) or TestResult(False, ended) for i in range(n)]


def judge(response_text: str, ground_truth: str, sandbox, time_limit_s: float = TIME_LIMIT_S) -> Verdict:
    """Share of tests passed (1.0: solved as LiveCodeBench counts it) and why not all; −1 without a code block;
    0 with the reason when the tests cannot be decoded (the program is never run)."""
    program = extract_code(response_text)
    if not program.strip():
        return Verdict(-1.0, "no code block")
    try:
        tests = parse_tests(ground_truth)
        if not tests.inputs:
            raise LCBFormatError("no tests")
        for i, want in enumerate(tests.outputs if tests.fn_name is not None else ()):
            try:  # the harness reads every expected output before it runs a call-based program
                expected_value(want)
            except ValueError as e:
                raise LCBFormatError(f"the output of test {i + 1} is not JSON ({e})") from None
    except LCBFormatError as e:
        return Verdict(0.0, f"tests cannot be decoded: {e}")
    results = run_tests(program, tests, sandbox, time_limit_s)
    failed = next(((i, r) for i, r in enumerate(results) if not r.passed), None)
    reason = "" if failed is None else f"test {failed[0] + 1} of {len(results)}: {failed[1].why}"
    return Verdict(sum(r.passed for r in results) / len(results), reason, results)


def score(response_text: str, ground_truth: str, sandbox) -> float:
    """judge()'s score: the training reward of a code task and its eval score."""
    return judge(response_text, ground_truth, sandbox).score


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
