"""HTML pieces of `cleaner report`'s page (flows/report.py): the style, tables that fit the page, links to
`cleaner view`'s pages, and the section that states the token-level hypothesis and what supports it.

Every text is escaped here (html.escape, attributes quoted): run ids, prompt ids, partition labels and
numbers alike; model output never reaches the page unescaped. Links to the viewer are relative to where the
viewer serves this page, /runs/RUN/report/: `../I` is iteration I's trajectory table, `../I/trajectory?…` one
trajectory, `../../RUN` the run. Opened as a file they do not resolve; the page says how to open the viewer.
"""

from __future__ import annotations

import html
import numbers
import shlex
from pathlib import Path
from typing import Any, Mapping
from urllib.parse import quote, urlencode

from flows.premise import (
    ANSWER,
    ANSWER_WRITEUP,
    NOT_A_REMOVAL,
    RULE,
    TOKEN_RULE,
    WRITEUP,
    cell,
    removals,
    token_rule_by_mode,
    verdict,
)
from pipeline.modes import SPLICING_MODES
from storage.layout import DEFAULT_MEASURE_KEY

VIEWER_PORT = 8765  # `cleaner view`'s default port (flows/view_cmd.py)
WRITEUP_FILE = Path(__file__).resolve().parent.parent / WRITEUP
ANSWER_FILE = Path(__file__).resolve().parent.parent / ANSWER_WRITEUP

# Tables fit a 1000-px-wide page: headers wrap (at spaces and after underscores), text cells wrap, numbers do
# not; a table wider than the page scrolls inside its own box with its key column pinned, never the page.
# Inside the viewer (its report page wraps this body in .report) the note on how to open the viewer is hidden.
STYLE = """body{font-family:sans-serif;margin:1.5em;max-width:1400px}
.scroll{overflow-x:auto;max-width:100%;margin:.4em 0}
table{border-collapse:collapse;font-size:.82em}
td,th{border:1px solid #ccc;padding:2px 5px;vertical-align:top;text-align:left}
th{background:#f0f2f5;font-weight:600;min-width:3.5em;max-width:10em;overflow-wrap:break-word}
td.num{text-align:right;white-space:nowrap;font-variant-numeric:tabular-nums}
td.text{max-width:28em;overflow-wrap:break-word}
.scroll tr>:first-child{position:sticky;left:0;background:#fff}.scroll tr>th:first-child{background:#f0f2f5}
figure{display:inline-block;width:520px;max-width:100%;vertical-align:top;margin:6px}
img{border:1px solid #eee;max-width:100%;height:auto}
figcaption{font-size:0.85em;color:#444}
pre{background:#f6f6f6;padding:1em;overflow:auto;white-space:pre-wrap;overflow-wrap:anywhere}
.note{background:#eef4ff;border:1px solid #b8cdf0;padding:.5em 1em;border-radius:4px}
.rule{background:#f3faf3;border-left:4px solid #3a8a3a;padding:.5em 1em}
.disproved{background:#fbf3f3;border-left:4px solid #b04040;padding:.5em 1em}
ul.modes li{margin:.3em 0}
.report #viewer-note{display:none}"""


def esc(v: object) -> str:
    return html.escape("" if v is None else str(v), quote=True)


def header(name: str) -> str:
    """A column name that may wrap after its underscores (escaped first)."""
    return esc(name).replace("_", "_<wbr>")


def link(href: str, text: object) -> str:
    return f'<a href="{esc(href)}">{esc(text)}</a>'


def iteration_href(iteration: int, **filters: object) -> str:
    query = urlencode({k: v for k, v in filters.items() if v not in (None, "")})
    return f"../{int(iteration)}" + (f"?{query}" if query else "")


def trajectory_href(iteration: int, prompt_id: str, sample_idx: int) -> str:
    return f"../{int(iteration)}/trajectory?prompt={quote(str(prompt_id), safe='')}&sample={int(sample_idx)}"


PARTITION_COLUMNS = ("mode", "gamma", "is_threshold", "measure")  # what names a purified partition in the catalog


def partition_key(row: Mapping[str, Any]) -> str:
    """A partition of a catalog row (PARTITION_COLUMNS) as a URL value, the viewer's partition filter:
    mode:γ[:measure], mode:τ for an importance-ratio mode."""
    threshold = row["gamma"] if row.get("is_threshold") is None else row["is_threshold"]
    return f"{row['mode']}:{threshold:g}" + (f":{row['measure']}" if row.get("measure") else "")


