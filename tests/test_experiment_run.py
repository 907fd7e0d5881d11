"""The experiment runner's order of runs (experiments/run.py)."""

from __future__ import annotations

from pathlib import Path

from experiments.run import run_order


def test_runs_go_seed_by_seed_so_a_stopped_experiment_has_paired_seeds():
    exp = {
        "arms": {
            "raw": {"seeds": [0, 1, 2], "overrides": []},
            "plan_b": {"seeds": [0, 1, 2], "overrides": []},
            "later": {"seeds": [0, 1, 2], "overrides": [], "pending": "not built"},
            "plan_b_lived_raw": {"seeds": [0, 1, 2], "overrides": []},
        }
    }
    order = [(arm, seed) for arm, seed, _ in run_order(exp)]
    assert order[:3] == [("raw", 0), ("plan_b", 0), ("plan_b_lived_raw", 0)]
    assert len(order) == 9 and ("later", 0) not in order
    # whatever prefix ran, no arm is more than one seed ahead of another
    for k in range(1, len(order) + 1):
        done = {arm: sum(1 for a, _ in order[:k] if a == arm) for arm in ("raw", "plan_b", "plan_b_lived_raw")}
        assert max(done.values()) - min(done.values()) <= 1, order[:k]
    assert [(a, s) for a, s, _ in run_order(exp, ["plan_b"])] == [("plan_b", 0), ("plan_b", 1), ("plan_b", 2)]


def test_each_result_says_which_code_made_it(tmp_path, monkeypatch):
    import subprocess

    import experiments.run as run

    head = subprocess.run(["git", "-C", str(run.REPO), "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
    assert run.code_commit().split("+")[0] == head.stdout.strip()
    monkeypatch.setattr(run, "REPO", tmp_path)  # a copy of the tree without git: nothing to say, not a guess
    assert run.code_commit() is None


def test_the_replay_section_replays_the_run_it_names(world_rollout):
    """The experiment page's replay table called lived_saar with its arguments swapped: every page since said
    "(replay statistics unavailable: 'CleanerConfig' object has no attribute 'is_file')"."""
    from experiments.report import _replay_section

    text = _replay_section([{"run_id": "w", "arm": "saar"}], str(world_rollout.storage.root))
    assert text.startswith("Replay of `w` iteration 0 (64 raw trajectories)"), text
    assert text.count("\n| ") == 8, text  # the header and γ = 0 … 1.01


def test_each_result_records_its_premise_figures_per_iteration(world_rollout, tmp_path):
    """EXPERIMENTS.md asks for the premise figures per iteration next to the result; the pages had them only as
    all-iteration means read from a store the experiment did not keep. For one iteration the two must agree."""
    from experiments.run import trained_mode
    from experiments.stats import off_policy_rows, premise_by_iteration, premise_table
    from purifier.stage import run_purify_stage
    from tests.flow_helpers import copy_runs

    assert trained_mode(["storage.root=x", "train.mode=raw", "train.mode=saar_correct"]) == "saar_correct"
    assert trained_mode([]) == "saar"

    root = copy_runs(world_rollout.storage.root, tmp_path / "ws")
    cfg = world_rollout.model_copy(deep=True)
    cfg.storage.root = root
    cfg.purify.modes, cfg.purify.gammas = ["saar"], [0.5]
    run_purify_stage(cfg, "w", 0)
    rows = premise_by_iteration(root, "w", "saar")
    assert [r["iteration"] for r in rows] == [0]
    whole = off_policy_rows(root, ["w"], "saar")[0]
    assert rows[0]["failed_first_advantage"] == whole["failed_first_advantage"]
    assert rows[0]["failed_first_positive"] == whole["failed_first_positive"]
    assert rows[0]["failed_call_share_of_trained"] == (whole["failed_trained"] or 0) / whole["trained"]
    table = premise_table([{"arm": "saar", "seed": 0, "premise": rows}], ["saar"])
    assert table[2].startswith("| saar | 0 | 1 | ")
    assert premise_table([{"arm": "saar", "seed": 0, "evals": []}], ["saar"])[0].startswith("(not recorded")
    assert premise_table([{"arm": "saar", "seed": 0, "premise": []}], ["saar"])[0].startswith("(recorded, but")


def test_a_catalog_that_cannot_give_the_premise_figures_costs_no_result(monkeypatch, capsys):
    import experiments.run as run

    def broken(*args):
        raise RuntimeError("catalog gone")

    monkeypatch.setattr(run, "premise_by_iteration", broken)
    assert run._premise(Path("/nowhere"), "r", "saar") is None
    assert "r: premise figures unavailable: catalog gone" in capsys.readouterr().err
