"""Issue #13 §2/§3/§5 and #21: every reader validates, every user error is one line, a failing command
leaves nothing behind. Real Beam, real Parquet/DuckDB, real tiny policy; disk-full and read-only
workspaces are real tmpfs mounts: mounted by this process where it may (root), and again, for every user, in a
user and mount namespace of their own (unshare, as an unprivileged uid when the tests run as root)."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import zlib
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from flows.cli import main
from pipeline.config import DEFAULT_POLICY, ConfigError, load_config
from storage.errors import CleanerError
from purifier.stage import run_purify_stage
from storage.layout import RunLayout
from storage.shards import MANIFEST, ShardError, read_manifest

REPO = Path(__file__).resolve().parent.parent


# ---------------------------------------------------------------- helpers


def files_under(root: Path) -> dict[str, bytes]:
    """Every file under root with its bytes: 'left nothing behind' is this staying equal."""
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(Path(root).rglob("*")) if p.is_file()}


PROGRESS_BAR = re.compile(r"\d+/\d+ \[[\d:<?]+")  # transformers' weight-loading bar: console noise (#21), not an error


PROGRESS_LINE = re.compile(
    r"^\[\w+( \S+)? it \d+\] "
)  # a stage's progress or start-up line (#21, #32): "[purify it 0]", "[replay RUN it 0]"


def one_line(err: str) -> str:
    """The one `cleaner COMMAND: …` line of a refusal; progress output around it is not an error line."""
    lines = [
        line
        for line in err.strip().splitlines()
        if line.strip() and not PROGRESS_BAR.search(line) and not PROGRESS_LINE.match(line)
    ]
    assert len(lines) == 1 and lines[0].startswith("cleaner ") and "Traceback" not in err, err[-3000:]
    return lines[0]


def run_cli(capsys, *argv: str) -> tuple[int, str]:
    """`cleaner ARGV` in-process: (exit code, the single stderr line)."""
    capsys.readouterr()
    try:
        code = main(list(argv))
    except SystemExit as e:  # argparse refusals
        code = e.code
    err = capsys.readouterr().err
    return code, err


def copy_iteration(cfg, root: Path, *parts: str) -> None:
    src = RunLayout(cfg.storage.root, "w").iteration_dir(0)
    for p in parts:
        shutil.copytree(src / p, RunLayout(root, "w").iteration_dir(0) / p)


def rewrite_part(shard: Path, table) -> None:
    """Replace part 0 with `table` and patch the manifest, so only content validation can object."""
    part = shard / "part-00000.parquet"
    pq.write_table(table, part)
    data = part.read_bytes()
    m = json.loads((shard / MANIFEST).read_text())
    m["parts"][0].update(bytes=len(data), crc32=f"{zlib.crc32(data) & 0xFFFFFFFF:08x}", rows=table.num_rows)
    m["rows"] = sum(p["rows"] for p in m["parts"])
    (shard / MANIFEST).write_text(json.dumps(m))


def flip_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))


@pytest.fixture
def tmpfs(tmp_path):
    """mount(size, ro=False) -> a fresh tmpfs folder; unmounted afterwards."""
    mounted: list[Path] = []

    def mount(size: str = "1m", ro: bool = False) -> Path:
        where = tmp_path / f"fs{len(mounted)}"
        where.mkdir()
        opts = f"size={size}" + (",ro" if ro else "")
        r = subprocess.run(["mount", "-t", "tmpfs", "-o", opts, "tmpfs", str(where)], capture_output=True, text=True)
        if r.returncode != 0:
            pytest.skip(f"cannot mount a tmpfs here (needs root with CAP_SYS_ADMIN): {r.stderr.strip()}")
        mounted.append(where)
        return where

    yield mount
    for where in mounted:
        subprocess.run(["umount", "-l", str(where)], capture_output=True)


# What runs inside namespace_tmpfs's namespace: the command against a fresh tmpfs (filled first unless read-only),
# then one JSON line: its exit code, its stderr, and whether the workspace was left as it was found.
_IN_NAMESPACE = """
import contextlib, io, json, shutil, sys
from pathlib import Path
from tests.test_hardening import files_under, fill
from flows.cli import main
root, seed, full, argv = Path(sys.argv[1]), sys.argv[2], sys.argv[3] == "full", sys.argv[4:]
if seed:
    shutil.copytree(seed, root, dirs_exist_ok=True)
