"""pipeline/config.py and the `cleaner` CLI skeleton."""

from __future__ import annotations

import subprocess

import pytest

from flows.cli import build_parser, main
from flows.command import split_overrides
from pipeline.config import CleanerConfig, ConfigError, load_config
from tests.flow_helpers import ROOT, run_cleaner


def test_yaml_then_overrides(tmp_path):
    cfg_file = tmp_path / "c.yaml"
    cfg_file.write_text("rollout:\n  samples_per_prompt: 6\n  saar:\n    gamma_live: 0.3\nflow:\n  iterations: 2\n")
    cfg = load_config(
        cfg_file, ["rollout.samples_per_prompt=8", "purify.gammas=[0.3, 0.7]", "rollout.saar.live_mode=raw"]
    )
    assert cfg.rollout.samples_per_prompt == 8
    assert cfg.rollout.saar.gamma_live == 0.3
    assert cfg.purify.gammas == [0.3, 0.7]
    assert cfg.rollout.saar.live_mode == "raw"
    assert cfg.flow.iterations == 2


def test_unknown_key_suggests_the_right_one():
    with pytest.raises(
        ConfigError,
        match=r"unknown config key 'rollout\.sample_per_prompt' \(did you mean 'rollout\.samples_per_prompt'\?\)",
    ):
        load_config(None, ["rollout.sample_per_prompt=8"])


def test_bad_values_name_the_key(tmp_path):
    with pytest.raises(ConfigError, match=r"rollout\.saar\.gate_p"):
        load_config(None, ["rollout.saar.gate_p=1.5"])
    bad = tmp_path / "bad.yaml"
    bad.write_text("train:\n  learning_rate: 1\n")
    with pytest.raises(ConfigError, match=r"bad\.yaml[\s\S]*train\.learning_rate"):
        load_config(bad)
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path / "missing.yaml")
    with pytest.raises(ConfigError, match="not of the form"):
        load_config(None, ["flow.iterations"])


def test_section_hash_tracks_only_its_sections():
    a, b = CleanerConfig(), load_config(None, ["train.lr=0.5"])
    assert a.section_hash("rollout") == b.section_hash("rollout")
    assert a.section_hash("train") != b.section_hash("train")


@pytest.mark.parametrize(
    "command",
    [
        "config",
        "inspect",
        "demo",
        "bootstrap",
        "eval",
        "rollout",
        "purify",
        "replay",
        "update",
        "train",
        "report",
        "schedule",
    ],
)
def test_every_subcommand_has_help(command, capsys):
    with pytest.raises(SystemExit) as e:
        build_parser().parse_args([command, "--help"])
    assert e.value.code == 0
    assert "KEY=VALUE" in capsys.readouterr().out


def test_console_script_runs_and_reports_bad_keys():
    out = run_cleaner(["config", "flow.iterations=4"])
    assert out.returncode == 0 and "iterations: 4" in out.stdout
    bad = run_cleaner(["config", "flow.iteration=4"])
    assert bad.returncode == 2 and "unknown config key 'flow.iteration'" in bad.stderr


@pytest.mark.parametrize(
    "argv,rest,overrides",
    [
        (
            ["purify", "a.b=1", "--run", "r", "--gamma", "0.3", "0.5", "c.d=2"],
            ["purify", "--run", "r", "--gamma", "0.3", "0.5"],
            ["a.b=1", "c.d=2"],
        ),
        (["inspect", "--sql", "x.y=1", "s.t=2"], ["inspect", "--sql", "x.y=1"], ["s.t=2"]),  # a value stays a value
        (
            ["gc", "--run", "a.b=c", "--keep", "1", "2", "e.f=3"],
            ["gc", "--run", "a.b=c", "--keep", "1", "2"],
            ["e.f=3"],
        ),
        (
            ["schedule", "--new-run", "n.d={date}", "-c", "f.y=1", "flow.run_id=x"],
            ["schedule", "--new-run", "n.d={date}", "-c", "f.y=1"],
            ["flow.run_id=x"],
        ),
    ],
)
def test_overrides_are_split_from_anywhere_but_never_from_an_options_value(argv, rest, overrides):
    assert split_overrides(build_parser(), argv) == (rest, overrides)


