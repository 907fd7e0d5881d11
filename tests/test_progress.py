"""One progress indication per stage: a bar on a terminal, lines elsewhere, never on stdout."""

from __future__ import annotations

from pipeline.progress import StageProgress


def test_lines_start_every_interval_and_end_through_the_given_log():
    lines: list[str] = []
    with StageProgress("rollout it 3", "trajectories", 4, log=lines.append, every_s=0) as bar:
        for done in range(1, 5):
            bar.update(done, note=f"{4 - done} active")
    assert lines[0] == "[rollout it 3] 4 trajectories to go"
    assert lines[1].startswith("[rollout it 3] 1/4 trajectories (25%), ") and lines[1].endswith(", 3 active")
    assert len(lines) == 5  # start, three intermediate (the last update is the end line's), end
    assert lines[-1].startswith("[rollout it 3] 4/4 trajectories (100%) in ")


def test_bar_shows_the_stage_and_note_on_stderr_never_stdout(capsys):
    with StageProgress("purify it 0", "rows", 2, bar=True) as bar:
        bar.update(2, note="[2 active]")  # brackets are text, not rich markup
    out = capsys.readouterr()
    assert out.out == ""
    assert "[purify it 0]" in out.err and "2/2" in out.err and "[2 active]" in out.err


def test_one_of_a_unit_is_singular():
    """An update of one mini-batch said "1 mini-batches to go"."""
    from pipeline.progress import StageProgress

    lines: list[str] = []
    with StageProgress("update it 0", "mini-batches", 1, log=lines.append, every_s=3600):
        pass
    assert lines[0] == "[update it 0] 1 mini-batch to go"
    with StageProgress("rollout it 0", "trajectories", 1, log=lines.append, every_s=3600):
        pass
    assert "[rollout it 0] 1 trajectory to go" in lines
