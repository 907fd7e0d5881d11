"""A checkpoint is loaded as the project computes with it, or refused in one line before anything is written:
a config.json of another architecture (transformers initialises the missing weights at random and drops the
others: the run sampled from and trained another model), and a model that transforms its logits (rollout
sampled with capped logits; purify failed later with a 117-line Beam traceback)."""

from __future__ import annotations

import json
import shutil

import pytest

from pipeline.config import DEFAULT_POLICY
from pipeline.policy_model import load_causal_lm
from storage.errors import CheckpointError
from tests.flow_helpers import run_cleaner


def _copy(tmp_path, **config):
    policy = tmp_path / "policy"
    shutil.copytree(DEFAULT_POLICY, policy)
    doc = json.loads((policy / "config.json").read_text())
    (policy / "config.json").write_text(json.dumps({**doc, **config}))
    return policy


def test_the_committed_policy_loads():
    assert type(load_causal_lm(DEFAULT_POLICY, "eager")).__name__ == "Qwen3ForCausalLM"


def test_a_config_of_another_architecture_is_refused(tmp_path):
    policy = _copy(tmp_path, architectures=["LlamaForCausalLM"], model_type="llama")
    with pytest.raises(
        CheckpointError,
        match=r"config\.json: its architectures \['LlamaForCausalLM'\] do not fit "
        r"the weight files: unexpected \d+ \(model\.layers\.0\.self_attn\.k_norm",
    ):
        load_causal_lm(policy, "eager")
    out = run_cleaner(
        [
            "rollout",
            "--run",
            "r",
            f"rollout.policy={policy}",
            f"storage.root={tmp_path / 'ws'}",
            "rollout.tasks_per_iteration=1",
            "rollout.samples_per_prompt=1",
        ],
        tmp_path,
    )
    assert out.returncode == 1 and "Traceback" not in out.stderr and "LOAD REPORT" not in out.stderr, out.stderr
    assert out.stderr.strip().splitlines()[-1].startswith(f"cleaner rollout: {policy}/config.json: its architectures")
    assert not list((tmp_path / "ws").rglob("*.parquet"))


def test_a_model_that_transforms_its_logits_is_refused_when_loaded(tmp_path):
    policy = _copy(tmp_path, final_logit_softcapping=30.0)
    with pytest.raises(CheckpointError, match="transforms its logits \\(final_logit_softcapping\\)"):
        load_causal_lm(policy, "eager")


def test_a_tokenizer_without_vocabulary_or_of_another_model_is_refused(tmp_path):
    """Without tokenizer.json transformers built a 26-token tokenizer and the rollout committed nonsense ids; a
    bigger model's tokenizer beside small weights failed mid-rollout with an IndexError traceback."""
    from pipeline.chat import load_chat
    from pipeline.qwen3_tokenizer import TOKENIZER_DIR

    bare = _copy(tmp_path)
    (bare / "tokenizer.json").unlink()
    with pytest.raises(CheckpointError, match="tokenizer_config.json without a vocabulary beside it"):
        load_chat(bare)
    mixed = tmp_path / "mixed"
    shutil.copytree(DEFAULT_POLICY, mixed)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copyfile(TOKENIZER_DIR / name, mixed / name)
    with pytest.raises(CheckpointError, match="its tokenizer has 151,669 ids and config.json vocab_size is 1,024"):
        load_chat(mixed)
    weights = tmp_path / "model.safetensors"
    weights.write_bytes(b"x")
    with pytest.raises(CheckpointError, match="is a file, not a checkpoint folder"):
        load_chat(weights)