def test_no_product_file_reads_argparse_private_attributes():
    private = [
        f"{path.relative_to(ROOT)}:{n}"
        for top in ("flows", "pipeline", "rollout_gen", "purifier", "trainer", "storage", "policies")
        for path in (ROOT / top).rglob("*.py")
        for n, line in enumerate(path.read_text().splitlines(), 1)
        if "._actions" in line or "argparse._" in line or "_SubParsersAction" in line
    ]
    assert not private, private


def test_inspect_on_an_empty_root(tmp_path, capsys):
    assert main(["inspect", f"storage.root={tmp_path}"]) == 0
    assert "raw trajectories" in capsys.readouterr().out
    assert main(["inspect", f"storage.root={tmp_path}", "--sql", "SELECT 41 + 1 AS answer"]) == 0
    out = capsys.readouterr().out
    assert "42" in out
    assert "SELECT 41 + 1 AS answer" in out  # the query heads its table whole, not wrapped to the table's width


def test_command_line_values_are_blamed_on_the_command_line_and_yaml_values_on_the_file(tmp_path, capsys):
    cfg_file = tmp_path / "tiny.yaml"
    cfg_file.write_text("flow: {iterations: 2}\n")
    with pytest.raises(ConfigError) as e:
        load_config(cfg_file, ["train.gamma=-1"])
    assert "command line" in str(e.value) and "train.gamma" in str(e.value) and str(cfg_file) not in str(e.value)
    assert main(["config", "-c", str(cfg_file), "train.gamma=-1"]) == 2
    err = capsys.readouterr().err
    assert "command line" in err and "tiny.yaml" not in err, err
    cfg_file.write_text("train: {gamma: -1}\n")
    with pytest.raises(ConfigError) as e:
        load_config(cfg_file, ["flow.iterations=2"])
    assert f"in {cfg_file}" in str(e.value) and "train.gamma" in str(e.value) and "command line" not in str(e.value)


def test_an_unknown_key_in_yaml_gets_a_did_you_mean_as_an_override_does(tmp_path):
    cfg_file = tmp_path / "c.yaml"
    cfg_file.write_text("rollout:\n  sample_per_prompt: 8\n")
    with pytest.raises(ConfigError) as e:
        load_config(cfg_file)
    message = str(e.value)
    assert str(cfg_file) in message, message
    assert "unknown config key 'rollout.sample_per_prompt' (did you mean 'rollout.samples_per_prompt'?)" in message


def test_inspect_on_a_read_only_root_does_not_send_you_to_inspect(tmp_path, capsys):
    where = tmp_path / "ro"
    where.mkdir()
    r = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=1m,ro", "tmpfs", str(where)], capture_output=True, text=True
    )
    if r.returncode != 0:
        pytest.skip(f"cannot mount a read-only tmpfs here (needs root with CAP_SYS_ADMIN): {r.stderr.strip()}")
    try:
        assert main(["inspect", f"storage.root={where}"]) == 0
        out = capsys.readouterr()
    finally:
        subprocess.run(["umount", "-l", str(where)], capture_output=True)
    assert "raw trajectories" in out.out
    assert "read-only" in out.err and "`cleaner inspect` rebuilds it" not in out.err, out.err


@pytest.mark.parametrize(
    "key, says",
    [
        ("rollout.loop", "removed: every rollout runs the asynchronous loop"),
        ("rollout.deterministic", "moved to rollout.engine_tuning.deterministic"),
    ],
)
def test_a_key_earlier_configs_had_says_what_became_of_it(tmp_path, key, says):
    """An old YAML (or override) naming a removed or moved key: one line that says so, not a close-match guess."""
    section, name = key.split(".")
    old = tmp_path / "old.yaml"
    old.write_text(f"{section}:\n  {name}: lockstep\n" if name == "loop" else f"{section}:\n  {name}: false\n")
    for load in (lambda: load_config(old, []), lambda: load_config(None, [f"{key}=1"])):
        with pytest.raises(ConfigError) as e:
            load()
        assert "\n" not in str(e.value) and f"config key {key!r} {says}" in str(e.value)


