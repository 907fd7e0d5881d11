"""The premise of purification, measured (issue 19 §1): trajectory kinds, GRPO advantages computed in SQL,
and the failed-call tokens each purified partition trains, by advantage sign — on a scripted group that
covers every kind and outcome (expectations stated by hand from the rules) and on a real rollout of the
tiny policy (checked against purify() itself, with the failed calls' tokens tagged)."""

from __future__ import annotations

import copy
import shutil

import pytest

from flows.premise import RULE, prediction
from flows.replay_cmd import run_replay
from flows.report import write_report
from pipeline.kinds import failed_call, trajectory_kind
from pipeline.config import DEFAULT_POLICY, load_config
from pipeline.modes import MODES, partition_threshold
from pipeline.trajectory import purified_from_row, trajectory_from_row
from purifier.advantages import group_advantages
from purifier.recompute import CPURecompute
from purifier.saar import purify
from purifier.stage import run_purify_stage
from pipeline.variants import plan_variants
from storage.catalog import Catalog
from storage.layout import RunLayout
from storage.schemas import PURIFIED, RAW
from storage.shards import read_shard
from tests.scripted_group import NAMES, SCRIPTS, build_group, write_group
from tests.flow_helpers import rollout_copy

GAMMA = 0.5
TAG = 1 << 24  # added to the ids of failed-call tokens; decoding removes it, so every decision is unchanged


def purify_all(cfg, run_id: str) -> None:
    run_purify_stage(cfg, run_id, 0, plan_variants(cfg, list(MODES), [GAMMA]))


@pytest.fixture(scope="module")
def scripted(chat, sandbox, tmp_path_factory):
    root = tmp_path_factory.mktemp("premise-scripted")
    trajectories = build_group(chat, sandbox)
    write_group(root, trajectories)
    cfg = load_config(None, [f"storage.root={root}", f"rollout.samples_per_prompt={len(NAMES)}"])
    purify_all(cfg, "s")
    return cfg, trajectories


@pytest.fixture(scope="module")
def real(world_rollout, tmp_path_factory):
    cfg = rollout_copy(world_rollout, tmp_path_factory, "premise-real")
    purify_all(cfg, "w")
    return cfg


def _query(cfg, sql: str) -> list[dict]:
    with Catalog(cfg.storage.root) as cat:
        return cat.query(sql).to_pylist()


def _partition(cfg, run_id: str, mode: str):
    d = RunLayout(cfg.storage.root, run_id).purified_dir(0, mode, partition_threshold(mode, GAMMA))  # saar_is: τ = 0.5
    return [purified_from_row(r) for r in read_shard(d, PURIFIED).to_pylist()]


def test_kinds_of_the_scripted_group_are_the_stated_ones(scripted):
    cfg, trajectories = scripted
    rows = _query(cfg, "SELECT sample_idx, kind FROM raw_kinds ORDER BY sample_idx")
    stated = [SCRIPTS[n][4] for n in NAMES]
    assert [r["kind"] for r in rows] == stated
    assert [trajectory_kind(t) for t in trajectories] == stated
    per_kind = {r["kind"]: r for r in _query(cfg, "SELECT * FROM trajectory_kinds")}
    assert {k: r["trajectories"] for k, r in per_kind.items()} == {
        "clean": 2,
        "recovered": 3,
        "not_recovered": 3,
        "infra": 1,
    }
    assert per_kind["not_recovered"]["mean_reward"] == -1.0 and per_kind["infra"]["correct"] == 1.0
    assert per_kind["recovered"]["correct"] == pytest.approx(2 / 3)


def test_sql_kinds_equal_python_kinds_on_real_rollouts(real):
    raws = [trajectory_from_row(r) for r in read_shard(RunLayout(real.storage.root, "w").raw_dir(0), RAW).to_pylist()]
    sql = {(r["prompt_id"], r["sample_idx"]): r["kind"] for r in _query(real, "SELECT * FROM raw_kinds")}
    assert len(sql) == len(raws) == 64
    assert all(sql[(t.prompt_id, t.sample_idx)] == trajectory_kind(t) for t in raws)
    assert {"clean", "recovered"} <= set(sql.values())