def partition_label(row: Mapping[str, Any]) -> str:
    """`saar γ=0.5`, `saar γ=0.5 (difflib-segment)`, `saar_is τ=0.5`, `raw`: a catalog row's partition."""
    mode, measure = row["mode"], row.get("measure")
    if row.get("is_threshold") is not None:
        return f"{mode} τ={row['is_threshold']:g}"
    if mode not in SPLICING_MODES:
        return mode
    return f"{mode} γ={row['gamma']:g}" + (f" ({measure})" if measure and measure != DEFAULT_MEASURE_KEY else "")


def table(rows: list[dict], links: dict | None = None, table_id: str = "") -> str:
    """An HTML table in a scroll box: numbers right-aligned and unbroken, text wrapped, `links` maps a column to
    a function of the row giving the href its cell links to (None: no link). Keys starting with _ are not shown
    (a link can read them); run_id is left out (the page is one run's)."""
    if not rows:
        return "<p>(none)</p>"
    links = links or {}
    cols = [c for c in rows[0] if not c.startswith("_") and c != "run_id"]
    head = "".join(f"<th>{header(c)}</th>" for c in cols)

    def td(c: str, r: dict) -> str:
        v = r[c]
        kind = "num" if isinstance(v, numbers.Number) and not isinstance(v, bool) else "text"
        href = links[c](r) if c in links else None
        return f'<td class="{kind}">{link(href, cell(v)) if href else esc(cell(v))}</td>'

    body = "".join("<tr>" + "".join(td(c, r) for c in cols) + "</tr>" for r in rows)
    ident = f' id="{esc(table_id)}"' if table_id else ""
    return f'<div class="scroll"><table{ident}><tr>{head}</tr>{body}</table></div>'


def by_partition(rows: list[dict]) -> list[dict]:
    """Rows keyed by iteration and partition (PARTITION_COLUMNS) with the partition folded into one label, key
    columns first: fewer, narrower columns."""
    return [
        {
            "iteration": r["iteration"],
            "partition": partition_label(r),
            **{k: v for k, v in r.items() if k not in ("run_id", "iteration", *PARTITION_COLUMNS)},
        }
        for r in rows
    ]


def viewer_note(root: Path, run_id: str) -> str:
    url = f"http://127.0.0.1:{VIEWER_PORT}/runs/{quote(run_id, safe='')}/report/"
    command = f"cleaner view storage.root={shlex.quote(str(Path(root).resolve()))}"
    return (
        f'<p class="note" id="viewer-note">Iteration numbers, kinds and the example trajectories link to pages of '
        f"<code>cleaner view</code>, the local trajectory viewer. They work when this page is opened through it: "
        f"run <code>{esc(command)}</code> and open {link(url, url)} (this report, served by the viewer; "
        f"<code>--port</code> changes the port). Opened as a file, those links do not resolve.</p>"
    )


def _span(iterations: list[int]) -> str:
    its = sorted(iterations)
    if len(its) == 1:
        return f"iteration {its[0]}"
    if its == list(range(its[0], its[-1] + 1)):
        return f"iterations {its[0]}–{its[-1]} ({len(its)})"
    return "iterations " + ", ".join(map(str, its))


def _examples(m: dict, examples: list[dict]) -> str:
    mine = [e for e in examples if all(e.get(c) == m.get(c) for c in PARTITION_COLUMNS)]
    parts = []
    for sign, pick in (("negative", lambda e: e["advantage"] < 0), ("positive", lambda e: e["advantage"] > 0)):
        found = [
            link(
                trajectory_href(e["iteration"], e["prompt_id"], e["sample_idx"]),
                f"iteration {e['iteration']} · {e['prompt_id']} #{e['sample_idx']}",
            )
            for e in mine
            if pick(e)
        ]
        if found:
            parts.append(f"{sign} advantage: " + ", ".join(found))
    return (" Trajectories whose failed calls it stops training: " + "; ".join(parts) + ".") if parts else ""


def mode_sentence(m: dict, examples: list[dict]) -> str:
    name = partition_label(m)
    return (
        f'<li class="mode-rule" data-mode="{esc(m["mode"])}"><strong>{esc(name)}</strong>: over '
        f"{esc(_span(m['iterations']))}, raw trains {m['raw_negative']} failed-call tokens under negative "
        f"advantage and {m['raw_positive']} under positive; {esc(name)} stops training {m['removed_negative']} "
        f"negative- and {m['removed_positive']} positive-advantage ones. <strong>Token-level rule: "
        f"{esc(m['verdict'])}.</strong>{_examples(m, examples)}</li>"
    )


