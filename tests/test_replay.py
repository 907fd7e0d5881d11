"""`cleaner replay` on a real rollout of the tiny policy (flows/replay_cmd.py): `--sweep` prints a
table over γ = 0.00..1.00 step 0.05, a similarity histogram, example pairs, and writes a PNG, from the
stored raw shard only (nothing regenerated, no partition written, the raw shard byte-identical); a
replay at given γ writes partitions beside the others, and another measure gets its own partition."""

from __future__ import annotations

import os
import re

import pytest

from purifier.replay import sweep_gammas
from flows.replay_cmd import run_replay
from storage.layout import RunLayout


@pytest.fixture()
def run(world_copy):
    return world_copy


def _snapshot(d):
    """Every byte of the shards under d; the verification records (storage/verified.py) are a cache of which
    parts were checked, refreshed when a copied store is first read, not shard data."""
    from storage.verified import RECORD

    return {p.relative_to(d): p.read_bytes() for p in sorted(d.rglob("*")) if p.is_file() and p.name != RECORD}


def _table_rows(out: str) -> list[list[int | float]]:
    """The sweep table's data rows: γ, positions, shallow, deep, removed, recomputed, ≠ lived, ≠ reference."""
    rows = []
    for line in out.splitlines():
        cells = [c.strip() for c in line.split("│")[1:-1]]
        if len(cells) == 8 and re.fullmatch(r"[0-9.]+", cells[0]):
            rows.append([float(cells[0]), *map(int, cells[1:])])
    return rows


def test_sweep_prints_table_histogram_examples_and_plot_without_writing_partitions(run, capsys):
    layout = RunLayout(run.storage.root, "w")
    before = _snapshot(layout.run_dir)
    assert run_replay(run, "w", 0, sweep=True) == 0
    out = capsys.readouterr().out

    rows = _table_rows(out)
    assert [r[0] for r in rows] == pytest.approx(sweep_gammas()) and len(rows) == 21
    assert rows[0][0] == 0.0 and rows[-1][0] == 1.0
    splices = {r[2] + r[3] for r in rows}
    assert len(splices) == 1 and splices.pop() > 0  # every γ decides the same splices, shallow or deep
    shallow = [r[2] for r in rows]
    assert shallow == sorted(shallow, reverse=True)  # raising γ only turns shallow into deep
    assert rows[0][3] == 0  # γ=0: nothing is below it
    lived = next(r for r in rows if r[0] == pytest.approx(run.rollout.saar.gamma_live))
    assert lived[6] == 0  # at γ_live with the live measure every decision is the one lived

    hist = [ln for ln in out.splitlines() if "│" in ln and "–" in ln.split("│")[0]]
    assert len(hist) == 20
    assert sum(int(ln.rsplit("│", 1)[1].split()[0]) for ln in hist) == rows[0][2] + rows[0][3]
    assert "← γ=" in out and "old: " in out and "new: " in out
    # each example pair shows where its calls differ, not the JSON prefix every call starts with
    pairs = [(o, n) for o, n in re.findall(r"old: (.*)\n +new: (.*)", out) if o != n]
    assert pairs, out
    for old, new in pairs:
        assert len(os.path.commonprefix([old, new])) <= 20, (old, new)

    png = next(ln.split("plot: ", 1)[1].strip() for ln in out.splitlines() if ln.startswith("plot: "))
    written = layout.run_dir / "report" / png.rsplit("/", 1)[-1]
    assert png == str(written)
    assert written.is_file() and written.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    after = _snapshot(layout.run_dir)
    assert {k: v for k, v in after.items() if k.parts[0] != "report"} == before  # raw untouched, no partitions


def test_replay_at_gammas_writes_partitions_and_other_measure_beside_default(run, capsys):
    layout = RunLayout(run.storage.root, "w")
    raw_before = _snapshot(layout.raw_dir(0))
    assert run_replay(run, "w", 0, gammas=[0.9], modes=["saar"]) == 0
    rows = _table_rows(capsys.readouterr().out)
    assert [r[0] for r in rows] == [0.9]
    assert layout.purified_dir(0, "saar", 0.9).is_dir()

    other = run.model_copy(deep=True)
    other.rollout.saar.similarity = "difflib"  # a replay under another measure than the run lived with
    assert run_replay(other, "w", 0, gammas=[0.9], modes=["saar"]) == 0
    ref_rows = _table_rows(capsys.readouterr().out)
    assert ref_rows[0][7] == 0  # the reference measure agrees with itself
    names = sorted(
        p.name for p in layout.purified_dir(0, "saar", 0.9).parent.iterdir() if p.name.startswith("gamma=0.90")
    )
    assert names == ["gamma=0.90", "gamma=0.90-difflib-segment"]
    assert _snapshot(layout.raw_dir(0)) == raw_before