@pytest.mark.parametrize("which", ["scripted", "real"])
def test_advantages_in_sql_equal_group_norm(which, request):
    cfg = request.getfixturevalue(which)
    cfg = cfg[0] if isinstance(cfg, tuple) else cfg
    rows = _query(cfg, "SELECT prompt_id, sample_idx, reward, advantage FROM raw_kinds ORDER BY prompt_id, sample_idx")
    groups: dict[str, list[dict]] = {}
    for r in rows:
        groups.setdefault(r["prompt_id"], []).append(r)
    for g in groups.values():
        want = group_advantages([r["reward"] for r in g], "group_norm")
        assert [r["advantage"] for r in g] == pytest.approx(want, rel=1e-12, abs=1e-12)
    assert any(a != 0 for r in rows for a in [r["advantage"]])


def _call_tokens(t, attempt_idx: int, position_idx: int = 0) -> int:
    a = t.positions[position_idx].attempts[attempt_idx]
    return len(a.turn_ids) - max(a.call_start, 0)


# (script name, attempt index) of the failed calls each mode keeps in the loss, read off docs/saar.md's rules
ALL_FAILED = [
    ("recovered_correct", 0),
    ("recovered_wrong", 0),
    *[("exhausted", i) for i in range(4)],
    ("gave_up", 0),
    ("infra", 0),
    ("gate_off", 0),
    ("malformed_recovered", 0),
]
KEPT = {
    "raw": ALL_FAILED,
    "void_turn": [f for f in ALL_FAILED if f[0] != "malformed_recovered"],  # its unclosed call voids the row
    "saar": [("exhausted", 3), ("gave_up", 0), ("gate_off", 0)],
    "saar_correct": [("recovered_wrong", 0), *[("exhausted", i) for i in range(4)], ("gave_up", 0), ("gate_off", 0)],
    "mask_failed": [f for f in ALL_FAILED if f[0] not in ("recovered_correct", "malformed_recovered")],
}


@pytest.mark.parametrize("mode", sorted(KEPT))
def test_failed_calls_each_mode_trains_on_the_scripted_group(scripted, mode):
    cfg, trajectories = scripted
    by_name = dict(zip(NAMES, trajectories))
    assert all(failed_call(by_name[n].positions[0].attempts[a]) for n, a in ALL_FAILED)
    total = sum(_call_tokens(by_name[n], a) for n, a in ALL_FAILED)
    kept = KEPT[mode]
    # the group's mean reward is -1/9: correct rows have a positive advantage, wrong ones a negative one
    positive = sum(_call_tokens(by_name[n], a) for n, a in kept if by_name[n].reward > 0)
    negative = sum(_call_tokens(by_name[n], a) for n, a in kept if by_name[n].reward < 0)
    (row,) = _query(cfg, f"SELECT * FROM failed_call_advantage WHERE mode = '{mode}'")
    assert (row["failed_call_tokens"], row["trained"], row["on_positive"], row["on_negative"]) == (
        total,
        positive + negative,
        positive,
        negative,
    )
    assert row["share_negative"] == pytest.approx(negative / total)


def _tagged(t):
    t = copy.deepcopy(t)
    for p in t.positions:
        for a in p.attempts:
            if failed_call(a):
                start = max(a.call_start, 0)
                a.turn_ids = a.turn_ids[:start] + [i + TAG for i in a.turn_ids[start:]]
    return t


