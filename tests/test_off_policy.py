"""Off-policy-aware purification (issue #29): behaviour log-probs and token origins in every purified row,
importance ratios per splice, Plan B (`saar_is`) decided by them, v1 shards still read."""

from __future__ import annotations

import math
import shutil

import pyarrow as pa
import pytest
import torch
from transformers import AutoModelForCausalLM

from pipeline.config import DEFAULT_POLICY, load_config
from tests.plain_forward import sequence_logprobs
from pipeline.trajectory import TokenOrigin, purified_from_row
from purifier.recompute import CPURecompute
from purifier.saar import purify, with_splice_ratios
from purifier.stage import run_purify_stage
from storage.catalog import Catalog
from storage.layout import RunLayout
from storage.schemas import PURIFIED, PURIFIED_V1, schema_id
from storage.shards import read_shard, write_shard
from tests.doubles import call
from tests.test_purify_golden import FIX, raw

FAILED = call("prnt(6 * 7)", reasoning="Let me compute the product.")
SPLICED = (TokenOrigin.SHALLOW, TokenOrigin.DEEP)


@pytest.fixture(scope="module")
def backend():
    return CPURecompute(DEFAULT_POLICY)


@pytest.fixture(scope="module")
def model():
    return AutoModelForCausalLM.from_pretrained(DEFAULT_POLICY, dtype=torch.float32, attn_implementation="eager").eval()


def plain_forward(model, t) -> list[float]:
    """log π of every response token after the purified context, by one plain forward (no cache, no chunks)."""
    return sequence_logprobs(model, t.prompt_ids + t.response_ids, start=len(t.prompt_ids))


@pytest.mark.parametrize("gamma", [0.0, 1.01], ids=["shallow", "deep"])
def test_a_retry_sampled_after_an_error_keeps_its_behaviour_logprobs(chat, sandbox, backend, model, gamma):
    t = raw(chat, sandbox, [FAILED, FIX], live_mode="raw")  # lived raw: the retry saw the failed call and its error
    retry = t.positions[0].attempts[1]
    p = purify(t, gamma, "saar", chat.decode)
    (s,) = p.splices
    assert s.kind == ("shallow" if gamma == 0.0 else "deep")
    moved = [i for i, o in enumerate(p.token_origin) if o in SPLICED]
    assert (
        moved
        and s.moved_tokens == len(moved)
        and set(p.token_origin[i] for i in moved) == {TokenOrigin.SHALLOW if gamma == 0.0 else TokenOrigin.DEEP}
    )
    # the spliced tokens are the retry's, with the log-probs it was sampled with
    assert [p.response_ids[i] for i in moved] == retry.turn_ids[-len(moved) :]
    assert [p.behaviour_logprobs[i] for i in moved] == retry.logprobs[-len(moved) :]
    # tool responses were never sampled
    assert all(o == TokenOrigin.NOT_SAMPLED for o, m in zip(p.token_origin, p.loss_mask) if m == 0)
    (q,) = backend.group([p])
    q = with_splice_ratios(q)
    plain = plain_forward(model, q)
    for i in moved:
        assert abs(q.old_logprobs[i] - plain[i]) <= 1e-5
    want = sum(q.old_logprobs[i] - q.behaviour_logprobs[i] for i in moved)
    assert q.splices[0].log_is_ratio == pytest.approx(want, abs=1e-9) and math.isfinite(want)


def test_in_place_tokens_on_real_rollouts(purified_run, model):
    """Tokens sampled in the context they are trained in: the engine's sampling log-prob is what a plain forward
    of the purified sequence gives (≤ 1e-3); the moved ones are only reported."""
    layout = RunLayout(purified_run.storage.root, "w")
    rows = [purified_from_row(r) for r in read_shard(layout.purified_dir(0, "saar", 0.5), PURIFIED).to_pylist()]
    checked, moved = 0, []
    for t in rows[:32]:
        plain = plain_forward(model, t)
        for i, (o, m) in enumerate(zip(t.token_origin, t.loss_mask)):
            if m and o == TokenOrigin.IN_PLACE:
                assert abs(plain[i] - t.behaviour_logprobs[i]) <= 1e-3, (t.raw_key, i)
                assert t.old_logprobs[i] == t.behaviour_logprobs[i]
                checked += 1
            elif m and o in SPLICED:
                moved.append(abs(t.old_logprobs[i] - t.behaviour_logprobs[i]))
    assert checked > 1000
    print(
        f"in place: {checked} tokens ≤ 1e-3; moved: {len(moved)} tokens, mean |Δ| {sum(moved) / max(1, len(moved)):.3f}"
    )
    with Catalog(purified_run.storage.root) as cat:
        view = cat.query("SELECT origin, tokens, mean_abs_delta FROM off_policy WHERE mode = 'saar'").to_pylist()
    by = {r["origin"]: r for r in view}
    assert by["in_place"]["mean_abs_delta"] == 0.0 and by["in_place"]["tokens"] > checked


