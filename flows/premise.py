"""The premise of purification, for people: the catalog's `trajectory_kinds` and `failed_call_advantage`
views (storage/catalog.py) as tables, and the prediction they make (docs/saar.md).

SAAR removes a failed call and puts the trajectory's advantage on a working one. ANSWER is what the project's
pre-registered experiment says about turning it on. The token-level rule is a hypothesis, stated at the strength
its data has (TOKEN_RULE says it was not borne out): count the failed-call tokens a mode stops training, compared
with raw, by the sign of the advantage raw trains them with; a mode that removes more "do not write this"
(negative) than "write this" (positive) signal is predicted to reduce first-call tool errors more slowly than
raw. The coarse rule before it — recovered trajectories' mean advantage positive, so purification helps — did not
predict (docs/results/when_purification_helps_writeup.md, point 5): it is shown only as disproved. `cleaner
replay` prints the answer and both rules for the iteration it replays, `cleaner report` states them on the run's
page, the token-level rule per mode.
"""

from __future__ import annotations

from typing import Iterator

from rich.console import Console
from rich.table import Table

from storage.catalog import Catalog

WRITEUP = "docs/results/when_purification_helps_writeup.md"
RULE = (
    "coarse rule, disproved (it did not predict in the project's own experiment, " + WRITEUP + " point 5; "
    "shown for comparison only, use the token-level rule): purification helps when recovered trajectories' "
    "mean advantage is positive, hurts when it is negative"
)
KINDS_SQL = (
    "SELECT iteration, kind, trajectories, mean_reward, correct, mean_advantage FROM trajectory_kinds "
    "WHERE run_id = $run AND ($iteration IS NULL OR iteration = $iteration) ORDER BY iteration, kind"
)
FAILED_SQL = (
    "SELECT iteration, mode, gamma, is_threshold, measure, failed_call_tokens, trained, on_negative, "
    "on_positive, share_negative, share_positive FROM failed_call_advantage WHERE run_id = $run AND "
    "($iteration IS NULL OR iteration = $iteration) ORDER BY iteration, mode, gamma, is_threshold, measure"
)


def premise_rows(cat: Catalog, run_id: str, iteration: int | None = None) -> tuple[list[dict], list[dict]]:
    """(trajectory_kinds rows, failed_call_advantage rows) of a run, or of one iteration of it."""
    params = {"run": run_id, "iteration": iteration}
    kinds = cat.con.sql(KINDS_SQL, params=params).to_arrow_table().to_pylist()
    return kinds, cat.con.sql(FAILED_SQL, params=params).to_arrow_table().to_pylist()


def prediction(kinds: list[dict], iteration: int) -> str:
    """Recovered trajectories' mean advantage in one iteration (trajectory_kinds rows), with what the coarse
    rule would say, marked as disproved: not a prediction."""
    recovered = [r for r in kinds if r["iteration"] == iteration and r["kind"] == "recovered"]
    if not recovered:
        return f"iteration {iteration}: no recovered trajectory, no prediction"
    advantage = recovered[0]["mean_advantage"]
    says = "help" if advantage > 0 else "hurt" if advantage < 0 else "nothing"
    return (
        f"iteration {iteration}: recovered trajectories' mean advantage {advantage:+.3f} over "
        f"{recovered[0]['trajectories']}: the disproved coarse rule would say {says}"
    )


