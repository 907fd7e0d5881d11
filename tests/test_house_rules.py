"""Names, not positions: a value reaches its parameter or field by name wherever a position would be easy
to get wrong.

1. No call in the product packages passes 7 or more positional arguments (a dataclass or a function of that
   many parameters is called by keyword).
2. The trainer's metrics are accumulated and summed over the ranks by field name, so a metric added to
   StepMetrics and measured in the update is reduced with the others, nothing else touched.

And one style: `ruff check .` and `ruff format --check .` pass on the whole tree (line length included), so a
diff holds what changed, not what a formatter would move.
"""

from __future__ import annotations

import ast
import dataclasses
import math
import random
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from pipeline.config import DEFAULT_POLICY, TrainConfig
from trainer.batches import TrainingRow, mini_batches
from trainer.dpo import CallPair
from trainer.grpo import GRPOUpdate

ROOT = Path(__file__).resolve().parent.parent
PRODUCT = ("pipeline", "flows", "rollout_gen", "purifier", "trainer", "storage", "experiments", "benchmarks")
MOST_POSITIONAL = 6


def _positional_calls(source: str, where: str) -> list[str]:
    """`where:line: n callee` of each call in the source with more than MOST_POSITIONAL positional arguments
    (a *-unpacked one counts as one: the positions it fills are no easier to check)."""
    return [
        f"{where}:{node.lineno}: {len(node.args)} {ast.unparse(node.func)}"
        for node in ast.walk(ast.parse(source, where))
        if isinstance(node, ast.Call) and len(node.args) > MOST_POSITIONAL
    ]


def test_no_call_passes_seven_or_more_positional_arguments():
    files = [path for package in PRODUCT for path in sorted((ROOT / package).rglob("*.py"))]
    assert len(files) > 100  # the walk found the packages
    calls = [call for path in files for call in _positional_calls(path.read_text(), str(path.relative_to(ROOT)))]
    assert not calls, "pass these arguments by keyword:\n" + "\n".join(calls)


def test_the_rule_counts_positional_arguments_only():
    source = "f(1, 2, 3, 4, 5, 6, key=7)\ng(1, 2, 3, 4, 5, *rest)\nh(\n    1, 2, 3, 4, 5, *rest, 7)\n"
    assert _positional_calls(source, "probe.py") == ["probe.py:3: 7 h"]


# ---- the trainer's metrics over ranks --------------------------------------------------------------------


class _Collectives:
    """What torch.distributed gives the ranks, for ranks that are threads of this process: each hands in its
    values and gets back every rank's, combined element by element in rank order."""

    def __init__(self, ranks: int) -> None:
        self.barrier = threading.Barrier(ranks, timeout=300)
        self.slots: list[list[float]] = [[] for _ in range(ranks)]

    def all_reduce(self, rank: int, values: list[float], op=sum) -> list[float]:
        self.slots[rank] = list(values)
        self.barrier.wait()
        out = [op(column) for column in zip(*self.slots)]
        self.barrier.wait()  # every rank has read the slots before any writes its next values
        return out


class _ThreadRank(GRPOUpdate):
    """GRPOUpdate as one rank of a data-parallel update (the hooks trainer/deepspeed_update.py overrides), its
    collectives over threads. No optimizer step: the metrics are compared, not the weights."""

    def __init__(
        self,
        model: torch.nn.Module,
        cfg: TrainConfig,
        rank: int,
        world: _Collectives,
        reduced: dict[int, dict[str, float]],
    ) -> None:
        self.rank, self.world, self.reduced = rank, world, reduced
        self.world_size = len(world.slots)
        super().__init__(model, cfg)

    def my_groups(self, groups):
        return groups[self.rank :: self.world_size]

    def reduce(self, values: list[float]) -> list[float]:
        return self.world.all_reduce(self.rank, values)

    def reduce_metrics(self, sums: dict[str, float]) -> dict[str, float]:
        self.reduced[self.rank] = dict(sums)  # this rank's own sums, by name
        return super().reduce_metrics(sums)

    def most(self, n: int) -> int:
        return int(self.world.all_reduce(self.rank, [n], op=max)[0])

    def step(self) -> float:
        return 0.0


def _model() -> torch.nn.Module:
    return AutoModelForCausalLM.from_pretrained(DEFAULT_POLICY, dtype=torch.float32, attn_implementation="eager")