def _scorer(log_is: float):
    """A scorer whose retry log-prob sum is the sampled one (−0.5 per token, the scripted engine's) + log_is."""

    def score(context, turn):
        return [-0.5] * (len(turn) - 1) + [-0.5 + log_is]

    return score


def test_saar_is_decides_append_or_replace_exactly_at_tau(chat, sandbox):
    t = raw(chat, sandbox, [FAILED, FIX], live_mode="raw")
    tau = math.exp(-1.0)
    assert math.log(tau) == -1.0  # the boundary is exactly representable in log space
    as_raw = purify(t, 0.0, "raw", chat.decode)
    replaced = purify(t, 0.0, "saar_is", chat.decode, score=_scorer(-1.0), tau=tau)  # IS = τ: replace
    (s,) = replaced.splices
    assert s.kind == "deep" and s.log_is_ratio == -1.0 and s.moved_tokens == len(t.positions[0].attempts[1].turn_ids)
    assert "prnt" not in chat.decode(replaced.response_ids) and (replaced.gamma, replaced.is_threshold) == (0.0, tau)
    below = -1.0 - 2.0**-40  # a hair below τ, and still that after the sums (their ulp is ~2^-49)
    appended = purify(t, 0.0, "saar_is", chat.decode, score=_scorer(below), tau=tau)
    assert appended.splices == [] and appended.response_ids == as_raw.response_ids
    assert appended.loss_mask == as_raw.loss_mask and appended.old_logprobs == as_raw.old_logprobs
    assert set(appended.token_origin) == {TokenOrigin.NOT_SAMPLED, TokenOrigin.IN_PLACE}  # fully on-policy
    assert purify(t, 0.0, "saar_is", chat.decode, score=_scorer(below), tau=tau * 0.999).splices


def test_saar_is_a_retry_replaced_again_keeps_no_moved_tokens(chat, sandbox):
    """Two retries that each replace: the first retry's tokens leave with the second replace, so its splice moves
    none; the row's deep tokens are exactly what its splices say they moved."""
    second_fail = call("prnt(6*7)", reasoning="Again.")
    t = raw(chat, sandbox, [FAILED, second_fail, FIX], live_mode="raw")
    assert [len(q.attempts) for q in t.positions][:1] == [3]
    p = purify(t, 0.0, "saar_is", chat.decode, score=_scorer(0.0), tau=0.5)  # IS = 1 ≥ τ: both retries replace
    first, last = p.splices
    assert (first.attempt_idx, last.attempt_idx) == (1, 2) and first.moved_tokens == 0
    assert last.moved_tokens == len(t.positions[0].attempts[2].turn_ids)
    assert p.token_origin.count(TokenOrigin.DEEP) == sum(s.moved_tokens for s in p.splices)


