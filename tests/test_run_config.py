"""A run's config is frozen in run.json at its start (flows/run_config.py): a rerun with the same
training settings goes on, one that changes what the run trains on is refused with one line naming
run.json and the settings that differ; what may change (more iterations, more γ, threads) goes on."""

from __future__ import annotations

import json

import pytest

from flows.run_config import RunConfigMismatch, freeze_run_config
from pipeline.config import load_config
from storage.layout import RunLayout


def _cfg(root, *overrides):
    return load_config(None, [f"storage.root={root}", "flow.run_id=r", *overrides])


def test_first_start_writes_run_json_and_the_same_config_goes_on(tmp_path):
    cfg = _cfg(tmp_path)
    freeze_run_config(cfg, "r")
    run_json = RunLayout(tmp_path, "r").run_json
    assert json.loads(run_json.read_text()) == cfg.model_dump(mode="json")
    before = run_json.read_bytes()
    freeze_run_config(_cfg(tmp_path), "r")
    assert run_json.read_bytes() == before


@pytest.mark.parametrize(
    "override,diff",
    [
        ("train.lr=0.0002", "train.lr: 0.0001 -> 0.0002"),
        ("rollout.samples_per_prompt=8", "rollout.samples_per_prompt: 4 -> 8"),
        ("rollout.saar.gamma_live=0.7", "rollout.saar: "),  # nested settings compare as a whole
        ("train.mode=raw", "train.mode: 'saar' -> 'raw'"),
    ],
)
def test_a_rerun_with_changed_training_settings_is_refused_in_one_line(tmp_path, override, diff):
    freeze_run_config(_cfg(tmp_path), "r")
    run_json = RunLayout(tmp_path, "r").run_json
    before = run_json.read_bytes()
    with pytest.raises(RunConfigMismatch) as e:
        freeze_run_config(_cfg(tmp_path, override), "r")
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith(f"{run_json}: run 'r' was started with another config (")
    assert diff in msg and msg.endswith("; rerun with the run's settings, or use a new flow.run_id")
    assert run_json.read_bytes() == before  # the frozen config is never rewritten


@pytest.mark.parametrize(
    "override",
    [
        "flow.iterations=9",
        "purify.gammas=[0.3,0.9]",
        "rollout.engine_tuning.threads=2",
        "purify.modes=[saar]",
        "flow.replay_gammas=[0.5]",
    ],
)
def test_settings_that_may_change_between_reruns_go_on(tmp_path, override):
    freeze_run_config(_cfg(tmp_path), "r")
    run_json = RunLayout(tmp_path, "r").run_json
    before = run_json.read_bytes()
    rerun = _cfg(tmp_path, override)
    assert rerun.model_dump(mode="json") != json.loads(before)  # the rerun's config does differ ...
    freeze_run_config(rerun, "r")  # ... and goes on
    assert run_json.read_bytes() == before  # with the run's frozen config as it was


def test_settings_added_by_a_newer_cleaner_are_not_a_change(tmp_path):
    freeze_run_config(_cfg(tmp_path), "r")
    run_json = RunLayout(tmp_path, "r").run_json
    old = json.loads(run_json.read_text())
    del old["train"]["lr"]  # as if run.json were written before `train.lr` existed
    run_json.write_text(json.dumps(old))
    before = run_json.read_bytes()
    freeze_run_config(_cfg(tmp_path, "train.lr=0.0003"), "r")  # a setting the run never had: goes on
    assert run_json.read_bytes() == before
    with pytest.raises(RunConfigMismatch, match="train.mode"):  # while a setting it had is still compared
        freeze_run_config(_cfg(tmp_path, "train.lr=0.0003", "train.mode=raw"), "r")


def test_a_run_frozen_before_engine_tuning_goes_on_and_its_schedule_is_still_compared(tmp_path):
    """run.json written before issue 28: rollout.loop and the scheduler keys at the top of rollout. A rerun with
    rollout.engine_tuning goes on; a changed schedule is still a different run."""
    freeze_run_config(_cfg(tmp_path), "r")
    run_json = RunLayout(tmp_path, "r").run_json
    old = json.loads(run_json.read_text())
    old["rollout"].update(old["rollout"].pop("engine_tuning"), loop="async")
    run_json.write_text(json.dumps(old))
    before = run_json.read_bytes()
    freeze_run_config(_cfg(tmp_path, "rollout.engine_tuning.threads=2"), "r")
    assert run_json.read_bytes() == before
    with pytest.raises(RunConfigMismatch, match="rollout.engine_tuning"):
        freeze_run_config(_cfg(tmp_path, "rollout.engine_tuning.deterministic=false"), "r")


def test_a_run_frozen_before_answer_match_ran_at_its_default_and_cannot_switch(tmp_path):
    """run.json written before rollout.answer_match: its rewards were math-verify's, so a rerun at the default goes
    on and one with exact is refused (other settings a newer cleaner added are not compared; this one changes every
    later reward)."""
    freeze_run_config(_cfg(tmp_path), "r")
    run_json = RunLayout(tmp_path, "r").run_json
    old = json.loads(run_json.read_text())
    del old["rollout"]["answer_match"]
    run_json.write_text(json.dumps(old))
    freeze_run_config(_cfg(tmp_path), "r")
    with pytest.raises(RunConfigMismatch, match="rollout.answer_match: 'equivalent' -> 'exact'"):
        freeze_run_config(_cfg(tmp_path, "rollout.answer_match=exact"), "r")


def test_train_refuses_another_config_before_its_prefect_server_starts(tmp_path):
    """The refusal came 12 s in, after a Prefect server had started and the flow had begun."""
    from tests.flow_helpers import run_cleaner

    freeze_run_config(_cfg(tmp_path), "r")
    out = run_cleaner(["train", f"storage.root={tmp_path}", "flow.run_id=r", "rollout.temperature=0.9"], tmp_path)
    assert out.returncode != 0 and "was started with another config (rollout.temperature: 1.0 -> 0.9)" in out.stderr
    assert not (tmp_path / ".prefect").exists(), "a Prefect server was started first"
