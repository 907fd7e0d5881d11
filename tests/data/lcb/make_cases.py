"""Builds cases.json: (problem, program) pairs with the verdicts of LiveCodeBench's own harness.

Run from a checkout of github.com/LiveCodeBench/LiveCodeBench (commit in README.md) on the path, with numpy:
    PYTHONPATH=/path/to/LiveCodeBench python tests/data/lcb/make_cases.py
It calls the harness's evaluate_generations_by_problem (lcb_runner/evaluation/compute_code_generation_metrics.py,
what codegen_metrics runs per problem) with its default 6 s time limit on every case and writes the per-test
results it returns. Tests never run this file.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

SUM = {"inputs": ["3\n1 2 3\n", "2\n10 20\n"], "outputs": ["6\n", "30\n"]}
PAIRS = {"inputs": ["1 2\n3 4\n", "5 5\n0 0\n"], "outputs": ["3\n7\n", "10\n0\n"]}
ECHO = {"inputs": ["hello\n"], "outputs": ["hello\n"]}
HALF = {"inputs": ["1\n", "3\n"], "outputs": ["0.5\n", "1.5\n"]}
WORDS = {"inputs": ["2\n"], "outputs": ["YES\n\n1 2\n"]}
BIG = {"inputs": ["10000\n"], "outputs": ["1" + "0" * 10000 + "\n"]}
TOP = {"inputs": ["[3, 1, 2]\n2", "[5, 4]\n1"], "outputs": ["[3, 2]", "[5]"], "fn_name": "top"}
PAIRS_CALL = {"inputs": ["[1, 2]", "[3, 4]"], "outputs": ["[[1, 2]]", "[[3, 4]]"], "fn_name": "wrap"}
COUNT = {"inputs": ["1", "2"], "outputs": ["1", "2"], "fn_name": "calls"}
TRUTH = {"inputs": ["4"], "outputs": ["true"], "fn_name": "even"}
FLOAT = {"inputs": ["0.1\n0.2"], "outputs": ["0.3"], "fn_name": "add"}
HUGE = {"inputs": ["4000"], "outputs": ["1" + "0" * 4000], "fn_name": "power"}

CASES = [
    # the harness's stand-in for standard input
    ("stdin", "input() per line", SUM, "n = int(input())\nprint(sum(map(int, input().split())))"),
    (
        "stdin",
        "for line in sys.stdin (the stand-in is not iterable)",
        PAIRS,
        "import sys\nfor line in sys.stdin:\n    a, b = map(int, line.split())\n    print(a + b)",
    ),
    (
        "stdin",
        "sys.stdin.buffer.read()",
        SUM,
        "import sys\ndata = sys.stdin.buffer.read().split()\nprint(sum(map(int, data[1:])))",
    ),
    (
        "stdin",
        "sys.stdin.buffer.readline() returns the first line every time",
        SUM,
        "import sys\nn = int(sys.stdin.buffer.readline())\nprint(sum(map(int, sys.stdin.buffer.readline().split())))",
    ),
    (
        "stdin",
        "sys.stdin.readline() keeps its newline",
        SUM,
        "import sys\nn = int(sys.stdin.readline())\nxs = sys.stdin.readline().split()\nprint(sum(map(int, xs)))",
    ),
    (
        "stdin",
        "input = sys.stdin.readline at top level",
        PAIRS,
        "import sys\ninput = sys.stdin.readline\nfor _ in range(2):\n    a, b = map(int, input().split())\n"
        "    print(a + b)",
    ),
    (
        "stdin",
        "readlines() splits on newlines: a trailing empty line",
        PAIRS,
        "import sys\nfor line in sys.stdin.readlines():\n    a, b = map(int, line.split())\n    print(a + b)",
    ),
    (
        "stdin",
        "readlines() without the empty last line",
        PAIRS,
        "import sys\nfor line in sys.stdin.readlines():\n    if line:\n        a, b = map(int, line.split())\n"
        "        print(a + b)",
    ),
    (
        "stdin",
        "from sys import stdin: readline() without its newline",
        SUM,
        "from sys import stdin\nn = int(stdin.readline())\nprint(sum(map(int, stdin.readline().split())))",
    ),
    (
        "stdin",
        "from sys import stdin: readline() text compared with its newline",
        ECHO,
        "from sys import stdin\ns = stdin.readline()\nprint(s.endswith(chr(10)) and 'newline' or s)",
    ),
    (
        "stdin",
        "from sys import stdin: read()",
        SUM,
        "from sys import stdin\nprint(sum(map(int, stdin.read().split()[1:])))",
    ),
    (
        "stdin",
        "from sys import stdin: iterating it reads nothing",
        PAIRS,
        "from sys import stdin\nfor line in stdin:\n    a, b = map(int, line.split())\n    print(a + b)",
    ),
    (
        "stdin",
        "read() after readline() returns everything again",
        SUM,
        "import sys\nn = int(sys.stdin.readline())\nprint(sum(map(int, sys.stdin.read().split())))",
    ),
    (
        "stdin",
        "read() after readline(), skipping what was read",
        SUM,
        "import sys\nn = int(sys.stdin.readline())\nprint(sum(map(int, sys.stdin.read().split()[1:])))",
    ),
    (
        "stdin",
        "open(0).read() is the prelude's open, not the stand-in",
        SUM,
        "data = open(0).read().split()\nprint(sum(map(int, data[1:])))",
    ),
    (
        "stdin",
        "builtins.open is the stand-in",
        SUM,
        "import builtins\ndata = builtins.open(0).read().split()\nprint(sum(map(int, data[1:])))",
    ),
    ("stdin", "input() past the end", SUM, "while True:\n    print(input())"),
    ("stdin", "sys.stdin.read().split()", SUM, "import sys\nprint(sum(map(int, sys.stdin.read().split()[1:])))"),
    # standard output
    (
        "stdout",
        "from sys import stdout: not captured",
        SUM,
        "from sys import stdout\nn = int(input())\nstdout.write(str(sum(map(int, input().split()))) + '\\n')",
    ),
    (
        "stdout",
        "sys.stdout.write",
        SUM,
        "import sys\nn = int(input())\nsys.stdout.write(str(sum(map(int, input().split()))) + '\\n')",
    ),
    (
        "stdout",
        "sys.stdout.buffer does not exist",
        SUM,
        "import sys\nn = int(input())\nsys.stdout.buffer.write(str(sum(map(int, input().split()))).encode())",
    ),
    (
        "stdout",
        "print to stderr is not output",
        SUM,
        "import sys\nn = int(input())\nprint(sum(map(int, input().split())), file=sys.stderr)",
    ),
    (
        "stdout",
        "os.write(1) is not output",
        SUM,
        "import os\nn = int(input())\nos.write(1, (str(sum(map(int, input().split()))) + '\\n').encode())",
    ),
    (
        "stdout",
        "sys.stdout.close() takes an argument",
        SUM,
        "import sys\nn = int(input())\nprint(sum(map(int, input().split())))\nsys.stdout.close()",
    ),
    # quit / exit
    ("exit", "quit() is None", SUM, "n = int(input())\nprint(sum(map(int, input().split())))\nquit()"),
    ("exit", "exit() after the answer", SUM, "n = int(input())\nprint(sum(map(int, input().split())))\nexit()"),
    (
        "exit",
        "sys.exit(0) after the answer",
        SUM,
        "import sys\nn = int(input())\nprint(sum(map(int, input().split())))\nsys.exit(0)",
    ),
    (
        "exit",
        "sys.exit(1) after the answer",
        SUM,
        "import sys\nn = int(input())\nprint(sum(map(int, input().split())))\nsys.exit(1)",
    ),
    (
        "exit",
        "os._exit after the answer",
        SUM,
        "import os, sys\nn = int(input())\nprint(sum(map(int, input().split())))\nsys.stdout.flush()\nos._exit(0)",
    ),
    # the program wrapped in a function
    (
        "wrap",
        "global in a helper names a top-level variable",
        SUM,
        "total = 0\ndef add(x):\n    global total\n    total += x\nn = int(input())\nfor v in input().split():\n"
        "    add(int(v))\nprint(total)",
    ),
    (
        "wrap",
        "nonlocal in a helper names a top-level variable",
        SUM,
        "total = 0\ndef add(x):\n    nonlocal total\n    total += x\nn = int(input())\nfor v in input().split():\n"
        "    add(int(v))\nprint(total)",
    ),
    (
        "wrap",
        "a top-level return",
        SUM,
        "n = int(input())\nprint(sum(map(int, input().split())))\nreturn\nprint('never')",
    ),
    (
        "wrap",
        "if __name__ == '__main__' last",
        SUM,
        'def main():\n    n = int(input())\n    print(sum(map(int, input().split())))\n\nif __name__ == "__main__":\n'
        "    main()",
    ),
    (
        "wrap",
        "if __name__ == '__main__' not last",
        SUM,
        "def main():\n    n = int(input())\n    print(sum(map(int, input().split())))\n\nif __name__ == '__main__':\n"
        "    main()\n\nLIMIT = 10",
    ),
    (
        "wrap",
        "from __future__ import annotations",
        SUM,
        "from __future__ import annotations\nn = int(input())\nprint(sum(map(int, input().split())))",
    ),
    (
        "wrap",
        "class Solution in a stdin program",
        SUM,
        "class Solution:\n    pass\nn = int(input())\nprint(sum(map(int, input().split())))",
    ),
    (
        "wrap",
        "the prelude's names without imports",
        SUM,
        "n = int(input())\nxs = list(map(int, input().split()))\nprint(reduce(add, xs))",
    ),
    ("wrap", "a syntax error", SUM, "n = int(input()\nprint(n)"),
    (
        "wrap",
        "deep recursion under the prelude's recursion limit",
        SUM,
        "def f(k):\n    return 0 if k == 0 else 1 + f(k - 1)\nn = int(input())\nxs = input().split()\n"
        "print(sum(map(int, xs)) + f(20000) - 20000)",
    ),
    (
        "wrap",
        "a thread with a large stack, joined",
        SUM,
        "import threading\ndef main():\n    n = int(input())\n    print(sum(map(int, input().split())))\n"
        "threading.stack_size(1 << 26)\nt = threading.Thread(target=main)\nt.start()\nt.join()",
    ),
    (
        "wrap",
        "a name the guard removed: os.getcwd",
        SUM,
        "import os\nos.getcwd()\nn = int(input())\nprint(sum(map(int, input().split())))",
    ),
    (
        "wrap",
        "os.fork is removed",
        SUM,
        "import os\nn = int(input())\nif os.fork() == 0:\n    pass\nprint(sum(map(int, input().split())))",
    ),
    # limits
    (
        "limits",
        "600 MB of memory",
        SUM,
        "block = bytearray(600 * 2**20)\nn = int(input())\nprint(sum(map(int, input().split())))",
    ),
    ("limits", "an integer of 10,001 digits printed", BIG, "print(10 ** int(input()))"),
    ("limits", "4.5 s per test (within 6 s)", ECHO, "import time\ntime.sleep(4.5)\nprint(input())"),
    ("limits", "an endless loop", ECHO, "s = input()\nwhile True:\n    pass"),
    # output comparison
    ("compare", "decimals compared as numbers", HALF, "n = int(input())\nprint(f'{n / 2:.4f}')"),
    ("compare", "exponent notation equals as a Decimal", HALF, "n = int(input())\nprint(f'{n * 5}e-1')"),
    ("compare", "decimals that differ", HALF, "n = int(input())\nprint(f'{n / 2 + 1e-7:.7f}')"),
    (
        "compare",
        "trailing spaces and blank lines",
        PAIRS,
        "import sys\nfor _ in range(2):\n    a, b = map(int, input().split())\n"
        "    print(a + b, '  ')\nprint()\nprint()",
    ),
    ("compare", "a blank line inside the output counts", WORDS, "input()\nprint('YES')\nprint()\nprint(1, 2)"),
    ("compare", "a missing blank line inside the output", WORDS, "input()\nprint('YES')\nprint(1, 2)"),
    ("compare", "case differs", WORDS, "input()\nprint('Yes')\nprint()\nprint(1, 2)"),
    ("compare", "spaces inside a line: equal as numbers", WORDS, "input()\nprint('YES')\nprint()\nprint('1  2')"),
    # call-based
    (
        "call",
        "a tuple result counts as a list",
        TOP,
        "class Solution:\n    def top(self, nums, k):\n        return tuple(sorted(nums, reverse=True)[:k])",
    ),
    (
        "call",
        "the module's function without a class",
        TOP,
        "def top(nums, k):\n    return sorted(nums, reverse=True)[:k]",
    ),
    (
        "call",
        "a nested tuple is not a list",
        PAIRS_CALL,
        "class Solution:\n    def wrap(self, xs):\n        return [tuple(xs)]",
    ),
    (
        "call",
        "one Solution() for every test",
        COUNT,
        "class Solution:\n    def __init__(self):\n        self.n = 0\n    def calls(self, k):\n        self.n += 1\n"
        "        return self.n",
    ),
    (
        "call",
        "state on the instance breaks a later test",
        COUNT,
        "class Solution:\n    seen = []\n    def calls(self, k):\n        self.seen.append(k)\n"
        "        return len(self.seen) * k",
    ),
    (
        "call",
        "no method of that name",
        TOP,
        "class Solution:\n    def best(self, nums, k):\n        return sorted(nums, reverse=True)[:k]",
    ),
    ("call", "1 equals true", TRUTH, "class Solution:\n    def even(self, n):\n        return 1"),
    ("call", "floats compared exactly", FLOAT, "class Solution:\n    def add(self, a, b):\n        return a + b"),
    ("call", "an int equal to a float", COUNT, "class Solution:\n    def calls(self, k):\n        return float(k)"),
    (
        "call",
        "a set is not a list",
        TOP,
        "class Solution:\n    def top(self, nums, k):\n        return set(sorted(nums, reverse=True)[:k])",
    ),
    ("call", "a 4,001-digit integer", HUGE, "class Solution:\n    def power(self, k):\n        return 10 ** k"),
    (
        "call",
        "numpy integers",
        TOP,
        "import numpy as np\nclass Solution:\n    def top(self, nums, k):\n"
        "        return [np.int64(x) for x in sorted(nums, reverse=True)[:k]]",
    ),
    ("call", "a runtime error", TOP, "class Solution:\n    def top(self, nums, k):\n        return nums[10]"),
    (
        "call",
        "from __future__ import annotations",
        TOP,
        "from __future__ import annotations\nclass Solution:\n"
        "    def top(self, nums: list[int], k: int) -> list[int]:\n"
        "        return sorted(nums, reverse=True)[:k]",
    ),
    (
        "call",
        "printing does not matter",
        TOP,
        "class Solution:\n    def top(self, nums, k):\n        print('debug', nums)\n"
        "        return sorted(nums)[::-1][:k]",
    ),
    ("call", "exit() inside the method", TOP, "class Solution:\n    def top(self, nums, k):\n        exit()"),
    (
        "call",
        "an endless loop",
        TOP,
        "class Solution:\n    def top(self, nums, k):\n        while True:\n            pass",
    ),
    (
        "call",
        "quit is None at module level too",
        TOP,
        "class Solution:\n    def top(self, nums, k):\n"
        "        return sorted(nums, reverse=True)[:k] if quit is None else []",
    ),
]

# Where cleaner's scorer knowingly differs from the harness (docs/eval.md): name -> why.
KNOWN_DIFFERENCES = {
    "an object whose __eq__ says yes": "a return value that is not plain data fails here; the harness calls its "
    "__eq__, so a program could forge a pass there",
}
KNOWN_DIFFERENCES.update(
    {
        "a numpy array of one element": "a numpy array is not plain data here; the harness's == gives a one-element "
        "array, which it takes as true",
        "writing a file outside the working directory": "the sandbox refuses writes outside the call's directory; "
        "the harness's process may write anywhere its user can",
    }
)
CASES += [
    (
        "call",
        "an object whose __eq__ says yes",
        TOP,
        "class Yes:\n    def __eq__(self, other):\n        return True\nclass Solution:\n"
        "    def top(self, nums, k):\n        return Yes()",
    ),
    (
        "call",
        "a numpy array of one element",
        {"inputs": ["[3, 1, 2]\n1"], "outputs": ["[3]"], "fn_name": "top"},
        "import numpy as np\nclass Solution:\n    def top(self, nums, k):\n"
        "        return np.array(sorted(nums, reverse=True)[:k])",
    ),
    (
        "wrap",
        "writing a file outside the working directory",
        SUM,
        "with open('/tmp/lcb_case_scratch.txt', 'w') as f:\n    f.write('x')\nn = int(input())\n"
        "print(sum(map(int, input().split())))",
    ),
]


COUNTS = {"inputs": ['"aab"'], "outputs": ['{"a": 2, "b": 1}'], "fn_name": "counts"}
SAME = {"inputs": ['"ab"'], "outputs": ['"ab"'], "fn_name": "same"}
CASES += [
    (
        "limits",
        "a time-out caught, then the answer printed",
        ECHO,
        "s = input()\ntry:\n    while True:\n        pass\nexcept Exception:\n    pass\nprint(s)",
    ),
    (
        "call",
        "a Counter returned",
        COUNTS,
        "from collections import Counter\nclass Solution:\n    def counts(self, s):\n        return Counter(s)",
    ),
    (
        "call",
        "a defaultdict returned",
        COUNTS,
        "from collections import defaultdict\nclass Solution:\n    def counts(self, s):\n"
        "        d = defaultdict(int)\n        for c in s:\n            d[c] += 1\n        return d",
    ),
    (
        "call",
        "an IntEnum member returned",
        {"inputs": ["1"], "outputs": ["3"], "fn_name": "pick"},
        "from enum import IntEnum\nclass E(IntEnum):\n    A = 3\nclass Solution:\n    def pick(self, k):\n"
        "        return E.A",
    ),
    (
        "call",
        "a str subclass returned",
        SAME,
        "class S(str):\n    pass\nclass Solution:\n    def same(self, s):\n        return S(s)",
    ),
    (
        "call",
        "a list subclass inside a list",
        PAIRS_CALL,
        "class L(list):\n    pass\nclass Solution:\n    def wrap(self, xs):\n        return [L(xs)]",
    ),
    (
        "call",
        "a str subclass that is another string, whose __eq__ says yes",
        SAME,
        "class S(str):\n    __hash__ = str.__hash__\n    def __eq__(self, other):\n        return True\n"
        "class Solution:\n    def same(self, s):\n        return S('zz')",
    ),
    (
        "call",
        "a Fraction returned",
        {"inputs": ["1\n2"], "outputs": ["0.5"], "fn_name": "ratio"},
        "from fractions import Fraction\nclass Solution:\n    def ratio(self, a, b):\n        return Fraction(a, b)",
    ),
    (
        "stdin",
        "an empty fn_name",
        {"inputs": ["1 2\n"], "outputs": ["3\n"], "fn_name": ""},
        "a, b = map(int, input().split())\nprint(a + b)",
    ),
]
CASES += [
    (
        "call",
        "a list subclass whose __iter__ lies",
        PAIRS_CALL,
        "class L(list):\n    def __iter__(self):\n        return iter([0, 0])\nclass Solution:\n"
        "    def wrap(self, xs):\n        return [L(xs)]",
    ),
    (
        "call",
        "a dict subclass whose keys and items lie",
        COUNTS,
        "from collections import Counter\nclass D(dict):\n    def __iter__(self):\n        return iter(['z'])\n"
        "    def keys(self):\n        return ['z']\n    def items(self):\n        return [('z', 0)]\n"
        "    def __getitem__(self, k):\n        return 0\nclass Solution:\n    def counts(self, s):\n"
        "        return D(Counter(s))",
    ),
    (
        "call",
        "a str subclass whose __str__ lies",
        SAME,
        "class S(str):\n    def __str__(self):\n        return 'zz'\nclass Solution:\n    def same(self, s):\n"
        "        return S(s)",
    ),
    (
        "call",
        "an object whose __class__ says list",
        TOP,
        "class X:\n    @property\n    def __class__(self):\n        return list\nclass Solution:\n"
        "    def top(self, nums, k):\n        return X()",
    ),
]
KNOWN_DIFFERENCES.update(
    {
        "a str subclass that is another string, whose __eq__ says yes": "a subclass of a builtin type counts as the "
        "value it holds here; the harness calls its __eq__, so a program could forge a pass there",
        "a Fraction returned": "a value of no builtin type (Fraction, Decimal, an Enum of no builtin type) is not "
        "plain data here; the harness's == finds Fraction(1, 2) equal to 0.5",
        "an empty fn_name": "an empty fn_name is a stdin problem here (LiveCodeBench's loader never writes one); the "
        "harness tests `is None`, grades it as call-based, and the module-level input() fails",
    }
)


def main() -> None:
    from lcb_runner.evaluation.compute_code_generation_metrics import evaluate_generations_by_problem

    out = []
    for i, (cls, name, problem, program) in enumerate(CASES):
        (results,), (meta,) = evaluate_generations_by_problem(
            ([program], {"input_output": json.dumps(problem)}, False, 6)
        )
        results = [bool(r) if r is True or r is False else int(r) for r in results]
        passed = len(results) == len(problem["inputs"]) and all(r is True for r in results)
        out.append(
            {
                "id": i,
                "class": cls,
                "name": name,
                "problem": problem,
                "program": program,
                "harness": {"results": results, "passed": passed, "error_message": meta.get("error_message", "")},
                "known_difference": KNOWN_DIFFERENCES.get(name, ""),
            }
        )
        print(f"{i:3d} {cls:8s} {'PASS' if passed else 'fail'} {results} {name}", file=sys.stderr)
    path = Path(__file__).with_name("cases.json")
    path.write_text(json.dumps(out, indent=1) + "\n")


if __name__ == "__main__":
    main()