if full:
    fill(root)
before, err = files_under(root), io.StringIO()
with contextlib.redirect_stderr(err):
    try:
        code = main([a.replace("{root}", str(root)) for a in argv])
    except SystemExit as e:
        code = e.code
print(json.dumps({"code": code, "err": err.getvalue(), "unchanged": files_under(root) == before,
                  "staging": any(p.name == ".staging" for p in root.rglob("*"))}))
"""
NOBODY = 65534  # the uid the namespace variants run as when the tests run as root: they must work without it


def namespace_tmpfs(tmp_path: Path, size: str, argv: list[str], ro: bool = False, seed: Path | None = None) -> dict:
    """`cleaner ARGV` in a process of its own, in a new user and mount namespace (`unshare --user --map-root-user
    --mount`, which needs no privilege) where a fresh tmpfs of `size` is mounted ({root} in argv); the workspace
    is seeded from `seed` and filled to the last byte unless read-only. Run as an unprivileged uid when the tests
    run as root (and that uid may run this interpreter), so that it shows what a user without root gets. What
    _IN_NAMESPACE prints."""
    if not shutil.which("unshare"):
        pytest.skip("no unshare(1) here: the namespace variant needs util-linux")
    drop = (
        ["setpriv", f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups"]
        if os.geteuid() == 0 and shutil.which("setpriv")
        else []
    )

    def probe(drop: list[str]) -> subprocess.CompletedProcess:
        return subprocess.run(
            [*drop, "unshare", "--user", "--map-root-user", "--mount", sys.executable, "-c", "0"],
            capture_output=True,
            text=True,
        )

    if drop and probe(drop).returncode != 0:  # this interpreter lives where that uid may not go (/root/.pyenv)
        drop = []
    if (tried := probe(drop)).returncode != 0:
        pytest.skip(f"cannot create a user namespace here: {tried.stderr.strip()}")
    work = Path(tempfile.mkdtemp(prefix="ns-tmpfs-"))  # outside tmp_path: that one is private to this uid
    try:
        where, home = work / "fs", work / "home"
        where.mkdir()
        home.mkdir()
        if seed is not None:
            shutil.copytree(seed, work / "seed")
            seed = work / "seed"
        if drop:
            for p in [work, *work.rglob("*")]:
                os.chown(p, NOBODY, NOBODY, follow_symlinks=False)
        opts = f"size={size}" + (",ro" if ro else "")
        env = {
            "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
            "HOME": str(home),
            "PYTHONPATH": os.pathsep.join([str(REPO), *filter(None, [os.environ.get("PYTHONPATH")])]),
            "TOKENIZERS_PARALLELISM": "false",
            "OMP_NUM_THREADS": "1",
            "PREFECT_HOME": str(home / ".prefect"),
        }
        out = subprocess.run(
            [
                *drop,
                "unshare",
                "--user",
                "--map-root-user",
                "--mount",
                "sh",
                "-c",
                'mount -t tmpfs -o "$1" tmpfs "$2" && shift 2 && exec "$@"',
                "sh",
                opts,
                str(where),
                sys.executable,
                "-c",
                _IN_NAMESPACE,
                str(where),
                str(seed or ""),
                "ro" if ro else "full",
                *argv,
            ],
            cwd=REPO,
            env=env,
            capture_output=True,
            text=True,
            timeout=600,
        )
        assert out.returncode == 0 and out.stdout.strip(), out.stderr[-3000:]
        return json.loads(out.stdout.strip().splitlines()[-1])
    finally:
        shutil.rmtree(work, ignore_errors=True)


def fill(fs: Path) -> Path:
    """Use up every free byte of a tmpfs (what is left is below one page: any new data fails)."""
    filler = fs / "filler"
    fd = os.open(filler, os.O_WRONLY | os.O_CREAT)
    try:
        while os.write(fd, b"\0" * 4096):
            pass
    except OSError:
        pass
    finally:
        os.close(fd)
    return filler


# ---------------------------------------------------------------- §3 config errors, one line each


def test_malformed_yaml_file_and_override_are_one_line(tmp_path, capsys):
    bad = tmp_path / "bad.yaml"
    bad.write_text("rollout:\n  samples_per_prompt: [4,\nflow: {}\n")
    code, err = run_cli(capsys, "config", "-c", str(bad))
    line = one_line(err)
    assert code == 2 and "bad.yaml" in line and "line" in line
    code, err = run_cli(capsys, "config", "purify.gammas=[0.3,")
    line = one_line(err)
    assert code == 2 and "purify.gammas=[0.3," in line


def test_non_utf8_config_names_the_file(tmp_path, capsys):
    bad = tmp_path / "latin1.yaml"
    bad.write_bytes("flow: {run_id: caf\u00e9}\n".encode("latin-1"))
    code, err = run_cli(capsys, "config", "-c", str(bad))
    line = one_line(err)
    assert code == 2 and "latin1.yaml" in line and "UTF-8" in line


@pytest.mark.parametrize(
    "override",
    [
        "train.gamma=-0.1",
        "train.gamma=1.5",
        "purify.gammas=[.nan]",
        "flow.replay_gammas=[0.5, -1]",
        "rollout.saar.gamma_live=2",
        "flow.iterations=true",
        "rollout.samples_per_prompt=yes",
        "rollout.saar.max_retries=false",
        "rollout.saar.gate_p=true",
        "train.clip_eps_low=-0.2",
        "train.lr=inf",
        "train.lr=.nan",
        "train.weight_decay=.inf",
        "purify.modes=[]",
        "purify.gammas=[]",
        "purify.is_thresholds=[]",
        "flow.replay_gammas=[]",
    ],
)
def test_out_of_range_values_are_refused_at_config_time(override, capsys):
    key = override.split("=")[0]
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        load_config(None, [override])
    code, err = run_cli(capsys, "config", override)
    assert code == 2 and key in one_line(err)


def test_always_deep_gamma_is_accepted():
    assert load_config(None, ["train.gamma=1.01", "purify.gammas=[0, 1, 1.01]"]).train.gamma == 1.01


def test_cli_gamma_is_validated_and_overrides_go_anywhere(tmp_path, capsys):
    root = tmp_path / "ws"
    root.mkdir()
    code, err = run_cli(capsys, "replay", "--run", "missing", "--gamma", "-1", f"storage.root={root}")
    assert code == 2 and "-1" in one_line(err)
    code, err = run_cli(capsys, "replay", "--run", "nope", "--gamma", "nan", f"storage.root={root}")
    assert code == 2 and "nan" in one_line(err)
    # an override after the multi-value --gamma, and overrides on both sides of --run/--iteration
    code, err = run_cli(
        capsys, "replay", "--run", "missing", "--iteration", "0", "--gamma", "0.5", f"storage.root={root}"
    )
    assert code == 1 and "run 'missing' does not exist under" in one_line(err)
    code, err = run_cli(
        capsys, "purify", f"storage.root={root}", "--run", "missing", "--iteration", "0", "purify.runner=FnApiRunner"
    )
    assert code == 1 and "run 'missing' does not exist under" in one_line(err)
    assert files_under(root) == {} and [p.name for p in root.iterdir()] == []


# ---------------------------------------------------------------- §2 validated reads in purify


def test_flipped_byte_in_a_raw_part_is_refused_by_purify(world_rollout, tmp_path):
    copy_iteration(world_rollout, tmp_path, "raw")
    part = RunLayout(tmp_path, "w").raw_dir(0) / "part-00000.parquet"
    flip_byte(part)
    cfg = world_rollout.model_copy(deep=True)
    cfg.storage.root = tmp_path
    cfg.purify.modes, cfg.purify.gammas = ["saar"], [0.5]
    with pytest.raises(ShardError, match=r"raw/part-00000\.parquet: checksum mismatch"):
        run_purify_stage(cfg, "w", 0)
    assert read_manifest(RunLayout(tmp_path, "w").purified_dir(0, "saar", 0.5)) is None
    assert not (RunLayout(tmp_path, "w").iteration_dir(0) / ".staging").exists()


def test_raw_part_with_a_dropped_column_is_one_line(world_rollout, tmp_path, capsys):
    copy_iteration(world_rollout, tmp_path, "raw")
    shard = RunLayout(tmp_path, "w").raw_dir(0)
    rewrite_part(shard, pq.read_table(shard / "part-00000.parquet").drop_columns(["lived_ids"]))
    before = files_under(tmp_path)
    code, err = run_cli(
        capsys, "purify", "--run", "w", f"storage.root={tmp_path}", "purify.modes=[saar]", "purify.gammas=[0.5]"
    )
    line = one_line(err)
    assert code == 1 and "part-00000.parquet: missing column 'lived_ids'" in line
    assert files_under(tmp_path) == before


def test_stale_staging_of_a_killed_purify_is_removed_by_the_rerun(world_rollout, tmp_path):
    copy_iteration(world_rollout, tmp_path, "raw")
    staging = RunLayout(tmp_path, "w").iteration_dir(0) / ".staging"
    (staging / "purify-0badc0de").mkdir(parents=True)  # what a purify killed by SIGKILL leaves
    (staging / "purify-0badc0de" / "saar-0.50.purified-00000-of-00001.parquet").write_bytes(b"half")
    cfg = world_rollout.model_copy(deep=True)
    cfg.storage.root = tmp_path
    cfg.purify.modes, cfg.purify.gammas = ["saar"], [0.5]
    run_purify_stage(cfg, "w", 0)
    assert not staging.exists()


# ---------------------------------------------------------------- §2 update: trainer state, checkpoints


def test_missing_trainer_state_is_refused_not_a_silent_optimizer_restart(purified_run, tmp_path):
    from trainer.stage import run_update_stage
    from storage.checkpoints import DONE_MARKER

    # iteration 1 trains from the run's own checkpoint 1, whose optimizer state has gone missing
    src = RunLayout(purified_run.storage.root, "w").iteration_dir(0)
    dst = RunLayout(tmp_path, "w")
    for p in ("raw", "purified"):
        shutil.copytree(src / p, dst.iteration_dir(1) / p)
    shutil.copytree(DEFAULT_POLICY, dst.checkpoint_dir(1))
    (dst.checkpoint_dir(1) / DONE_MARKER).write_text("{}")
    cfg = purified_run.model_copy(deep=True)
    cfg.storage.root = tmp_path
    with pytest.raises(CleanerError, match=r"checkpoints/iteration=0001/trainer_state\.pt"):
        run_update_stage(cfg, "w", 1, log=lambda *_: None)
    assert not dst.checkpoint_dir(2).exists()


def test_truncated_safetensors_is_one_line(purified_run, tmp_path, capsys):
    policy = tmp_path / "policy"
    shutil.copytree(DEFAULT_POLICY, policy)
    weights = policy / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    for command in ("rollout", "update"):
        root = tmp_path / command
        if command == "update":  # iteration 0 trains the policy its raw shard records: the truncated one here
            shutil.copytree(purified_run.storage.root / "runs", root / "runs")
            manifest = RunLayout(root, "w").raw_dir(0) / "_MANIFEST.json"
            manifest.write_text(json.dumps({**json.loads(manifest.read_text()), "inputs": [str(policy)]}))
        code, err = run_cli(
            capsys,
            command,
            "--run",
            "w",
            f"storage.root={root}",
            f"rollout.policy={policy}",
            "rollout.tasks_per_iteration=1",
            "rollout.samples_per_prompt=1",
        )
        line = one_line(err)
        assert code == 1 and "model.safetensors" in line and "truncated" in line, line
        assert not RunLayout(root, "w").checkpoint_dir(1).exists()
    for flow in ([], ["--flow"]):  # cleaner eval: a 34-line safetensors traceback before
        code, err = run_cli(
            capsys,
            "eval",
            "--world",
            "--limit",
            "2",
            *flow,
            f"rollout.policy={policy}",
            f"storage.root={tmp_path / 'eval'}",
        )
        line = one_line(err)
        assert code == 1 and "model.safetensors" in line and "truncated" in line, line
    code, err = run_cli(capsys, "eval", "--world", f"rollout.policy={tmp_path / 'none'}")
    assert code == 1 and one_line(err).endswith(f"checkpoint {tmp_path / 'none'} does not exist"), err


def test_a_mistyped_run_or_iteration_is_named_as_such(purified_run, tmp_path, capsys):
    """A run that does not exist said 'no committed raw shard … (run the rollout first)'; --iteration -1 looked for
    iteration=-001."""
    root = purified_run.storage.root
    for command in ("purify", "replay"):
        code, err = run_cli(capsys, command, "--run", "nope", f"storage.root={root}")
        assert code == 1 and "run 'nope' does not exist under" in one_line(err) and "runs there: w" in err, err
        code, err = run_cli(capsys, command, "--run", "w", "--iteration", "-1", f"storage.root={root}")
        assert code == 2 and "invalid iteration '-1'" in one_line(err), err
    assert not (root / "runs" / "nope").exists()


def test_the_update_of_iteration_0_trains_the_policy_its_raw_shard_records(purified_run, tmp_path, capsys):
    """A rollout with rollout.policy=P, then `cleaner update` without that override: the update loaded the
    default policy (and refused the shard as another tokenizer's, or trained other weights)."""
    from storage.shards import read_manifest

    root = tmp_path / "ws"
    shutil.copytree(purified_run.storage.root / "runs", root / "runs")
    recorded = read_manifest(RunLayout(root, "w").raw_dir(0)).inputs[0]
    elsewhere = tmp_path / "nowhere"  # another rollout.policy now: not what sampled the iteration
    code, err = run_cli(capsys, "update", "--run", "w", f"storage.root={root}", f"rollout.policy={elsewhere}")
    assert code == 0, err
    assert json.loads((RunLayout(root, "w").checkpoint_dir(1) / "_CHECKPOINT.json").read_text())["source"] == recorded


def test_a_rollout_whose_every_prompt_is_too_long_is_refused(tmp_path, capsys):
    """Every row finished 'prompt_too_long' with no token, the shard was committed, and the command said
    `raw shard: 2 trajectories` (Qwen3's tool system prompt alone is ~190 tokens)."""
    code, err = run_cli(
        capsys,
        "rollout",
        "--run",
        "p",
        f"storage.root={tmp_path}",
        "rollout.max_prompt_tokens=8",
        "rollout.tasks_per_iteration=2",
        "rollout.samples_per_prompt=1",
    )
    assert code == 1 and "longer than rollout.max_prompt_tokens (8 tokens" in one_line(err), err
    assert not list(tmp_path.rglob("*.parquet"))


def test_a_flow_log_says_when_some_prompts_were_too_long(tmp_path, capsys):
    """Some prompts longer than rollout.max_prompt_tokens became reward -1 rows without a word in a training flow's
    log (`cleaner rollout` said it from the manifest)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from pipeline.config import DEFAULT_POLICY, load_config
    from rollout_gen.stage import run_rollout_stage

    tasks = tmp_path / "t.parquet"
    pq.write_table(
        pa.table({"problem": ["What is 2 + 3?", "Please think. " * 200 + "What is 2 + 4?"], "answer": ["5", "6"]}),
        tasks,
    )
    cfg = load_config(
        None,
        [
            f"storage.root={tmp_path / 'ws'}",
            f"rollout.tasks={tasks}",
            "rollout.tasks_per_iteration=2",
            "rollout.samples_per_prompt=2",
        ],
    )
    lines: list[str] = []
    manifest = run_rollout_stage(cfg, "p", 0, DEFAULT_POLICY, show_progress=False, log=lines.append)
    assert manifest.extra["prompt_too_long"] == 2
    assert any("1 of 2 prompts are longer than rollout.max_prompt_tokens (256)" in line for line in lines), lines
    # `cleaner rollout` says it from the manifest, which counts trajectories (it said "2 prompts" of one prompt)
    args = [f"storage.root={tmp_path / 'ws'}", f"rollout.tasks={tasks}", "rollout.tasks_per_iteration=2"]
    args += ["rollout.samples_per_prompt=2", f"rollout.policy={DEFAULT_POLICY}"]
    capsys.readouterr()
    assert main(["rollout", "--run", "p", "--iteration", "0", *args]) == 0
    out = capsys.readouterr().out
    assert "2 trajectories were not rolled out: their prompts are longer than rollout.max_prompt_tokens" in out, out


def test_an_update_that_diverges_is_one_line_and_writes_nothing(purified_run, tmp_path, capsys):
    """train.lr=1e30: a 25-line FloatingPointError traceback before."""
    root = tmp_path / "ws"
    shutil.copytree(purified_run.storage.root / "runs", root / "runs")
    code, err = run_cli(capsys, "update", "--run", "w", f"storage.root={root}", "train.lr=1e30", "train.warmup_steps=0")
    line = err.strip().splitlines()[-1]  # after the steps taken (their lines are progress, not errors)
    assert code == 1 and "Traceback" not in err and line.startswith("cleaner update: "), err[-3000:]
    assert " is nan at optimizer step " in line and "lower train.lr" in line, line
    assert not RunLayout(root, "w").checkpoint_dir(1).exists()


def test_an_update_rerun_with_other_train_settings_is_refused_not_kept(purified_run, tmp_path, capsys):
    """`cleaner update` on a committed checkpoint said 'kept (already committed)', exit 0, with any train settings:
    a user who asked for train.mode=raw or another lr believed it was trained so. Refused in one line now, as a
    rollout or purify rerun with other settings is; the same settings still keep it."""
    root = tmp_path / "ws"
    shutil.copytree(purified_run.storage.root / "runs", root / "runs")
    code, err = run_cli(capsys, "update", "--run", "w", f"storage.root={root}")
    assert code == 0, err
    marker = RunLayout(root, "w").checkpoint_dir(1) / "_CHECKPOINT.json"
    before = marker.read_bytes()
    code, err = run_cli(capsys, "update", "--run", "w", f"storage.root={root}", "train.lr=5e-5")
    line = one_line(err)
    assert code == 1 and "committed by an update with other train settings" in line and "flow.run_id" in line, line
    assert marker.read_bytes() == before
    capsys.readouterr()
    assert main(["update", "--run", "w", f"storage.root={root}"]) == 0
    assert "kept (already committed)" in capsys.readouterr().out


# ---------------------------------------------------------------- §3 workspace errors


def test_workspace_under_a_file_is_one_line(tmp_path, capsys):
    afile = tmp_path / "hostname"
    afile.write_text("x")
    for argv in (["rollout"], ["inspect"], ["purify"]):
        code, err = run_cli(capsys, *argv, f"storage.root={afile}/x")
        line = one_line(err)
        assert code == 1 and f"{afile}" in line, line


def test_read_only_workspace_is_one_line(tmpfs, capsys):
    root = tmpfs("1m", ro=True)
    code, err = run_cli(capsys, "rollout", f"storage.root={root}")
    assert code == 1 and "read-only" in one_line(err)


def test_disk_full_during_rollout_leaves_nothing(tmpfs, capsys):
    root = tmpfs("1m")
    filler = fill(root)
    before = files_under(root)
    code, err = run_cli(
        capsys,
        "rollout",
        "--run",
        "w",
        f"storage.root={root}",
        "rollout.tasks_per_iteration=1",
        "rollout.samples_per_prompt=2",
    )
    line = one_line(err)
    assert code == 1 and "disk is full" in line, line
    assert files_under(root) == before and filler.exists()


def test_disk_full_during_purify_leaves_nothing(world_rollout, tmpfs, capsys):
    root = tmpfs("1m")
    copy_iteration(world_rollout, root, "raw")
    fill(root)
    before = files_under(root)
    code, err = run_cli(
        capsys, "purify", "--run", "w", f"storage.root={root}", "purify.modes=[saar]", "purify.gammas=[0.5]"
    )
    line = one_line(err)
    assert code == 1 and "disk is full" in line, line
    assert files_under(root) == before
    assert not (RunLayout(root, "w").iteration_dir(0) / ".staging").exists()


def test_disk_full_during_update_leaves_nothing(purified_run, tmpfs, capsys):
    root = tmpfs("2m")
    copy_iteration(purified_run, root, "raw", "purified")
    fill(root)
    before = files_under(root)
    code, err = run_cli(capsys, "update", "--run", "w", f"storage.root={root}")
    line = one_line(err)
    assert code == 1 and "disk is full" in line, line
    assert files_under(root) == before  # no half-written partial state, no half checkpoint


# The same four without root: in a user and mount namespace of their own (namespace_tmpfs)


def test_read_only_workspace_is_one_line_without_root(tmp_path):
    out = namespace_tmpfs(tmp_path, "1m", ["rollout", "storage.root={root}"], ro=True)
    assert out["code"] == 1 and "read-only" in one_line(out["err"])


def test_disk_full_during_rollout_leaves_nothing_without_root(tmp_path):
    out = namespace_tmpfs(
        tmp_path,
        "1m",
        [
            "rollout",
            "--run",
            "w",
            "storage.root={root}",
            "rollout.tasks_per_iteration=1",
            "rollout.samples_per_prompt=2",
        ],
    )
    line = one_line(out["err"])
    assert out["code"] == 1 and "disk is full" in line, line
    assert out["unchanged"]


def test_disk_full_during_purify_leaves_nothing_without_root(world_rollout, tmp_path):
    seed = tmp_path / "seed"
    copy_iteration(world_rollout, seed, "raw")
    out = namespace_tmpfs(
        tmp_path,
        "1m",
        ["purify", "--run", "w", "storage.root={root}", "purify.modes=[saar]", "purify.gammas=[0.5]"],
        seed=seed,
    )
    line = one_line(out["err"])
    assert out["code"] == 1 and "disk is full" in line, line
    assert out["unchanged"] and not out["staging"]


def test_disk_full_during_update_leaves_nothing_without_root(purified_run, tmp_path):
    seed = tmp_path / "seed"
    copy_iteration(purified_run, seed, "raw", "purified")
    out = namespace_tmpfs(tmp_path, "2m", ["update", "--run", "w", "storage.root={root}"], seed=seed)
    line = one_line(out["err"])
    assert out["code"] == 1 and "disk is full" in line, line
    assert out["unchanged"]


# ---------------------------------------------------------------- §2/§3 inspect and report


def test_inspect_on_a_missing_root_says_so_and_creates_nothing(tmp_path, capsys):
    typo = tmp_path / "worksapce"
    code, err = run_cli(capsys, "inspect", f"storage.root={typo}")
    line = one_line(err)
    assert code == 1 and str(typo) in line and "does not exist" in line
    assert not typo.exists()


def test_inspect_bad_sql_is_one_line(tmp_path, capsys):
    code, err = run_cli(capsys, "inspect", f"storage.root={tmp_path}", "--sql", "SELEC nonsense FROM nowhere")
    assert code == 1 and "SELEC" in one_line(err)


def test_inspect_names_corrupt_and_uncommitted_shards(world_rollout, tmp_path, capsys):
    copy_iteration(world_rollout, tmp_path, "raw")
    flip_byte(RunLayout(tmp_path, "w").raw_dir(0) / "part-00000.parquet")
    crashed = RunLayout(tmp_path, "w").raw_dir(1)
    crashed.mkdir(parents=True)
    shutil.copy(RunLayout(world_rollout.storage.root, "w").raw_dir(0) / "part-00000.parquet", crashed)
    code, err = run_cli(capsys, "inspect", f"storage.root={tmp_path}")
    assert "Traceback" not in err
    assert "iteration=0000/raw/part-00000.parquet: checksum mismatch" in err, err
    assert "iteration=0001/raw: not committed" in err, err


def test_report_of_a_missing_run_or_a_corrupt_shard_leaves_the_root_identical(world_rollout, tmp_path, capsys):
    copy_iteration(world_rollout, tmp_path, "raw")
    before = files_under(tmp_path)
    dirs = sorted(p for p in tmp_path.rglob("*"))
    code, err = run_cli(capsys, "report", "--run", "missing", f"storage.root={tmp_path}")
    assert code == 1 and "missing" in one_line(err)
    flip_byte(RunLayout(tmp_path, "w").raw_dir(0) / "part-00000.parquet")
    before = files_under(tmp_path)
    code, err = run_cli(capsys, "report", "--run", "w", f"storage.root={tmp_path}")
    assert code == 1 and "part-00000.parquet: checksum mismatch" in one_line(err)
    assert files_under(tmp_path) == before and sorted(p for p in tmp_path.rglob("*")) == dirs


def test_a_rollout_past_the_policys_context_says_so(tmp_path, capsys):
    """Trajectories longer than the policy's max_position_embeddings were rolled out, purified and trained on
    without a word (a user's 1,217-token rows on a 512-position model). Nothing stops them (the length settings
    bound a rollout; RoPE extrapolates), but the rollout now counts them in its manifest and says so, with the
    settings that would stay inside."""
    import json

    from pipeline.config import DEFAULT_POLICY
    from storage.shards import read_manifest

    policy = tmp_path / "short-context"
    shutil.copytree(DEFAULT_POLICY, policy)
    config = json.loads((policy / "config.json").read_text())
    (policy / "config.json").write_text(json.dumps({**config, "max_position_embeddings": 64}))
    args = [f"storage.root={tmp_path / 'ws'}", f"rollout.policy={policy}"]
    args += ["rollout.tasks_per_iteration=1", "rollout.samples_per_prompt=2"]
    capsys.readouterr()
    assert main(["rollout", "--run", "p", "--iteration", "0", *args]) == 0
    out = capsys.readouterr().out
    manifest = read_manifest(RunLayout(tmp_path / "ws", "p").raw_dir(0))
    assert manifest.extra["past_max_positions"] == 2  # every world prompt alone is longer than 64 tokens
    assert "2 trajectories run past the policy's max_position_embeddings (64)" in out, out
    assert main(["rollout", "--run", "p", "--iteration", "0", *args]) == 0  # kept: said once, when rolled out
    assert "max_position_embeddings" not in capsys.readouterr().out


def test_a_second_rollout_or_update_of_one_iteration_is_refused_at_once(purified_run, tmp_path, capsys):
    """Two commands writing one iteration (two `cleaner train` of one run): both rolled out in full and then broke
    each other's shard, and two updates shared one staging folder ("Directory not empty"). A rollout holds its
    raw shard's lock, an update its checkpoint's, for as long as they run: another command is refused before any
    work, in one line naming the holder's pid (here this process holds them, as a first command would)."""
    from storage.locks import WriterLock

    root = tmp_path / "ws"
    layout = RunLayout(root, "busy")
    raw = layout.raw_dir(0)
    with WriterLock.beside(raw, "held"):
        code, err = run_cli(capsys, "rollout", "--run", "busy", f"storage.root={root}")
    assert code == 1 and f"(pid {os.getpid()})" in one_line(err) and "being written by" in err
    assert not raw.exists() and not list(root.rglob("*.lock"))  # refused before anything, and no lock left

    shutil.copytree(purified_run.storage.root / "runs", root / "runs")
    target = RunLayout(root, "w").checkpoint_dir(1)
    with WriterLock.beside(target, "held"):
        code, err = run_cli(capsys, "update", "--run", "w", f"storage.root={root}")
    assert code == 1 and f"(pid {os.getpid()})" in one_line(err) and "checkpoint" in err
    assert not target.exists() and not list(root.rglob("*.lock"))


def test_a_shard_removed_while_a_command_reads_it_is_one_line(purified_run, tmp_path):
    """`cleaner gc` removed a partition while a replay read the catalog's views made before: the replay died in a
    raw `_duckdb.IOException` traceback. Such failures of a library that are the environment's, not a bug, get one
    line from the command (flows/cli.environment_message); a Prefect server that stopped mid-flow too."""
    import httpx

    from flows.cli import environment_message
    from storage.catalog import Catalog

    root = tmp_path / "ws"
    shutil.copytree(purified_run.storage.root / "runs", root / "runs")
    with Catalog(root) as cat:
        part = RunLayout(root, "w").purified_dir(0, "saar", 0.5)
        shutil.rmtree(part)  # what a concurrent `cleaner gc --remove-partition` does
        with pytest.raises(Exception) as e:
            cat.query("SELECT count(*) FROM purified WHERE mode = 'saar'")
    line = environment_message(e.value)
    assert line is not None and "removed meanwhile" in line and "\n" not in line, (type(e.value), e.value)
    refused = httpx.ConnectError("[Errno 111] Connection refused")
    assert "Prefect server" in environment_message(refused, "train")
    assert environment_message(refused, "init-policy") is None  # no Prefect there: another server, not said so
    assert environment_message(ValueError("a bug")) is None  # bugs keep their traceback