@pytest.mark.parametrize("which", ["real", "scripted"])
def test_failed_call_view_equals_purify_with_tagged_failed_calls(which, request, chat):
    """Whatever each mode does to a row, its failed-call tokens that stay trained are those purify() itself
    leaves with loss mask 1: the view's SQL rule is checked against the code that builds the partitions."""
    cfg = request.getfixturevalue(which)
    cfg, run_id = (cfg[0], "s") if isinstance(cfg, tuple) else (cfg, "w")
    raws = {
        t.key: t
        for t in (
            trajectory_from_row(r) for r in read_shard(RunLayout(cfg.storage.root, run_id).raw_dir(0), RAW).to_pylist()
        )
    }
    untag = lambda ids: [i - TAG if i >= TAG else i for i in ids]  # noqa: E731
    decode = lambda ids: chat.decode(untag(ids))  # noqa: E731
    backend = CPURecompute(DEFAULT_POLICY)
    score = lambda context, turn: backend.score(untag(context), untag(turn))  # noqa: E731 - saar_is, as the stage
    view = {r["mode"]: r for r in _query(cfg, "SELECT * FROM failed_call_advantage")}
    assert set(view) == set(MODES)
    for mode in MODES:
        trained = negative = positive = 0
        for p in _partition(cfg, run_id, mode):
            q = purify(_tagged(raws[p.raw_key]), GAMMA, mode, decode, score=score, tau=GAMMA)  # saar_is: τ = 0.5
            n = sum(1 for tok, m in zip(q.response_ids, q.loss_mask) if tok >= TAG and m)
            trained, negative, positive = (
                trained + n,
                negative + n * (p.advantage < 0),
                positive + n * (p.advantage > 0),
            )
        assert (view[mode]["trained"], view[mode]["on_negative"], view[mode]["on_positive"]) == (
            trained,
            negative,
            positive,
        ), mode
    assert view["raw"]["trained"] == view["raw"]["failed_call_tokens"] > view["saar"]["trained"]


TAUS = [0.001, 0.01, 0.1, 0.3, 0.9, 3.0]


def test_saar_is_failed_calls_in_the_view_equal_purify_at_every_tau(real, chat):
    """saar_is appends a retry below τ (the failed turn stays) and replaces only the turn before a retry at or above
    τ: an earlier failed call that was appended stays trained. The view counted every attempt before any later
    splice at the position as removed, so at some τ its counts (and the report's prediction) were wrong."""
    cfg = real
    run_purify_stage(cfg, "w", 0, plan_variants(cfg, ["saar_is"], [GAMMA], TAUS))
    raws = {
        t.key: t
        for t in (
            trajectory_from_row(r) for r in read_shard(RunLayout(cfg.storage.root, "w").raw_dir(0), RAW).to_pylist()
        )
    }
    untag = lambda ids: [i - TAG if i >= TAG else i for i in ids]  # noqa: E731
    backend = CPURecompute(DEFAULT_POLICY)
    view = {r["is_threshold"]: r for r in _query(cfg, "SELECT * FROM failed_call_advantage WHERE mode = 'saar_is'")}
    appended_then_replaced = 0
    for tau in TAUS:
        d = RunLayout(cfg.storage.root, "w").purified_dir(0, "saar_is", tau)
        trained = negative = positive = 0
        for p in (purified_from_row(r) for r in read_shard(d, PURIFIED).to_pylist()):
            q = purify(
                _tagged(raws[p.raw_key]),
                0.0,
                "saar_is",
                lambda ids: chat.decode(untag(ids)),
                score=lambda context, turn: backend.score(untag(context), untag(turn)),
                tau=tau,
            )
            n = sum(1 for tok, m in zip(q.response_ids, q.loss_mask) if tok >= TAG and m)
            trained, negative, positive = (
                trained + n,
                negative + n * (p.advantage < 0),
                positive + n * (p.advantage > 0),
            )
            appended_then_replaced += any(
                s.attempt_idx > 1
                and not any(t.position_idx == s.position_idx and t.attempt_idx == s.attempt_idx - 1 for t in q.splices)
                for s in q.splices
            )
        assert (view[tau]["trained"], view[tau]["on_negative"], view[tau]["on_positive"]) == (
            trained,
            negative,
            positive,
        ), tau
    assert appended_then_replaced  # the case the rule missed is among them


def test_the_coarse_rule_is_shown_as_disproved_never_as_a_prediction():
    """Issue 32 §3: the coarse rule did not predict (docs/results/when_purification_helps_writeup.md point 5);
    the recovered trajectories' mean advantage is still shown, with what that rule would say marked disproved."""
    rows = [
        {"iteration": 0, "kind": "recovered", "mean_advantage": 0.2, "trajectories": 5},
        {"iteration": 1, "kind": "recovered", "mean_advantage": -0.1, "trajectories": 4},
        {"iteration": 2, "kind": "clean", "mean_advantage": 0.3, "trajectories": 9},
    ]
    assert prediction(rows, 0).endswith("+0.200 over 5: the disproved coarse rule would say help")
    assert prediction(rows, 1).endswith("the disproved coarse rule would say hurt")
    assert "no recovered trajectory" in prediction(rows, 2)
    assert RULE.startswith("coarse rule, disproved") and "point 5" in RULE
    assert not any("predicted to" in prediction(rows, i) for i in range(3))