ANSWER_WRITEUP = "docs/results/should_i_turn_saar_on_writeup.md"
# Quoted from ANSWER_WRITEUP (tests/test_writeup.py checks every number against it): rerun
# `python -m experiments.writeup` and restate these when the experiment changes.
ANSWER = (
    "Should I turn SAAR on? In the project's pre-registered experiment (" + ANSWER_WRITEUP + "; recovery "
    "world, independent retries, n = 8 seeds, 12 contrasts Holm-adjusted), SAAR as the paper runs it (γ = 0.5, "
    "lived purified) was not distinguishable from raw on any metric: saar − raw on the very first call's "
    "failure rate −0.026, 95% t-interval [−0.068, +0.016]; on pass@1 +0.002 [−0.003, +0.008]. That is neither "
    "an effect nor its absence: showing equivalence within ±0.02 would need about 20 seeds. Outcome-aware "
    "saar_correct lowered that failure rate against raw by 0.061 ([−0.089, −0.033]); the loss-normalisation "
    "control alone moves it too, and against that control about half remains (exploratory, not registered). The "
    "reference's DPO on tool calls (train.use_dpo_on_tool_calls=true) lowered it against saar by 0.099 "
    "([−0.114, −0.084]); no arm changed pass@1 detectably. One small synthetic world: check on your own tasks "
    "before relying on it. For γ, sweep your own first raw shard (cleaner replay --run R --iteration 0 --sweep): "
    "this experiment ran one γ and gives no γ advice"
)
TOKEN_RULE = (
    "token-level rule, a hypothesis the pre-registered experiment did not bear out (" + ANSWER_WRITEUP + "): "
    "it predicts that saar reduces first-call tool errors more slowly than raw, and saar − raw on the very "
    "first call's failure rate was −0.026, 95% t-interval [−0.068, +0.016], n = 8 seeds: neither the predicted "
    "slowdown nor equivalence within ±0.02 (its earlier support, in " + WRITEUP + " point 2, was four "
    "correlated signs sampled with coupled retries). The rule: "
    "compared with raw, a purification mode stops training some failed-call tokens (the code of failed "
    "tool calls); if it stops training more of them under negative advantage (where raw pushes the failed "
    "call down) than under positive advantage (where raw reinforces it), training on it is predicted to "
    "reduce first-call tool errors more slowly than training on raw; if it stops training only "
    "positive-advantage ones, it is predicted not to be slower. It predicts nothing about accuracy"
)
NOT_A_REMOVAL = {
    "raw": "the baseline",
    "roc": "drops whole rows (resampled groups), not failed calls: the rule does not apply",
}


def removed_by_sign(raw: dict, mode: dict) -> tuple[int, int]:
    """Failed-call tokens raw trains and `mode` does not: (under negative, under positive advantage).
    Rows are `failed_call_advantage` rows, or sums of their on_negative/on_positive over iterations."""
    return raw["on_negative"] - mode["on_negative"], raw["on_positive"] - mode["on_positive"]


def removals(failed: list[dict]) -> Iterator[tuple[dict, dict, int, int]]:
    """(partition row, raw row of its iteration, removed_by_sign) of each `failed_call_advantage` row the rule
    applies to (NOT_A_REMOVAL left out) whose iteration has a raw partition."""
    raws = {r["iteration"]: r for r in failed if r["mode"] == "raw"}
    for r in failed:
        if r["mode"] not in NOT_A_REMOVAL and r["iteration"] in raws:
            yield (r, raws[r["iteration"]], *removed_by_sign(raws[r["iteration"]], r))


def predicts_slower(negative: int, positive: int) -> bool:
    """The token-level rule: removing more negative- than positive-advantage failed-call tokens predicts
    a slower fall of first-call tool errors than raw."""
    return negative > positive


def verdict(negative: int, positive: int) -> str:
    """The token-level rule's prediction for a mode that stops training `negative` / `positive` failed-call
    tokens raw trains, with the cases the experiment did not test said so."""
    if predicts_slower(negative, positive):
        return "slower first-call error reduction than raw predicted"
    if negative == 0 and positive == 0:  # it may still stop training tokens under advantage 0: no gradient either way
        return "none under a nonzero advantage: no difference predicted"
    if negative > 0:  # some negative signal removed, as much or more positive: untested (write-up, last section)
        return (
            "not predicted to be slower than raw (it also removes negative-advantage tokens, a case the "
            "experiment did not test)"
        )
    return "not predicted to be slower than raw"


def _label(r: dict) -> str:
    if r.get("is_threshold") is not None:  # an importance-ratio mode's partition, named by τ
        return f"{r['mode']} τ={r['is_threshold']:g}"
    if not r["gamma"] and not r.get("measure"):  # a mode without a threshold (mask_failed)
        return r["mode"]
    measure = f" {r['measure']}" if r.get("measure") else ""
    return f"{r['mode']} γ={r['gamma']:g}{measure}"


def token_predictions(failed: list[dict], iteration: int) -> list[str]:
    """Per purified partition of the iteration: the failed-call tokens it no longer trains, compared with the
    raw partition, by the sign of their advantage, and what the token-level rule predicts from them."""
    rows = [r for r in failed if r["iteration"] == iteration]
    if not any(r["mode"] == "raw" for r in rows):
        return [f"iteration {iteration}: no raw partition to compare with (purify.modes needs raw), no prediction"]
    return [
        f"iteration {iteration}: {_label(r)} removes {neg} negative- and {pos} positive-advantage failed-call "
        f"tokens{_zero(raw, r)}: {verdict(neg, pos)}"
        for r, raw, neg, pos in removals(rows)
    ] + [  # a partition the rule does not apply to says so (roc was left out without a word)
        f"iteration {iteration}: {_label(r)} {NOT_A_REMOVAL[r['mode']]}"
        for r in rows
        if r["mode"] in NOT_A_REMOVAL and r["mode"] != "raw"
    ]