def _rows_and_pairs(groups: int, seed: int = 0) -> tuple[list[TrainingRow], list[CallPair]]:
    """Three rows per prompt group, whose behaviour log-probs put π_old / π_behaviour inside and outside the
    correction's bounds, and two tool-call pairs per group."""
    rng = random.Random(seed)
    draw = lambda lo, hi: [rng.randrange(5, 900) for _ in range(rng.randint(lo, hi))]
    rows, pairs = [], []
    for g in range(groups):
        prompt = draw(4, 8)
        for i in range(3):
            resp = draw(5, 12)
            old = [-rng.uniform(0.5, 8.0) for _ in resp]
            rows.append(
                TrainingRow(
                    raw_key=f"r/0/p{g}/{i}",
                    prompt_id=f"p{g}",
                    sample_idx=i,
                    prompt_ids=prompt,
                    response_ids=resp,
                    loss_mask=[int(rng.random() < 0.8) for _ in resp],
                    old_logprobs=old,
                    advantage=rng.choice([-1.5, -0.5, 0.7, 1.2]),
                    behaviour_logprobs=[o - math.log(rng.choice([0.2, 1.0, 1.3, 6.0])) for o in old],
                )
            )
        for k in range(2):
            chosen, rejected = draw(5, 11), draw(5, 11)
            pairs.append(
                CallPair(
                    prompt_id=f"p{g}",
                    raw_key=f"r/0/p{g}/0",
                    position_idx=k,
                    context=prompt + draw(3, 9),
                    chosen=chosen,
                    chosen_call=rng.randint(1, 4),
                    rejected=rejected,
                    rejected_call=rng.randint(1, 4),
                )
            )
    return rows, pairs


def test_every_metric_of_two_ranks_is_the_one_process_metric():
    """Two ranks, each training half the prompt groups, report every StepMetrics field as one process training
    them all does: a metric a rank measures but the ranks do not sum would be that rank's share alone. The
    config switches every optional metric on, and every sum is non-zero on both ranks, so none goes unchecked."""
    rows, pairs = _rows_and_pairs(groups=4)  # p0, p2 on rank 0; p1, p3 on rank 1
    cfg = TrainConfig(
        mini_batches=1,
        micro_batch_tokens=60,
        log_entropy=True,
        rollout_correction="token_mis",
        use_dpo_on_tool_calls=True,
    )
    (groups,) = mini_batches(rows, 1)

    one = GRPOUpdate(_model(), cfg)
    one.set_dpo_pairs(pairs)
    one.step = lambda: 0.0
    alone = dataclasses.asdict(one.minibatch(groups, pad_id=0))

    world, reduced, got, failed = _Collectives(2), {}, {}, []
    ranks = [_ThreadRank(_model(), cfg, rank, world, reduced) for rank in range(2)]

    def run(rank: int) -> None:
        try:
            ranks[rank].set_dpo_pairs(pairs)
            got[rank] = dataclasses.asdict(ranks[rank].minibatch(groups, pad_id=0))
        except BaseException as e:  # the other rank is released, not left at the barrier
            failed.append(e)
            world.barrier.abort()

    threads = [threading.Thread(target=run, args=(rank,)) for rank in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if failed:
        raise failed[0]

    assert None not in alone.values(), "switch this metric on in the test's config"
    for name in reduced[0]:
        assert reduced[0][name] and reduced[1][name], f"{name}: not measured on both ranks, so not checked"
    for rank in range(2):
        for name, value in alone.items():
            if name != "seconds":
                assert got[rank][name] == pytest.approx(value, rel=1e-5, abs=1e-7), (rank, name)


# ---- one style ---------------------------------------------------------------------------------------------------

RUFF = Path(sys.executable).parent / "ruff"  # the dev extra's, which `make test-env` installs into the venv


def _ruff(*args: str) -> subprocess.CompletedProcess:
    if not RUFF.exists():
        pytest.skip(f"no ruff beside {sys.executable} (the dev extra installs it: make test-env)")
    return subprocess.run([str(RUFF), *args, "--no-cache", "."], cwd=ROOT, capture_output=True, text=True, timeout=300)


def test_ruff_check_passes():
    r = _ruff("check")
    assert r.returncode == 0, f"ruff check . exited {r.returncode}:\n{r.stdout}{r.stderr}"


def test_the_tree_is_ruff_formatted():
    r = _ruff("format", "--check")
    assert r.returncode == 0, f"ruff format --check . exited {r.returncode} (run ruff format .):\n{r.stdout}{r.stderr}"


def test_one_name_for_first_call_failures_per_trajectory():
    """One concept, one name: the mean of stats.first_attempt_failures was tool_errors_per_traj in the report,
    tool_errors in the demo's printed query, first_failures(_per_traj) in inspect and first_call_failures in the
    viewer, while `cleaner eval` stores it as first_call_failures_per_trajectory."""
    import re

    names = set()
    for package in PRODUCT:
        for path in (ROOT / package).glob("**/*.py"):
            names |= set(re.findall(r"avg\(stats\.first_attempt_failures\) AS (\w+)", path.read_text()))
    evaluate = (ROOT / "rollout_gen" / "evaluate.py").read_text()
    assert names == {"first_call_failures_per_trajectory"} and '"first_call_failures_per_trajectory"' in evaluate
