import os
import sys
from pathlib import Path

# Tests import the packages from the checkout, whatever the working directory.
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


import pytest  # noqa: E402


@pytest.fixture(scope="session")
def world_rollout(tmp_path_factory):
    """One real rollout of the committed tiny policy (16 tasks × 4 samples), shared by stage tests."""
    from pipeline.config import DEFAULT_POLICY, load_config
    from rollout_gen.stage import run_rollout_stage

    root = tmp_path_factory.mktemp("world-rollout")
    cfg = load_config(
        None,
        [f"storage.root={root}", "rollout.tasks_per_iteration=16", "rollout.samples_per_prompt=4", "rollout.seed=3"],
    )
    run_rollout_stage(cfg, "w", 0, DEFAULT_POLICY, show_progress=False)
    return cfg


@pytest.fixture()
def world_copy(world_rollout, tmp_path):
    """A private copy of world_rollout's runs under tmp_path/ws: tests that write beside its shards."""
    from tests.flow_helpers import copy_runs

    cfg = world_rollout.model_copy(deep=True)
    cfg.storage.root = copy_runs(world_rollout.storage.root, tmp_path / "ws")
    return cfg


@pytest.fixture(scope="session")
def purified_run(world_rollout, tmp_path_factory):
    """world_rollout purified (saar, γ=0.5): iteration 0 ready for an update."""
    from purifier.stage import run_purify_stage
    from tests.flow_helpers import rollout_copy

    cfg = rollout_copy(world_rollout, tmp_path_factory, "train")
    cfg.purify.modes, cfg.purify.gammas = ["saar"], [0.5]
    run_purify_stage(cfg, "w", 0)
    return cfg


@pytest.fixture(scope="session")
def chat():
    """The committed tiny policy's chat format (its real tokenizer)."""
    from pipeline.config import DEFAULT_POLICY
    from pipeline.chat import load_chat

    return load_chat(DEFAULT_POLICY)


@pytest.fixture(scope="session")
def sandbox():
    """One real sandbox pool shared by the tests that run tool calls."""
    from rollout_gen.sandbox import SandboxPool

    with SandboxPool() as pool:
        yield pool


@pytest.fixture(scope="session")
def uninterrupted(tmp_path_factory):
    """`cleaner train` on a tiny config (run `tiny`, 2 iterations), once per session, never modified: tests
    that change a run work on a copy."""
    from tests.flow_helpers import train

    root = tmp_path_factory.mktemp("flow-a")
    train(root)
    return root