@pytest.mark.parametrize("gamma", [0.0, 1.01], ids=["shallow", "deep"])
def test_saar_each_splice_records_its_own_retrys_moved_tokens(chat, sandbox, backend, gamma):
    """Two retries at one position: every splice recorded the position's moved tokens and the same ratio over them,
    so the first retry (whose call the second replaced) was counted twice in the report's ratios and in any sum of
    moved_tokens. Now a splice holds the tokens of its own retry that stayed (none when a later call replaced them)
    and its ratio is over those tokens; the row's spliced tokens are exactly what its splices moved."""
    second_fail = call("prnt(6*7)", reasoning="Again.")
    t = raw(chat, sandbox, [FAILED, second_fail, FIX], live_mode="raw")
    assert [len(q.attempts) for q in t.positions][:1] == [3]
    p = purify(t, gamma, "saar", chat.decode)
    first, last = p.splices
    assert (first.attempt_idx, last.attempt_idx) == (1, 2)
    spliced = [i for i, o in enumerate(p.token_origin) if o in SPLICED]
    assert sum(s.moved_tokens for s in p.splices) == len(spliced) > 0
    assert first.moved_tokens == 0  # shallow: the second call replaced the first's; deep: the whole turn
    assert [p.response_ids[i] for i in spliced] == t.positions[0].attempts[2].turn_ids[-len(spliced) :]
    (q,) = backend.group([p])
    q = with_splice_ratios(q)
    want = sum(q.old_logprobs[i] - q.behaviour_logprobs[i] for i in spliced)
    assert q.splices[1].log_is_ratio == pytest.approx(want, abs=1e-9)
    assert q.splices[0].log_is_ratio is None  # nothing of its retry stayed: no ratio, not the other's


def test_saar_a_deep_then_shallow_position_splits_its_moved_tokens_between_its_splices(chat, sandbox, backend):
    """γ=0.9: the first retry replaces the whole turn (similarity 0.85), the second only the call (0.98): the
    purified turn is the first retry's reasoning and the second's call. Each splice's moved tokens and ratio cover
    its own retry's part, in attempt order (moved_range)."""
    from purifier.saar import moved_range

    r1 = call("import math\nprint(math.prod([6, 7]) / 0)", reasoning="A different route through math.")
    r2 = call("import math\nprint(math.prod([6, 7]))", reasoning="Dropping the division.")
    t = raw(chat, sandbox, [FAILED, r1, r2], live_mode="raw")
    p = purify(t, 0.9, "saar", chat.decode)
    first, second = p.splices
    assert (first.kind, second.kind) == ("deep", "shallow") and first.moved_tokens > 0 and second.moved_tokens > 0
    a1, a2 = t.positions[0].attempts[1], t.positions[0].attempts[2]
    one, two = moved_range(p, first), moved_range(p, second)
    assert one.stop == two.start and [p.token_origin[i] for i in one] == [TokenOrigin.DEEP] * len(one)
    assert [p.response_ids[i] for i in one] == a1.turn_ids[: a1.call_start]  # the first retry's reasoning
    assert [p.response_ids[i] for i in two] == a2.turn_ids[a2.call_start :]  # the second retry's call
    (q,) = backend.group([p])
    q = with_splice_ratios(q)
    for s, r in ((q.splices[0], one), (q.splices[1], two)):
        assert s.log_is_ratio == pytest.approx(sum(q.old_logprobs[i] - q.behaviour_logprobs[i] for i in r), abs=1e-9)


def test_saar_is_partitions_from_the_stage_and_the_catalog(world_copy):
    cfg = world_copy
    cfg.purify.modes, cfg.purify.is_thresholds = ["saar_is", "saar"], [0.5, 2.0]
    results = run_purify_stage(cfg, "w", 0)
    assert {(r.mode, r.threshold) for r in results} == {("saar_is", 0.5), ("saar_is", 2.0), ("saar", 0.5)}
    layout = RunLayout(cfg.storage.root, "w")
    assert layout.purified_dir(0, "saar_is", 0.5).name == "tau=0.50"
    with Catalog(cfg.storage.root) as cat:
        got = cat.query(
            "SELECT is_threshold AS tau, count(*) AS n, count(*) FILTER (WHERE gamma = 0) AS no_gamma "
            "FROM purified WHERE mode = 'saar_is' GROUP BY ALL ORDER BY tau"
        ).to_pylist()
        ratios = cat.query(
            "SELECT is_threshold AS tau, kind, log_is_ratio FROM splices WHERE mode = 'saar_is'"
        ).to_pylist()
        saar = cat.query(
            "SELECT count(*) AS n, count(log_is_ratio) AS scored, count(*) FILTER (WHERE moved_tokens > 0) AS moved "
            "FROM splices WHERE mode = 'saar'"
        ).to_pylist()[0]
    assert [(g["tau"], g["n"] == g["no_gamma"]) for g in got] == [(0.5, True), (2.0, True)]
    assert all(r["kind"] == "deep" and r["log_is_ratio"] >= math.log(r["tau"]) for r in ratios)
    # every SAAR splice some of whose retry's tokens stayed carries its ratio after recompute; the others, whose
    # tokens a later retry replaced, have none
    assert saar["n"] > saar["moved"] > 0 and saar["scored"] == saar["moved"]
    n = {tau: sum(1 for r in ratios if r["tau"] == tau) for tau in (0.5, 2.0)}
    assert n[0.5] >= n[2.0]  # a higher τ replaces no more