def _zero(raw: dict, mode: dict) -> str:
    """The failed-call tokens under advantage 0 that raw trains and `mode` does not, when there are any."""
    zero = (raw["trained"] - raw["on_negative"] - raw["on_positive"]) - (
        mode["trained"] - mode["on_negative"] - mode["on_positive"]
    )
    return f" (and {zero} failed-call tokens under advantage 0)" if zero else ""


def token_rule_by_mode(failed: list[dict]) -> list[dict]:
    """The token-level rule per purified partition of a run (mode, γ, τ, measure; roc and raw left out), summed over
    the iterations that hold both that partition and raw: iterations, raw's failed-call tokens under negative /
    positive advantage there, the tokens the partition stops training under each sign, and the verdict."""
    out: dict[tuple, dict] = {}
    for r, raw, neg, pos in removals(failed):
        m = out.setdefault(
            (r["mode"], r["gamma"], r.get("is_threshold"), r.get("measure")),
            {
                "mode": r["mode"],
                "gamma": r["gamma"],
                "is_threshold": r.get("is_threshold"),
                "measure": r.get("measure"),
                "iterations": [],
                "raw_negative": 0,
                "raw_positive": 0,
                "removed_negative": 0,
                "removed_positive": 0,
            },
        )
        m["iterations"].append(r["iteration"])
        m["raw_negative"] += raw["on_negative"]
        m["raw_positive"] += raw["on_positive"]
        m["removed_negative"] += neg
        m["removed_positive"] += pos
    for m in out.values():
        m["slower"] = predicts_slower(m["removed_negative"], m["removed_positive"])
        m["verdict"] = verdict(m["removed_negative"], m["removed_positive"])
    return sorted(out.values(), key=lambda m: (m["mode"], m["gamma"], m["is_threshold"] or 0.0, m["measure"] or ""))


def cell(v: object) -> str:
    """A table cell; a mean of advantages that cancel is 0, not the sum's rounding noise (4.19e-18)."""
    if isinstance(v, float):
        return f"{0.0 if abs(v) < 1e-12 else v:.4g}"
    return "" if v is None else str(v)


def print_premise(console: Console, cat: Catalog, run_id: str, iteration: int) -> None:
    kinds, failed = premise_rows(cat, run_id, iteration)
    table = Table(
        title=f"premise of {run_id} iteration {iteration}: trajectories by kind (raw shard; GRPO "
        "group_norm advantage in the prompt group)"
    )
    for col in ("kind", "trajectories", "mean reward", "correct", "mean advantage"):
        table.add_column(col, justify="left" if col == "kind" else "right")
    for r in kinds:
        table.add_row(r["kind"], *map(cell, (r["trajectories"], r["mean_reward"], r["correct"], r["mean_advantage"])))
    console.print(table)
    table = Table(
        title="failed-call tokens (call segments of failed attempts) each purified partition trains, by "
        "the sign of their advantage; shares of all the iteration's failed-call tokens"
    )
    for col in (
        "mode",
        "gamma",
        "tau",
        "measure",
        "failed-call tokens",
        "trained",
        "on negative",
        "on positive",
        "share negative",
        "share positive",
    ):
        table.add_column(col, justify="left" if col in ("mode", "measure") else "right")
    for r in failed:
        table.add_row(
            r["mode"],
            *map(
                cell,
                (
                    r["gamma"],
                    r["is_threshold"],
                    r["measure"],
                    r["failed_call_tokens"],
                    r["trained"],
                    r["on_negative"],
                    r["on_positive"],
                    r["share_negative"],
                    r["share_positive"],
                ),
            ),
        )
    console.print(table)
    console.print(ANSWER, highlight=False)
    console.print(TOKEN_RULE, highlight=False)
    for line in token_predictions(failed, iteration):
        console.print(line, highlight=False)
    console.print(RULE, highlight=False)
    console.print(prediction(kinds, iteration), highlight=False)
