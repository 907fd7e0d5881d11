"""The house rules that keep the code readable as it grows (README, architecture):

1. Imports follow the data, floor by floor: storage/ → pipeline/ → the three stages (rollout_gen/,
   purifier/, trainer/: siblings, none imports another) → flows/. No import points up or sideways,
   including imports inside functions, and no module imports itself back through another (no cycle).
2. The row schemas (storage/schemas.py) and the data model's dataclasses (pipeline/trajectory.py)
   agree field for field: names, order, and kind of value.
"""

from __future__ import annotations

import ast
import dataclasses
import types
import typing
from pathlib import Path

import pyarrow as pa
import pytest

from pipeline import trajectory as model
from storage import schemas

ROOT = Path(__file__).resolve().parent.parent
FLOOR = {"storage": 0, "pipeline": 1, "rollout_gen": 2, "purifier": 2, "trainer": 2, "flows": 3}


def _modules() -> dict[str, Path]:
    out = {}
    for package in FLOOR:
        for path in sorted((ROOT / package).rglob("*.py")):
            parts = path.relative_to(ROOT).with_suffix("").parts
            out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return out


def _imports(path: Path) -> list[tuple[int, str]]:
    """Every first-party module a file imports, at any depth of the file (functions included)."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.append((node.lineno, node.module))
    return [(line, name) for line, name in found if name.split(".")[0] in FLOOR]


def test_imports_point_down_only():
    wrong = []
    for name, path in _modules().items():
        here = name.split(".")[0]
        for line, target in _imports(path):
            there = target.split(".")[0]
            if there != here and FLOOR[there] >= FLOOR[here]:
                wrong.append(
                    f"{path.relative_to(ROOT)}:{line}: {here} (floor {FLOOR[here]}) imports {target} "
                    f"(floor {FLOOR[there]})"
                )
    assert not wrong, "imports that point up or sideways:\n" + "\n".join(wrong)


def test_no_import_cycles():
    modules = _modules()
    graph = {m: {t for _, t in _imports(p) if t in modules and t != m} for m, p in modules.items()}
    state: dict[str, int] = {}  # 1 = on the current path, 2 = done
    cycles = []

    def visit(m: str, path: list[str]) -> None:
        state[m] = 1
        for t in sorted(graph[m]):
            if state.get(t) == 1:
                cycles.append(" → ".join(path[path.index(t) :] + [m, t]) if t in path else f"{m} → {t}")
            elif t not in state:
                visit(t, path + [m])
        state[m] = 2

    for m in sorted(graph):
        if m not in state:
            visit(m, [])
    assert not cycles, "import cycles:\n" + "\n".join(cycles)


def test_the_floor_check_sees_violations(tmp_path):
    """The checks above are not vacuous: a stage importing a sibling, and an import in a function, are found."""
    bad = tmp_path / "bad.py"
    bad.write_text("import os\nfrom trainer.grpo import GRPOUpdate\n\ndef f():\n    from flows.cli import main\n")
    assert _imports(bad) == [(2, "trainer.grpo"), (5, "flows.cli")]


# -- schemas vs dataclasses --------------------------------------------------------------------------

PAIRS = [
    (model.ToolResult, schemas.TOOL_RESULT),
    (model.Attempt, schemas.ATTEMPT),
    (model.Position, schemas.POSITION),
    (model.TrajectoryStats, schemas.STATS),
    (model.Splice, schemas.SPLICE),
    (model.Trajectory, schemas.RAW),
    (model.PurifiedTrajectory, schemas.PURIFIED),
]


def _arrow_fields(t: pa.DataType | pa.Schema) -> list[pa.Field]:
    return list(t) if isinstance(t, pa.Schema) else [t.field(i) for i in range(t.num_fields)]


def _agrees(hint, arrow: pa.DataType) -> bool:
    """Whether a dataclass field's type holds what the Arrow column holds (None allowed either way)."""
    args = [a for a in typing.get_args(hint) if a is not type(None)]
    if isinstance(hint, types.UnionType) or typing.get_origin(hint) is typing.Union:
        return len(args) == 1 and _agrees(args[0], arrow)
    if typing.get_origin(hint) is typing.Literal:
        return pa.types.is_string(arrow) and all(isinstance(a, str) for a in typing.get_args(hint))
    if typing.get_origin(hint) is list:
        return pa.types.is_list(arrow) and _agrees(args[0], arrow.value_type)
    if dataclasses.is_dataclass(hint):
        return pa.types.is_struct(arrow) and [f.name for f in dataclasses.fields(hint)] == [
            f.name for f in _arrow_fields(arrow)
        ]
    return {bool: pa.types.is_boolean, int: pa.types.is_integer, float: pa.types.is_floating, str: pa.types.is_string}[
        hint
    ](arrow)


@pytest.mark.parametrize("cls,arrow", PAIRS, ids=[c.__name__ for c, _ in PAIRS])
def test_schema_and_dataclass_agree_field_for_field(cls, arrow):
    hints = typing.get_type_hints(cls)
    ours = [(f.name, hints[f.name]) for f in dataclasses.fields(cls)]
    theirs = _arrow_fields(arrow)
    assert [n for n, _ in ours] == [f.name for f in theirs]
    wrong = [f"{n}: {h} vs {f.type}" for (n, h), f in zip(ours, theirs) if not _agrees(h, f.type)]
    assert not wrong, wrong