def test_v1_purified_shards_still_read(purified_run, tmp_path):
    layout = RunLayout(purified_run.storage.root, "w")
    v2 = read_shard(layout.purified_dir(0, "saar", 0.5), PURIFIED)
    v1 = pa.Table.from_pylist(
        [
            {
                k: (
                    [{f: s[f] for f in PURIFIED_V1.field("splices").type.value_type.names} for s in v]
                    if k == "splices"
                    else v
                )
                for k, v in row.items()
                if k in PURIFIED_V1.names
            }
            for row in v2.to_pylist()
        ],
        schema=PURIFIED_V1,
    )
    out = tmp_path / "runs" / "old" / "iteration=0000" / "purified" / "mode=saar" / "gamma=0.50"
    write_shard(out, v1, PURIFIED_V1, "h")
    back = read_shard(out, PURIFIED)
    assert back.schema.equals(PURIFIED, check_metadata=False) and schema_id(back.schema) == schema_id(PURIFIED)
    assert back["response_ids"].to_pylist() == v2["response_ids"].to_pylist()
    assert back["behaviour_logprobs"].null_count == back.num_rows
    assert back["splices"].to_pylist()[0] == [] or back["splices"].to_pylist()[0][0]["log_is_ratio"] is None
    assert (
        read_shard(out, PURIFIED, columns=["response_ids", "token_origin"]).column("token_origin").null_count
        == v1.num_rows
    )
    shutil.copytree(layout.run_dir, tmp_path / "runs" / "w")
    with Catalog(tmp_path) as cat:  # old and new partitions in one catalog
        assert not cat.problems
        n = cat.query("SELECT count(*) AS n, count(behaviour_logprobs) AS b, count(token_origin) AS o FROM purified")
        off = cat.query("SELECT sum(tokens) AS t FROM off_policy").to_pylist()[0]["t"]
    assert n.to_pylist() == [{"n": v1.num_rows + v2.num_rows, "b": v2.num_rows, "o": v2.num_rows}]  # v1 rows: NULL
    assert off == sum(sum(m) for m in v2["loss_mask"].to_pylist())  # the view reads the v2 rows only


def test_bad_thresholds_are_one_line_errors():
    from pipeline.config import ConfigError, load_config

    for bad in ("0", "-0.5", "nan", "inf"):  # (nan and inf: refused as every setting's are, before τ's own check)
        with pytest.raises(ConfigError, match="purify.is_thresholds.0: .*finite number"):
            load_config(None, [f"purify.is_thresholds=[{bad}]"])