def per_iteration(failed: list[dict]) -> list[dict]:
    """One row per purified partition and iteration that has a raw partition beside it: the token-level counts
    and verdict (the report's detail table)."""
    return [
        {
            "iteration": r["iteration"],
            "partition": partition_label(r),
            "raw trains on negative": raw["on_negative"],
            "raw trains on positive": raw["on_positive"],
            "stops training on negative": neg,
            "stops training on positive": pos,
            "prediction": verdict(neg, pos),
            "_key": partition_key(r),
        }
        for r, raw, neg, pos in removals(failed)
    ]


def rule_section(run_id: str, kinds: list[dict], failed: list[dict], examples: list[dict]) -> str:
    """The token-level hypothesis, per purification mode present in the run, then the coarse rule marked as disproved,
    then the two tables the rules read."""
    writeup = link(WRITEUP_FILE.as_uri(), WRITEUP) if WRITEUP_FILE.is_file() else f"<code>{esc(WRITEUP)}</code>"
    modes = token_rule_by_mode(failed)
    present = sorted({r["mode"] for r in failed})
    if modes:
        stated = '<ul class="modes" id="token-rule">' + "".join(mode_sentence(m, examples) for m in modes) + "</ul>"
    elif not failed:
        stated = '<p id="token-rule">No purified partition in this run: nothing to predict.</p>'
    elif "raw" not in present:
        stated = (
            f'<p id="token-rule">No prediction: the run has no raw partition to compare its modes with. Add one '
            f"from the stored raw shards with <code>cleaner replay --run {esc(shlex.quote(run_id))} --iteration 0 "
            f"--mode raw {esc(' '.join(present))}</code> (or list raw in <code>purify.modes</code>).</p>"
        )
    else:
        stated = '<p id="token-rule">No mode the rule applies to: only raw and roc were purified.</p>'
    skipped = [m for m in present if m in NOT_A_REMOVAL and m != "raw"]
    if skipped:
        stated += "<p>" + " ".join(f"{esc(m)}: {esc(NOT_A_REMOVAL[m])}." for m in skipped) + "</p>"
    answer_link = (
        link(ANSWER_FILE.as_uri(), ANSWER_WRITEUP) if ANSWER_FILE.is_file() else f"<code>{esc(ANSWER_WRITEUP)}</code>"
    )
    answer = esc(ANSWER).replace(esc(ANSWER_WRITEUP), answer_link)
    rule = (
        esc(TOKEN_RULE[0].upper() + TOKEN_RULE[1:])
        .replace(esc(WRITEUP), writeup)
        .replace(esc(ANSWER_WRITEUP), answer_link)
    )
    coarse = esc(RULE[0].upper() + RULE[1:]).replace(esc(WRITEUP), writeup)
    links = {"iteration": lambda r: iteration_href(r["iteration"], partition=r["_key"], kind="recovered")}
    kind_links = {
        "iteration": lambda r: iteration_href(r["iteration"]),
        "kind": lambda r: iteration_href(r["iteration"], kind=r["kind"]),
    }
    return f"""<h2 id="rule">Does purification help? A hypothesis to check</h2>
<p class="answer" id="should-i">{answer}.</p>
<p class="rule">{rule}.</p>
{stated}
<p class="disproved" id="coarse-rule">{coarse}. In that experiment it said “help” on the recovery world, where SAAR left
accuracy unchanged within noise and ended with more first-call tool errors than raw (+0.022 ± 0.004, 95% t-interval
[+0.005, +0.040], n = 3; not significant after correction), and nothing consistent on the default world. The
recovered trajectories' mean advantage below describes the run; it is not a prediction.</p>
<h3>The rule per iteration (links: the partition's recovered trajectories in the viewer)</h3>
{table(per_iteration(failed), links, "token-rule-iterations")}
<h3>Trajectories by kind (raw shards; GRPO group_norm advantage in the prompt group)</h3>
{table(kinds, kind_links, "kinds")}
<h3>Failed-call tokens each purified partition trains, by the sign of their advantage</h3>
{table(failed, None, "failed-calls")}"""