def test_replay_prints_the_premise_table_and_the_rule(real, tmp_path, capsys):
    cfg = real.model_copy(deep=True)
    cfg.storage.root = tmp_path
    shutil.copytree(
        real.storage.root / "runs" / "w" / "iteration=0000" / "raw", tmp_path / "runs" / "w" / "iteration=0000" / "raw"
    )
    assert run_replay(cfg, "w", 0, gammas=[GAMMA], modes=["saar_correct", "roc"]) == 0
    out = capsys.readouterr().out
    kinds = _query(cfg, "SELECT * FROM trajectory_kinds")
    for k in kinds:
        line = next(ln for ln in out.splitlines() if f"│ {k['kind']} " in ln)
        assert f"│ {k['trajectories']} │".replace(" ", "") in line.replace(" ", "")
    assert " ".join(RULE.split()) in " ".join(out.split())
    recovered = next(k for k in kinds if k["kind"] == "recovered")
    assert f"recovered trajectories' mean advantage {recovered['mean_advantage']:+.3f}" in " ".join(out.split())
    modes = {ln.split("│")[1].strip() for ln in out.splitlines() if ln.count("│") == 11}
    assert modes == {"saar_correct", "roc"}  # the partitions this replay wrote, each with its failed-call row


def test_report_has_the_premise_panel(real):
    page = write_report(real.storage.root, "w").read_text()
    assert (
        "Does purification help? A hypothesis to check" in page
    )  # the token-level hypothesis: tests/test_report_rule.py
    assert '<p class="disproved" id="coarse-rule">Coarse rule, disproved' in page
    assert page.count(">not_recovered</a></td>") + page.count(">recovered</a></td>") >= 1
    assert "<th>share_<wbr>negative</th>" in page and '<td class="text">mask_failed</td>' in page
    # the off-policy panel: every partition's in-place tokens and the splices' importance ratios
    assert "Off-policy: how far each partition trains tokens" in page and '<td class="text">in_place</td>' in page
    assert '<td class="text">deep</td>' in page and '<img src="is_ratio.png"' in page


def test_token_level_prediction_compares_each_mode_with_raw():
    """Hand-stated rows: saar stops training 30 negative- and 10 positive-advantage failed-call tokens that
    raw trains (slower predicted); saar_correct stops only 10 positive ones (not slower); roc is not a
    removal, and says so (it was left out without a word); without a raw partition nothing is predicted."""
    from flows.premise import token_predictions

    def row(mode, neg, pos, gamma=0.0):
        return {
            "iteration": 0,
            "mode": mode,
            "gamma": gamma,
            "measure": None,
            "on_negative": neg,
            "on_positive": pos,
            "trained": neg + pos,
        }

    failed = [row("raw", 40, 10), row("saar", 10, 0, 0.5), row("saar_correct", 40, 0, 0.5), row("roc", 5, 5)]
    lines = token_predictions(failed, 0)
    roc = "iteration 0: roc drops whole rows (resampled groups), not failed calls: the rule does not apply"
    assert len(lines) == 3 and lines[2] == roc
    assert "saar γ=0.5 removes 30 negative- and 10 positive" in lines[0] and lines[0].endswith("predicted")
    assert "slower" in lines[0]
    assert "saar_correct γ=0.5 removes 0 negative- and 10 positive" in lines[1]
    assert lines[1].endswith("not predicted to be slower than raw")
    assert "no raw partition" in token_predictions([row("saar", 1, 0, 0.5)], 0)[0]


def test_a_mean_advantage_that_cancels_prints_as_zero():
    """GRPO advantages of a kind can cancel: the table printed the float sum's noise (4.19e-18, -1.009e-17)."""
    from flows.premise import cell

    assert [cell(4.19e-18), cell(-1.009e-17), cell(0.5774), cell(None), cell(3)] == ["0", "0", "0.5774", "", "3"]