def test_replay_is_threshold_writes_partitions_the_catalog_shows(world_copy):
    from tests.flow_helpers import run_cleaner

    cfg = world_copy
    root = cfg.storage.root
    cmd = [
        "replay",
        "--run",
        "w",
        "--iteration",
        "0",
        "--is-threshold",
        "0.3",
        "0.7",
        f"storage.root={root}",
        "rollout.tasks_per_iteration=16",
        "rollout.samples_per_prompt=4",
    ]
    run = run_cleaner(cmd)
    assert run.returncode == 0, run.stderr
    assert "saar_is (Plan B)" in run.stdout and "rollbacks" in run.stdout
    import duckdb

    con = duckdb.connect(str(root / "catalog.duckdb"), read_only=True)  # the published catalog, at once
    got = con.sql("SELECT DISTINCT is_threshold FROM purified WHERE mode = 'saar_is' ORDER BY 1").fetchall()
    con.close()
    assert got == [(0.3,), (0.7,)]
    assert "mode=saar_is/tau=0.30: " in run.stdout and "— written" in run.stdout, run.stdout
    assert "saar γ" not in run.stderr, run.stderr  # it purifies saar_is at τ, no γ partition
    assert "replay of w iteration 0" not in run.stdout, run.stdout  # nor a γ table of partitions nobody asked for
    again = run_cleaner(cmd)  # a rerun says what it kept (it said it was purifying, every time)
    assert again.returncode == 0 and "mode=saar_is/tau=0.70: " in again.stdout, again.stderr
    assert "kept (already committed)" in again.stdout and "— written" not in again.stdout, again.stdout
    # `cleaner purify --is-threshold` purifies saar_is at τ as replay does (without --mode it wrote nothing of it)
    purify = run_cleaner(
        [
            "purify",
            "--run",
            "w",
            "--iteration",
            "0",
            "--is-threshold",
            "0.9",
            f"storage.root={root}",
            "rollout.tasks_per_iteration=16",
            "rollout.samples_per_prompt=4",
        ]
    )
    assert purify.returncode == 0 and "mode=saar_is/tau=0.90: " in purify.stdout, purify.stdout + purify.stderr
    assert RunLayout(root, "w").purified_dir(0, "saar_is", 0.9).is_dir()
    for bad in ("0", "nan", "-1"):
        r = run_cleaner(cmd[:3] + ["--is-threshold", bad, f"storage.root={root}"])
        assert r.returncode == 2 and f"invalid τ '{bad}'" in r.stderr


def test_training_saar_is_at_a_tau_of_its_own_purifies_that_tau_and_options_that_fit_no_mode_are_refused(world_copy):
    """train.mode=saar_is train.tau=0.3 trains on mode=saar_is/tau=0.30: `cleaner purify` without options (what the
    update's hint says to run, and what the flow purifies) writes it; it wrote saar at γ 0.3 instead, and the update
    failed on every rerun. --is-threshold with no saar_is mode, or --gamma with no similarity mode, wrote nothing
    of it and said nothing: refused in one line."""
    from tests.flow_helpers import run_cleaner

    root = world_copy.storage.root
    common = [
        "--run",
        "w",
        "--iteration",
        "0",
        f"storage.root={root}",
        "rollout.tasks_per_iteration=16",
        "rollout.samples_per_prompt=4",
    ]
    purify = run_cleaner(["purify", *common, "train.mode=saar_is", "train.tau=0.3"])
    assert purify.returncode == 0, purify.stderr
    assert "saar γ 0.5, raw, saar_is τ 0.3" in purify.stderr, purify.stderr  # the trained τ, not purify.is_thresholds
    layout = RunLayout(root, "w")
    assert layout.purified_dir(0, "saar_is", 0.3).is_dir() and not layout.purified_dir(0, "saar", 0.3).exists()
    for command in ("purify", "replay"):
        for asked, says in (
            (["--mode", "saar", "--is-threshold", "0.9"], "--is-threshold sets the τ of mode saar_is"),
            (["--mode", "saar_is", "--gamma", "0.3"], "--gamma sets the γ of mode saar / saar_correct"),
        ):
            r = run_cleaner([command, *common, *asked])
            assert r.returncode == 2 and says in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert not layout.purified_dir(0, "saar_is", 0.9).exists()


def test_is_sweep_counts_decisions_per_tau(world_rollout, backend, chat):
    from pipeline.trajectory import trajectory_from_row
    from purifier.replay import log_histogram_lines, replay_is
    from storage.schemas import RAW

    raws = [
        trajectory_from_row(r)
        for r in read_shard(RunLayout(world_rollout.storage.root, "w").raw_dir(0), RAW).to_pylist()
    ]
    stats, ratios = replay_is(raws, [0.01, 0.5, 100.0], chat.decode, backend.score)
    lo, mid, hi = stats
    assert lo.rollbacks > 0 and len(ratios) >= lo.rollbacks
    assert mid.differ_from_reference == 0 and lo.replaced >= mid.replaced >= hi.replaced
    assert all(s.replaced + s.appended == s.rollbacks for s in stats)
    assert sum(int(line.rsplit("│", 1)[1].split()[0]) for line in log_histogram_lines(ratios, [0.5])) == len(ratios)
    # each τ's counts are what purify decides at that τ, rollback by rollback (a policy that repeats its code
    # samples identical retries: named by their turn ids, two of them counted as one, and τ 0.3 and 0.5 showed
    # the same counts while their partitions differed)
    from purifier.replay import with_retries

    for s in stats:
        calls = []
        purified = [
            purify(
                r,
                0.0,
                "saar_is",
                chat.decode,
                tau=s.tau,
                score=lambda c, t, calls=calls: calls.append(1) or backend.score(c, t),
            )
            for r in with_retries(raws)
        ]
        assert (s.rollbacks, s.replaced) == (len(calls), sum(len(p.splices) for p in purified)), s
        assert s.tokens_removed == sum(x.tokens_removed for p in purified for x in p.splices)


