"""The tool-use world: bootstrap cost (from the committed policy's provenance) and batched generation."""

from __future__ import annotations

import json

import torch

from benchmarks.common import BenchResult, Row
from pipeline.config import DEFAULT_POLICY, load_config
from flows.eval_cmd import evaluate_world


def run() -> BenchResult:
    torch.set_num_threads(1)
    prov = json.loads((DEFAULT_POLICY / "PROVENANCE.json").read_text())
    metrics = evaluate_world(load_config(None), DEFAULT_POLICY, show_progress=False)
    rows = [
        Row(
            "bootstrap wall time (corpus + tokenizer + SFT)",
            prov["wall_s"]["total"],
            None,
            "s",
            higher_is_better=False,
            target="<= 1800 s",
            passed=prov["wall_s"]["total"] <= 1800,
        ),
        Row("bootstrap SFT throughput", prov["train_tokens_per_s"], None, "tokens/s"),
        Row(
            "batched generation, 200 held-out episodes with tools", metrics["generated_tokens_per_s"], None, "tokens/s"
        ),
        Row(
            "held-out accuracy (T=1.0)",
            metrics["accuracy"],
            None,
            "fraction",
            target="0.30–0.95",
            passed=0.30 <= metrics["accuracy"] <= 0.95,
        ),
    ]
    notes = [
        "bootstrap figures are those recorded in policies/tiny-tool-policy/PROVENANCE.json by "
        f"`{prov['command'].strip()}` "
        f"({prov['config']['sft']['steps']} SFT steps, "
        f"{prov['corpus']['transcripts']} transcripts); rerun it with `cleaner bootstrap --out DIR` (about 18 min).",
        "the evaluation episode metrics: "
        + json.dumps(
            {k: metrics[k] for k in ("well_formed_call_rate", "first_call_failure_rate", "retry_success_rate")}
        ),
    ]
    return BenchResult("world", "The committed tiny policy: bootstrap cost and generation speed.", rows, notes)