def test_replay_names_the_lived_measure_from_what_the_run_recorded(run, capsys):
    """A run without run.json: the lived measure comes from the raw shard's manifest, not from the replay's command
    line; a shard that records nothing (written before the record existed) is said to be unknown."""
    import json

    from storage.shards import MANIFEST

    layout = RunLayout(run.storage.root, "w")
    assert not layout.run_json.exists()
    other = run.model_copy(deep=True)
    other.rollout.saar.similarity = "difflib"
    assert run_replay(other, "w", 0, gammas=[0.5], modes=["saar"], sweep=True) == 0
    out = " ".join(capsys.readouterr().out.split())  # the table's title wraps
    assert "lived with rapidfuzz-segment at γ_live=0.5" in out and "lived with difflib" not in out

    manifest = layout.raw_dir(0) / MANIFEST
    data = json.loads(manifest.read_text())
    del data["extra"]["saar"]  # as a shard written before the rollout recorded its SAAR settings
    manifest.write_text(json.dumps(data))
    assert run_replay(other, "w", 0, gammas=[0.5], modes=["saar"], sweep=True) == 0
    out = capsys.readouterr().out
    flat = " ".join(out.split())
    assert "lived settings unknown" in flat and "lived with" not in flat
    assert _cells(out) and all(row[6] == "–" for row in _cells(out))


def _cells(out: str) -> list[list[str]]:
    return [
        cells
        for line in out.splitlines()
        if len(cells := [c.strip() for c in line.split("│")[1:-1]]) == 8 and re.fullmatch(r"[0-9.]+", cells[0])
    ]


def test_sweep_with_saar_is_prints_the_gamma_section_whole_before_the_tau_section(run, capsys):
    """`--mode saar_is --sweep`: the γ table, similarity histogram, examples and plot line come together, then the
    τ section; the γ histogram and plot were printed after the τ table, which split the γ output around it."""
    assert run_replay(run, "w", 0, modes=["saar_is"], sweep=True) == 0
    out = capsys.readouterr().out
    gamma_table = out.index("shallow + deep: the splices")
    gamma_histogram = out.index("splice candidates as lived")
    gamma_plot = out.index("plot: ")
    tau_section = out.index("saar_is (Plan B)")
    assert gamma_table < gamma_histogram < gamma_plot < tau_section


def test_replay_plot_draws_every_curve_visibly_and_no_lived_curve_without_a_lived_gamma():
    """Curves that coincide stay visible (each its own line style and marker: "deep" was drawn under "≠ lived
    decision", identical below γ_live); a run that lived no γ gets no γ_live line and no "≠ lived" curve."""
    import matplotlib.pyplot as plt

    from purifier.replay import ReplayStats, replay_figure

    stats = [ReplayStats(gamma=g, shallow=5 - i, deep=i, differ_from_live=i) for i, g in enumerate([0.0, 0.25, 0.5])]
    fig = replay_figure([], stats, 0.5, "t")
    hist, decisions = fig.axes
    lines = decisions.get_lines()
    assert [ln.get_label() for ln in lines] == ["shallow", "deep", "≠ lived decision", "≠ reference measure"]
    looks = {(ln.get_linestyle(), ln.get_marker()) for ln in lines}
    assert len(looks) == len(lines)
    assert [ln.get_label() for ln in hist.get_lines()] == ["γ_live=0.5"]
    plt.close(fig)

    fig = replay_figure([], stats, None, "t")
    hist, decisions = fig.axes
    assert [ln.get_label() for ln in decisions.get_lines()] == ["shallow", "deep", "≠ reference measure"]
    assert hist.get_lines() == [] and hist.get_legend() is None
    plt.close(fig)