def test_live_importance_rollbacks_are_relived_by_saar_is_at_the_live_tau(tmp_path, backend, chat):
    """rollout.saar.rollback=importance (Plan B live, scored with the engine's weights) on the real policy and
    sandbox; purifying the raw shard with saar_is at the same τ rebuilds every lived sequence exactly: the same
    decisions, and off the sampled context only the retries that replaced their failed turn."""
    from pipeline.trajectory import trajectory_from_row
    from rollout_gen.stage import run_rollout_stage
    from storage.schemas import RAW

    cfg = load_config(
        None,
        [
            f"storage.root={tmp_path}",
            "rollout.tasks_per_iteration=16",
            "rollout.samples_per_prompt=4",
            "rollout.seed=3",
            "rollout.saar.rollback=importance",
            "rollout.saar.is_threshold=0.5",
        ],
    )
    run_rollout_stage(cfg, "live", 0, DEFAULT_POLICY, show_progress=False)
    raws = [trajectory_from_row(r) for r in read_shard(RunLayout(tmp_path, "live").raw_dir(0), RAW).to_pylist()]
    replaced = appended = 0
    for t in raws:
        p = purify(t, 0.0, "saar_is", chat.decode, score=backend.score, tau=0.5)
        assert p.response_ids == t.lived_ids and p.loss_mask == t.lived_mask, t.key
        # lived log-probs are as sampled: in place they are the old ones; a replaced retry's are its behaviour ones
        assert p.behaviour_logprobs == t.lived_logprobs
        assert all(o == lp for o, lp, v in zip(p.old_logprobs, t.lived_logprobs, p.logprob_valid) if v)
        assert set(p.token_origin) <= {TokenOrigin.NOT_SAMPLED, TokenOrigin.IN_PLACE, TokenOrigin.DEEP}
        assert p.token_origin.count(TokenOrigin.DEEP) == sum(s.moved_tokens for s in p.splices)
        replaced += len(p.splices)
        appended += sum(len(q.attempts) - 1 for q in t.positions if t.saar_gate) - len(p.splices)
    assert replaced > 0 and appended > 0 and replaced == sum(t.stats.live_deep for t in raws)


def test_replay_of_a_run_that_lived_by_importance_compares_with_its_own_tau(tmp_path, capsys):
    """A run lived by importance ratio at τ 0.9: replay said it lived 'with rapidfuzz-segment at γ_live=0.5' and
    compared every τ with 0.5; its own τ showed differences from itself."""
    from flows.replay_cmd import run_replay
    from flows.run_config import freeze_run_config
    from rollout_gen.stage import run_rollout_stage

    lived = load_config(
        None,
        [
            f"storage.root={tmp_path}",
            "rollout.tasks_per_iteration=16",
            "rollout.samples_per_prompt=4",
            "rollout.seed=3",
            "rollout.saar.rollback=importance",
            "rollout.saar.is_threshold=0.9",
        ],
    )
    run_rollout_stage(lived, "live", 0, DEFAULT_POLICY, show_progress=False)
    freeze_run_config(lived, "live")
    capsys.readouterr()
    replay = load_config(None, [f"storage.root={tmp_path}"])  # the user's config: similarity, τ 0.5
    assert run_replay(replay, "live", 0, gammas=[0.5], taus=[0.5, 0.9]) == 0
    out = capsys.readouterr().out
    words = " ".join(out.split())  # table titles wrap at the table's width
    assert "lived by importance ratio at τ_live=0.9" in words and "γ_live" not in words.split("positions:")[0], out
    rows = {
        line.split("│")[1].strip(): line.split("│")[-2].strip()
        for line in out.splitlines()
        if line.count("│") >= 7 and line.split("│")[1].strip() in ("0.5", "0.9")
    }
    assert "≠ lived τ=0.9" in out and rows["0.9"] == "0", out