def test_demo_help_names_the_config_it_reads(capsys):
    """`cleaner demo` reads configs/demo.yaml; its -c said 'default: embedded defaults' as every command's does."""
    with pytest.raises(SystemExit):
        build_parser().parse_args(["demo", "--help"])
    assert "(default: configs/demo.yaml)" in " ".join(capsys.readouterr().out.split())


def test_a_partition_written_under_another_measure_is_named_with_it(capsys):
    """`replay --gamma 0.5 rollout.saar.similarity=difflib` printed `mode=saar gamma=0.5 … written` for the folder
    gamma=0.50-difflib-segment: it read as if the default partition had been rewritten."""
    from flows.stage_cmds import print_partitions
    from pipeline.modes import Variant
    from pipeline.similarity import Measure
    from purifier.stage import VariantResult

    print_partitions(
        [
            VariantResult(Variant.of("saar", 0.5, Measure("difflib")), 64, 0, False),
            VariantResult(Variant.of("saar_is", 0.3), 64, 1, True),
        ]
    )
    assert capsys.readouterr().out.splitlines() == [
        "mode=saar/gamma=0.50-difflib-segment: 64 rows, 0 dead letters — written",
        "mode=saar_is/tau=0.30: 64 rows, 1 dead letters — kept (already committed)",
    ]


@pytest.mark.parametrize("override", ["train.rollout_correction=off", "train.rollout_correction='off'"])
def test_the_default_correction_preset_off_is_accepted_bare(override, tmp_path):
    """YAML reads a bare `off` as false: the preset named as the docs name it was refused (got False)."""
    from pipeline.config import load_config

    assert load_config(None, [override]).train.rollout_correction == "off"
    (tmp_path / "c.yaml").write_text("train:\n  rollout_correction: off\n")
    assert load_config(tmp_path / "c.yaml", []).train.rollout_correction == "off"


def test_the_tau_of_saar_is_is_train_tau_and_is_checked_as_one():
    """train.gamma is γ alone: saar_is trains at train.tau, and train.gamma given for it without a τ is refused in one
    line that names train.tau (tests/test_gamma_tau.py has the rest)."""
    from pipeline.config import ConfigError, load_config

    assert load_config(None, ["train.mode=saar_is", "train.tau=0.3"]).train.tau == 0.3
    with pytest.raises(ConfigError, match="train.tau: the importance-ratio threshold τ must be a finite number > 0"):
        load_config(None, ["train.mode=saar_is", "train.tau=0"])
    with pytest.raises(ConfigError, match=r"give its importance-ratio threshold as train.tau \(e.g. train.tau=0.3\)"):
        load_config(None, ["train.mode=saar_is", "train.gamma=0.3"])


def test_scoring_on_vllm_at_another_temperature_is_refused_when_the_config_is_read():
    """It failed many iterations in, the first time a row needed a recompute (or a live rollback a score)."""
    from pipeline.config import ConfigError, load_config

    with pytest.raises(ConfigError, match=r"purify.recompute=vllm .* rollout.temperature=1.0 \(got 0.7\)"):
        load_config(None, ["purify.recompute=vllm", "rollout.temperature=0.7"])
    with pytest.raises(ConfigError, match="rollout.saar.rollback=importance on rollout.engine=vllm"):
        load_config(None, ["rollout.engine=vllm", "rollout.saar.rollback=importance", "rollout.temperature=0.7"])
    load_config(None, ["rollout.engine=vllm", "rollout.temperature=0.7"])  # sampling alone: its own log-probs


