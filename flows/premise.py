"""The premise of purification, for people: the catalog's `trajectory_kinds` and `failed_call_advantage`
views (storage/catalog.py) as tables, and the prediction they make (issue 19 §1).

SAAR removes a failed call and puts the trajectory's advantage on a working one. When trajectories that
recovered from a failed call mostly carry positive advantage, the raw update would reinforce their
failed calls, so purification helps; when they mostly carry negative advantage, the raw update pushes
their failed calls down, and purification removes that signal (the first experiment's finding,
docs/results/cleaner_vs_raw_writeup.md). `cleaner replay` prints this for the iteration it replays,
`cleaner report` adds it to the run's page.
"""
from __future__ import annotations

from typing import Any

from rich.console import Console
from rich.table import Table

from storage.catalog import Catalog

RULE = ("rule: purification is predicted to help when recovered trajectories' mean advantage is positive "
        "(their failed calls would otherwise be reinforced), and to hurt when it is negative (it removes the "
        "negative advantage on those failed calls; raw, saar_correct or mask_failed keep it)")
KINDS_SQL = ("SELECT iteration, kind, trajectories, mean_reward, correct, mean_advantage FROM trajectory_kinds "
             "WHERE run_id = $run {iteration} ORDER BY iteration, kind")
FAILED_SQL = ("SELECT iteration, mode, gamma, measure, failed_call_tokens, trained, on_negative, on_positive, "
              "share_negative, share_positive FROM failed_call_advantage WHERE run_id = $run {iteration} "
              "ORDER BY iteration, mode, gamma, measure")


def premise_rows(cat: Catalog, run_id: str, iteration: int | None = None) -> tuple[list[dict], list[dict]]:
    """(trajectory_kinds rows, failed_call_advantage rows) of a run, or of one iteration of it."""
    where = "" if iteration is None else "AND iteration = $iteration"
    params: dict[str, Any] = {"run": run_id} | ({} if iteration is None else {"iteration": iteration})
    kinds = cat.con.sql(KINDS_SQL.format(iteration=where), params=params).to_arrow_table().to_pylist()
    failed = cat.con.sql(FAILED_SQL.format(iteration=where), params=params).to_arrow_table().to_pylist()
    return kinds, failed


def prediction(kinds: list[dict], iteration: int) -> str:
    """What the rule predicts for one iteration, from its trajectory_kinds rows."""
    recovered = [r for r in kinds if r["iteration"] == iteration and r["kind"] == "recovered"]
    if not recovered:
        return f"iteration {iteration}: no recovered trajectory, no prediction"
    advantage = recovered[0]["mean_advantage"]
    verdict = ("purification predicted to help" if advantage > 0 else
               "purification predicted to hurt" if advantage < 0 else "no prediction (zero)")
    return (f"iteration {iteration}: recovered trajectories' mean advantage {advantage:+.3f} over "
            f"{recovered[0]['trajectories']}: {verdict}")


TOKEN_RULE = ("token-level rule (docs/results/when_purification_helps_writeup.md; it predicted each mode's direction "
              "where the rule above did not): a mode that removes more failed-call tokens trained under negative "
              "advantage than under positive, compared with raw, is predicted to reduce first-call tool errors more "
              "slowly than raw")


def removed_by_sign(raw: dict, mode: dict) -> tuple[int, int]:
    """Failed-call tokens raw trains and `mode` does not: (under negative, under positive advantage).
    Rows are `failed_call_advantage` rows, or sums of their on_negative/on_positive over iterations."""
    return raw["on_negative"] - mode["on_negative"], raw["on_positive"] - mode["on_positive"]


def predicts_slower(negative: int, positive: int) -> bool:
    """The token-level rule: removing more negative- than positive-advantage failed-call tokens predicts
    a slower fall of first-call tool errors than raw."""
    return negative > positive


def token_predictions(failed: list[dict], iteration: int) -> list[str]:
    """Per purified partition of the iteration: the failed-call tokens it no longer trains, compared with the
    raw partition, by the sign of their advantage, and what the token-level rule predicts from them."""
    rows = [r for r in failed if r["iteration"] == iteration]
    raw = next((r for r in rows if r["mode"] == "raw"), None)
    if raw is None:
        return [f"iteration {iteration}: no raw partition to compare with (purify.modes needs raw), no prediction"]
    out = []
    for r in rows:
        if r["mode"] == "raw" or r["mode"] == "roc":  # roc drops whole rows: not a removal of failed calls
            continue
        neg, pos = removed_by_sign(raw, r)
        verdict = ("slower first-call error reduction than raw predicted" if predicts_slower(neg, pos) else
                   "not predicted to be slower than raw")
        measure = f" {r['measure']}" if r.get("measure") else ""
        out.append(f"iteration {iteration}: {r['mode']} γ={r['gamma']:g}{measure} removes {neg} negative- and {pos} "
                   f"positive-advantage failed-call tokens: {verdict}")
    return out


def _cell(v: object) -> str:
    return f"{v:.4g}" if isinstance(v, float) else ("" if v is None else str(v))


def print_premise(console: Console, cat: Catalog, run_id: str, iteration: int) -> None:
    kinds, failed = premise_rows(cat, run_id, iteration)
    table = Table(title=f"premise of {run_id} iteration {iteration}: trajectories by kind (raw shard; GRPO "
                        "group_norm advantage in the prompt group)")
    for col in ("kind", "trajectories", "mean reward", "correct", "mean advantage"):
        table.add_column(col, justify="left" if col == "kind" else "right")
    for r in kinds:
        table.add_row(r["kind"], *map(_cell, (r["trajectories"], r["mean_reward"], r["correct"], r["mean_advantage"])))
    console.print(table)
    table = Table(title="failed-call tokens (call segments of failed attempts) each purified partition trains, by "
                        "the sign of their advantage; shares of all the iteration's failed-call tokens")
    for col in ("mode", "gamma", "measure", "failed-call tokens", "trained", "on negative", "on positive",
                "share negative", "share positive"):
        table.add_column(col, justify="left" if col in ("mode", "measure") else "right")
    for r in failed:
        table.add_row(r["mode"], *map(_cell, (r["gamma"], r["measure"], r["failed_call_tokens"], r["trained"],
                                              r["on_negative"], r["on_positive"], r["share_negative"],
                                              r["share_positive"])))
    console.print(table)
    console.print(RULE, highlight=False)
    console.print(prediction(kinds, iteration), highlight=False)
    console.print(TOKEN_RULE, highlight=False)
    for line in token_predictions(failed, iteration):
        console.print(line, highlight=False)