def test_cpu_engine_scores_a_retry_on_the_kept_prefix(chat, backend):
    """A live rollback's scoring forward reuses the trajectory's KV in the engine: only the retry is forwarded,
    and its log-probs are the full forward's (1e-5)."""
    from pipeline.engines.base import Request, SamplingParams
    from rollout_gen.engines.cpu import CPUEngine

    engine = CPUEngine(DEFAULT_POLICY, pad_id=chat.tokenizer.pad_token_id)
    context = chat.prompt_ids("What is 6 * 7?")
    engine.add([Request("t", tuple(context), SamplingParams(48, stop_ids=tuple(chat.stop_ids)), 7)])
    while engine.busy():
        engine.step()
    turn = chat.encode(call("print(6 * 7)")) + [chat.im_end_id]
    before = engine.prefill_tokens
    cached = engine.score_turn(context, turn, 1.0, key="t")
    assert engine.prefill_tokens - before == len(turn)  # the context's KV came from the store
    full = backend.score(context, turn)
    assert len(cached) == len(full) == len(turn) and max(abs(a - b) for a, b in zip(cached, full)) <= 1e-5
    assert engine.score_turn(context, turn, 1.0, key="unknown") == full  # nothing kept: the purifier's function


def test_cpu_engine_scores_rollbacks_together_and_keeps_a_replacing_retry_kv(chat, backend):
    """Rollbacks gathered by the scheduler are scored in one forward: each retry's log-probs are its own full
    forward's (float32 rounding: 1e-5, relative for the unlikely tokens). The forward's KV is kept as the
    trajectory's branch: a turn after a retry that replaced its failed turn forwards only what follows the retry
    (its log-probs those of a fresh prefill), and a turn after an appended retry still continues from the failed
    turn's KV."""
    from pipeline.engines.base import Request, ScoreRequest, SamplingParams
    from rollout_gen.engines.cpu import CPUEngine

    engine = CPUEngine(DEFAULT_POLICY, pad_id=chat.tokenizer.pad_token_id)
    params = SamplingParams(24, stop_ids=tuple(chat.stop_ids))
    contexts = {"a": chat.prompt_ids("What is 6 * 7?"), "b": chat.prompt_ids("Add 12 and 30, then halve it.")}
    engine.add([Request(k, tuple(c), params, 7) for k, c in contexts.items()])
    failed = {}
    while engine.busy():
        failed.update((r.key, g.output_ids) for r, g in engine.step())
    retries = {"a": chat.encode(call("print(6 * 7)")) + [chat.im_end_id], "b": chat.encode(call("print(21)"))}
    scores = engine.score_turns([ScoreRequest(k, tuple(contexts[k]), tuple(retries[k])) for k in ("a", "b")])
    for k, got in zip(("a", "b"), scores):
        full = backend.score(contexts[k], retries[k])
        assert len(full) == len(retries[k]) and got == pytest.approx(full, rel=1e-5, abs=1e-5)

    feedback = chat.feedback_ids("42")
    after = {
        "a": contexts["a"] + retries["a"] + feedback,  # replaced: the failed turn left the context
        "b": contexts["b"] + failed["b"] + feedback,
    }  # appended: the retry follows the failed turn
    before = engine.prefill_tokens
    engine.add([Request(k, tuple(c), SamplingParams(1), 3) for k, c in after.items()])
    got = dict((r.key, g) for r, g in engine.step())
    assert engine.prefill_tokens - before == 2 * (1 + len(feedback))  # each forwards its last token and the feedback
    fresh = CPUEngine(DEFAULT_POLICY, pad_id=chat.tokenizer.pad_token_id)
    fresh.add([Request("a", tuple(after["a"]), SamplingParams(1), 3)])
    ((_, alone),) = fresh.step()
    assert got["a"].output_ids == alone.output_ids and abs(got["a"].logprobs[0] - alone.logprobs[0]) <= 1e-5