@pytest.mark.parametrize(
    "runner,takes",
    [("DaskRunner", "dask"), ("Dask", "dask"), ("FnApiRunner", "FnApiRunner"), ("prism", "prism"), ("nope", None)],
)
def test_purify_runner_names_beam_knows_and_one_line_for_others(runner, takes, tmp_path):
    """purify.runner=DaskRunner (the name the docs use) was a 29-line Beam traceback."""
    from pipeline.config import load_config
    from purifier.stage import UnknownRunner, beam_runner

    cfg = load_config(None, [f"storage.root={tmp_path}", f"purify.runner={runner}", "purify.dask_address=tcp://h:8786"])
    if takes is None:
        with pytest.raises(UnknownRunner, match="purify.runner=nope: Beam knows no such runner; use dask"):
            beam_runner(cfg)
    else:
        got, options = beam_runner(cfg)
        assert (
            (got.endswith("DaskRunner") and "--dask_client_address=tcp://h:8786" in options)
            if takes == "dask"
            else got == takes
        )


def test_config_files_and_overrides_as_users_wrote_them(tmp_path):
    """Each was a traceback, a setting silently dropped or changed, or a value refused that is fine."""
    from pipeline.config import ConfigError, load_config

    empty = tmp_path / "empty_section.yaml"
    empty.write_text("rollout:\n  # samples_per_prompt: 8\n")
    assert load_config(empty, []).rollout.samples_per_prompt == 4  # an empty section: the defaults
    assert load_config(empty, ["rollout.seed=1"]).rollout.seed == 1  # was: TypeError in apply_override
    with pytest.raises(ConfigError, match="rollout is 5, not a section: rollout.seed cannot be set in it"):
        load_config(None, ["rollout=5", "rollout.seed=3"])
    twice = tmp_path / "twice.yaml"
    twice.write_text(
        "rollout:\n  seed: 7\n  temperature: 0.6\ntrain:\n  lr: 5.0e-5\nrollout:\n  samples_per_prompt: 8\n"
    )
    with pytest.raises(ConfigError, match=r"twice.yaml: .*key 'rollout' given twice \(first at line 1\) at line 6"):
        load_config(twice, [])
    cfg = load_config(
        None,
        [
            "flow.run_id=20240601",
            "rollout.seed=010",
            "rollout.engine_tuning.kv_cache_tokens=2e5",
            "rollout.vllm_args=[--enforce-eager, --block-size, 32]",
        ],
    )
    assert (cfg.flow.run_id, cfg.rollout.seed, cfg.rollout.engine_tuning.kv_cache_tokens) == ("20240601", 10, 200_000)
    assert cfg.rollout.vllm_args == ["--enforce-eager", "--block-size", "32"]
    assert load_config(None, ["flow.run_id=2024-06-01"]).flow.run_id == "2024-06-01"  # not a date
    assert load_config(None, ["flow.tensorboard=yes"]).flow.tensorboard is True  # a boolean setting reads yes/no
    for bad, says in (
        ("purify.gammas=[true]", "expected numbers, not booleans"),
        ("purify.roc_group_size=true", "expected a number, not a boolean"),
        ("storage.compression=zstdd", "storage.compression: Input should be 'zstd'"),
        ("train.dual_clip=0.5", "train.dual_clip: Input should be greater than 1"),
    ):
        with pytest.raises(ConfigError, match=says):
            load_config(None, [bad])
    assert load_config(None, ["train.dual_clip=null"]).train.dual_clip is None
    with pytest.raises(ConfigError, match=r"world.digits_min \(5\) must be at most world.digits_max \(3\)"):
        load_config(None, ["world.digits_min=5", "world.digits_max=3"])


@pytest.mark.parametrize(
    "typed,meant",
    [
        ("train.run_id", "flow.run_id"),
        ("train.learning_rate", "train.lr"),
        ("rollout.temp", "rollout.temperature"),
        ("rollout.n", "rollout.samples_per_prompt"),
        ("purify.gamma", "purify.gammas"),
        ("rollout.sead", "rollout.seed"),
    ],
)
def test_did_you_mean_names_the_setting_a_user_of_other_trainers_meant(typed, meant):
    """It guessed train.lr for train.run_id, train.mini_batches for train.learning_rate, rollout.top_p for
    rollout.temp and a section for rollout.n."""
    from pipeline.config import ConfigError, load_config

    with pytest.raises(ConfigError, match=rf"unknown config key '{typed}' \(did you mean '{meant}'\?\)"):
        load_config(None, [f"{typed}=1"])


def test_config_describe_says_what_every_setting_does(capsys):
    """There was no config reference: most settings' meaning was in no doc and no --help."""
    from flows.cli import main

    assert main(["config", "--describe"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) > 90 and all("  # " in line for line in lines), [x for x in lines if "  # " not in x]
    assert main(["config", "--describe", "rollout.saar.gate_p", "rollout.saar.gate_p=0.5"]) == 0
    assert capsys.readouterr().out.startswith("rollout.saar.gate_p: 0.5  # share of trajectories SAAR retries in")
    assert main(["config", "--describe", "nope"]) == 2
    assert "--describe nope: no setting starts so" in capsys.readouterr().err


@pytest.mark.parametrize(
    "overrides,needle",
    [
        (["train.rollout_correction_bounds=[1,5]"], "train.rollout_correction_bounds=[1.0, 5.0] has no effect without"),
        (["train.dpo_beta=3"], "train.dpo_beta=3.0 has no effect without train.use_dpo_on_tool_calls=true"),
        (["train.dpo_max_adjustment_ratio=0.5"], "train.dpo_max_adjustment_ratio=0.5 has no effect without"),
        (
            ["rollout.saar.rollback=importance", "rollout.saar.live_mode=raw"],
            "rollout.saar.rollback=importance has no effect without rollout.saar.live_mode=purified",
        ),
        (["rollout.saar.is_threshold=0.3"], "rollout.saar.is_threshold=0.3 has no effect without"),
        (["train.nproc=4"], "train.nproc=4 has no effect without train.strategy=deepspeed"),
        (["train.zero_stage=3"], "train.zero_stage=3 has no effect without train.strategy=deepspeed"),
        (
            ["rollout.tasks_per_iteration=2", "train.mini_batches=2", "train.strategy=deepspeed", "train.nproc=2"],
            "a mini-batch holds 1 prompt group(s) (rollout.tasks_per_iteration=2 over train.mini_batches=2)",
        ),
    ],
)
def test_a_setting_nothing_reads_is_refused_naming_what_it_needs(overrides, needle):
    """A non-default value where its switch is off would change nothing in the run: one line, not silence."""
    with pytest.raises(ConfigError) as e:
        load_config(None, overrides)
    assert "\n" not in str(e.value) and needle in str(e.value)


@pytest.mark.parametrize(
    "overrides",
    [
        ["train.rollout_correction=token_mis", "train.rollout_correction_bounds=[1,5]"],
        ["train.use_dpo_on_tool_calls=true", "train.dpo_beta=3", "train.dpo_max_adjustment_ratio=0.5"],
        ["rollout.saar.rollback=importance", "rollout.saar.is_threshold=0.3"],
        ["rollout.saar.live_mode=raw", "rollout.saar.is_threshold=0.5"],  # its default: nothing changed
        ["train.strategy=deepspeed", "train.nproc=2", "train.zero_stage=3"],
        ["rollout.tasks_per_iteration=4", "train.mini_batches=2", "train.strategy=deepspeed", "train.nproc=2"],
    ],
)
def test_the_same_settings_with_their_switch_on_are_accepted(overrides):
    load_config(None, overrides)


def test_a_record_is_read_as_it_was_lived_whatever_later_rules_say(tmp_path):
    """run.json and manifests written before these refusals (or by another tool) still read: replay, gc and the
    experiments' probe read what a run lived, not a new config."""
    from flows.replay_cmd import lived_saar
    from pipeline.config import RECORD

    run_json = tmp_path / "run.json"
    run_json.write_text('{"rollout": {"saar": {"live_mode": "raw", "rollback": "importance", "is_threshold": 0.3}}}')
    saar = lived_saar(run_json, {})
    assert (saar.live_mode, saar.rollback, saar.is_threshold) == ("raw", "importance", 0.3)
    assert CleanerConfig.model_validate({"train": {"dpo_beta": 3}}, context=RECORD).train.dpo_beta == 3
    with pytest.raises(ValueError, match="has no effect"):
        CleanerConfig.model_validate({"train": {"dpo_beta": 3}})
