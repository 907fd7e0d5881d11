"""`cleaner inspect`: the catalog's numbers as tables, or the user's own SQL."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from flows.command import command_parser, config_of
from storage.errors import InspectError, WorkspaceError, first_line

if TYPE_CHECKING:  # `cleaner --help` reads COLUMNS: DuckDB, Arrow and rich load when a table is printed
    import pyarrow as pa
    from rich.console import Console

    from pipeline.config import CleanerConfig

# what the catalog holds (storage/catalog.py), named in --help and under the summary
VIEWS = (
    "raw_trajectories",
    "raw_attempts",
    "raw_summary",
    "purified",
    "purified_summary",
    "splices",
    "purify_compare",
    "dead_letters",
    "metrics",
    "raw_kinds",
    "trajectory_kinds",
    "failed_call_advantage",
    "off_policy",
    "raw_texts",
    "raw_attempt_texts",
    "purified_texts",
    "catalog_problems",
)

EXAMPLE_QUERIES = {
    "tool-error rate per iteration": (
        "SELECT run_id, iteration, avg(stats.first_attempt_failures) AS first_call_failures_per_trajectory, "
        "avg(reward) AS mean_reward FROM raw_trajectories GROUP BY ALL ORDER BY ALL"
    ),
    "failures by label and class": (
        "SELECT error_label, error_class, count(*) AS n FROM raw_attempts WHERE status = 'failure' "
        "GROUP BY ALL ORDER BY n DESC"
    ),
    "raw vs purified per γ": "SELECT * FROM purify_compare",
    "mean advantage per trajectory kind (whether purification helps: the token-level rule of `cleaner replay`)": (
        "SELECT * FROM trajectory_kinds ORDER BY ALL"
    ),
    "failed-call tokens trained under negative vs positive advantage, per mode": (
        "SELECT * FROM failed_call_advantage ORDER BY ALL"
    ),
    "similarity of splices": (
        "SELECT mode, gamma, is_threshold, kind, count(*) AS n, avg(similarity) AS mean_similarity FROM splices "
        "GROUP BY ALL ORDER BY ALL"
    ),
}

SUMMARY_SQL = {
    "raw trajectories": (
        "SELECT run_id, iteration, count(*) AS trajectories, avg(reward) AS mean_reward, "
        "avg(stats.tool_calls) AS tool_calls, avg(stats.first_attempt_failures) AS first_call_failures_per_trajectory, "
        "sum(stats.recovered) AS recovered, avg(response_tokens) AS response_tokens "
        "FROM raw_summary {where} GROUP BY ALL ORDER BY ALL"
    ),
    "purified shards": "SELECT * FROM purify_compare {where} ORDER BY ALL",
}
RECENT = 10  # iterations per run the default tables show: their length does not grow with the run's history
# the rows of a run's last RECENT iterations (the tables' {where}); --all drops it
RECENT_SQL = "iteration > (SELECT max(iteration) FROM raw_summary r WHERE r.run_id = {table}.run_id) - {n}"


@dataclass(frozen=True)
class Column:
    """One column of a summary table: the query's column, its heading (words, so that a narrow terminal wraps a
    heading rather than cutting it), what it means (`cleaner inspect --help`), and whether only --wide shows it."""

    name: str
    header: str
    note: str
    wide: bool = False
    narrow: bool = False  # shown without --wide only (its columns are shown instead)


_RUN = Column("run_id", "run", "the run (flow.run_id)")
_ITERATION = Column("iteration", "iteration", "the iteration: its raw shard, sampled by checkpoint ITERATION")
_TRAJECTORIES = Column("trajectories", "trajectories", "trajectories sampled (tasks × rollout.samples_per_prompt)")
_MEAN_REWARD = Column("mean_reward", "mean reward", "mean reward of those trajectories")
_RESPONSE = (
    "mean response length as lived, in tokens: what the model's context held at the end; under "
    "rollout.saar.live_mode=purified a retry took its failed turn's place there, while the attempt tree "
    "(raw_attempts) keeps every attempt"
)
# each summary table's columns, in the order shown; the default ones fit a terminal 100 columns wide
COLUMNS: dict[str, tuple[Column, ...]] = {
    "raw trajectories": (
        _RUN,
        _ITERATION,
        _TRAJECTORIES,
        _MEAN_REWARD,
        Column("tool_calls", "tool calls", "tool calls per trajectory, retries included"),
        Column(
            "first_call_failures_per_trajectory",
            "first-call failures",
            "positions per trajectory whose first call failed (the tool-error rate SAAR retries after)",
        ),
        Column("recovered", "recovered", "positions, summed, whose failed call a retry fixed"),
        Column("response_tokens", "response tokens", _RESPONSE),
    ),
    "purified shards": (  # one table per run (PER_RUN): without a run column its columns fit 100 characters
        _ITERATION,
        Column(
            "partition",
            "partition",
            "the purified partition: mode, its γ (τ for saar_is) and the similarity "
            "measure when not the default; --wide shows them as mode, gamma, is_threshold, measure",
            narrow=True,
        ),
        Column("mode", "mode", "purification mode (docs/saar.md#purification-modes)", wide=True),
        Column("gamma", "gamma", "SAAR's shallow/deep threshold γ of a splicing mode (0 for the others)", wide=True),
        Column(
            "is_threshold", "tau", "the importance-ratio threshold τ of mode saar_is (None for the others)", wide=True
        ),
        Column(
            "measure", "measure", "similarity measure of a splicing mode's partition (None for the others)", wide=True
        ),
        Column("trajectories", "rows", "purified rows (one per raw trajectory, fewer for roc)"),
        Column("raw_response_tokens", "raw tokens", "the raw trajectories' " + _RESPONSE),
        Column(
            "purified_response_tokens",
            "purified tokens",
            "mean response length of the purified rows; the raw mode keeps every attempt and every error "
            "where they were sampled, so it exceeds the raw tokens (the response as lived) when calls failed",
        ),
        Column(
            "trained_tokens", "trained tokens", "mean tokens per row with loss mask 1 (tool outputs are not trained)"
        ),
        Column(
            "splices",
            "splices",
            "retries spliced over a failed turn, summed (several per position when several retries were needed)",
        ),
        Column("shallow", "shallow", "splices that kept the failed turn's reasoning (similarity ≥ γ)", wide=True),
        Column("deep", "deep", "splices that replaced the whole failed turn (similarity < γ)", wide=True),
        Column("tokens_removed", "tokens removed", "tokens the splices removed, summed"),
        Column(
            "tokens_forwarded",
            "tokens forwarded",
            "mean tokens per row the log-prob recompute ran through "
            "the model (CPU: the response up to its last recomputed token, the prompt's KV shared; SGLang: from "
            "the first token whose context changed)",
            wide=True,
        ),
        Column("mean_reward", "mean reward", "mean reward of the rows"),
    ),
    "per iteration": (
        _ITERATION,
        _TRAJECTORIES,
        _MEAN_REWARD,
        Column("accuracy", "accuracy", "share of trajectories with a positive reward"),
        Column(
            "first_call_failures_per_trajectory",
            "first-call failures",
            "positions per trajectory whose first call failed",
        ),
        Column("tool_calls", "tool calls", "tool calls per trajectory, retries included", wide=True),
        Column("response_tokens", "response tokens", _RESPONSE),
        Column("generated_tokens", "generated tokens", "tokens sampled, summed, failed attempts included", wide=True),
        Column(
            "failed_tokens_per_generated",
            "failed tokens per generated",
            "failed attempts' tokens (the whole failed turn, reasoning and call, and its error message) per "
            "sampled token, summed over the iteration: a ratio, above 1 when error messages are longer than what "
            "the model wrote (under live SAAR the lived sequence holds neither)",
        ),
        Column("update_loss", "update loss", "mean GRPO policy loss of the update that trained on the iteration"),
        Column("clip_ratio", "clip ratio", "mean share of trained tokens whose ratio was clipped", wide=True),
        Column("entropy", "entropy", "mean policy entropy at the trained tokens (train.log_entropy)", wide=True),
        Column(
            "correction_filtered",
            "correction filtered",
            "train.rollout_correction: mean share of trained tokens its gate masked or clipped",
            wide=True,
        ),
        Column(
            "behaviour_kl",
            "behaviour KL",
            "train.rollout_correction: mean log(π_behaviour / π_old) over the trained tokens (k1, may be < 0)",
            wide=True,
        ),
        Column("dpo_loss", "DPO loss", "train.use_dpo_on_tool_calls: mean side loss −log σ(β·Δ)", wide=True),
        Column("dpo_pairs", "DPO pairs", "train.use_dpo_on_tool_calls: tool-call pairs trained, summed", wide=True),
        Column(
            "dpo_capped",
            "DPO capped",
            "train.use_dpo_on_tool_calls: mean share of pairs whose weight hit train.dpo_max_adjustment_ratio",
            wide=True,
        ),
    ),
}
PER_RUN = {"purified shards"}  # summary tables printed once per run ("per iteration" is per run anyway)
FOOTNOTES = {
    "purified shards": "raw tokens: the response as lived; raw mode keeps every attempt and error, so its purified "
    "tokens exceed them. Columns: `cleaner inspect --help`; all of them: --wide",
}


def columns_help() -> str:
    """Every column of the summary tables, for `cleaner inspect --help`."""
    import textwrap

    lines = []
    for title, columns in COLUMNS.items():
        lines.append(f"Columns of '{title}' (heading (query column): meaning; * only with --wide):")
        lines += [
            textwrap.fill(
                f"{c.header} ({c.name}){' *' if c.wide else ''}: {c.note}",
                100,
                initial_indent="  ",
                subsequent_indent="      ",
            )
            for c in columns
        ]
    return "\n".join(lines)


def _partition(row: dict) -> str:
    """`saar γ=0.5`, `saar γ=0.5 (difflib, segment)`, `saar_is τ=0.5`, `raw`: the report's partition label, its
    measure in words a narrow column can wrap."""
    from flows.report_tables import partition_label

    measure = row.get("measure")
    label = partition_label(row)
    return label.replace(f"({measure})", f"({measure.replace('-', ', ')})") if measure else label


def _cell(value: object) -> str:
    return "" if value is None else f"{value:.4g}" if isinstance(value, float) else str(value)


def _widths(texts: list[list[str]], budget: int) -> list[int] | None:
    """Column widths that fit `budget` characters with no word cut (a heading wraps at its spaces, a value
    whole), each column as wide as its longest line where the room allows; None when even that does not fit.
    (rich's own fitting shrinks the widest columns first and cuts what no longer fits to `17…`.)"""
    from rich.cells import cell_len

    least = [max(cell_len(w) for t in col for w in (t.split() or [""])) for col in texts]
    most = [max(cell_len(t) for t in col) for col in texts]
    spare = budget - sum(least)
    if spare < 0:
        return None
    widths = list(least)
    for j in sorted(range(len(texts)), key=lambda j: most[j] - least[j]):  # whole headings for the most columns
        grow = min(spare, most[j] - least[j])
        widths[j] += grow
        spare -= grow
    return widths


def print_table(
    console: Console,
    title: str,
    table: pa.Table,
    columns: tuple[Column, ...] | None = None,
    wide: bool = False,
    footnote: str | None = None,
) -> None:
    """A query's result as a table; a summary table's `columns` (the default ones unless `wide`) with their
    headings. A table that cannot fit the terminal without cutting a word is printed at its own width (the
    terminal wraps it, `less -S` scrolls it): a cut value would read as another number."""
    from rich.table import Table
    from rich.text import Text

    # its own line: a table's title is wrapped to the table's width, a query to a column of 5 characters
    console.print(title, style="italic", markup=False, highlight=False)
    shown = (
        [c for c in columns if not (c.narrow if wide else c.wide)]
        if columns
        else [Column(n, n, "") for n in table.column_names]
    )
    rows = [
        [_cell(_partition(row) if c.name == "partition" and "partition" not in row else row[c.name]) for c in shown]
        for row in table.to_pylist()
    ]
    widths = _widths(
        [[c.header, *(r[j] for r in rows)] for j, c in enumerate(shown)], console.width - 3 * len(shown) - 1
    )
    import pyarrow as pa

    # numbers to the right, text to the left (a summary table's text columns by name, a query's by type)
    text = (
        {"run_id", "partition", "mode", "measure"}
        if columns
        else {
            f.name
            for f in table.schema
            if not (pa.types.is_integer(f.type) or pa.types.is_floating(f.type) or pa.types.is_decimal(f.type))
        }
    )
    out = Table()
    for j, c in enumerate(shown):
        out.add_column(
            Text(c.header), width=widths[j] if widths else None, justify="left" if c.name in text else "right"
        )
    for r in rows:  # as Text: a cell holds model code and tool output (`lst[i]`, `[/]`), never rich markup
        out.add_row(*map(Text, r))
    width = console.width
    if widths is None:  # rather too wide than cut
        console.width = console.measure(out, options=console.options.update_width(10_000)).maximum
    try:
        console.print(out)
    finally:
        console.width = width
    if footnote:
        console.print(footnote, style="italic", highlight=False)


def run_inspect(
    cfg: CleanerConfig,
    sql: str | None = None,
    run_id: str | None = None,
    print_queries: bool = False,
    verify: bool = False,
    show_all: bool = False,
    wide: bool = False,
) -> int:
    import duckdb

    if sum((sql is not None, print_queries, verify)) > 1:  # (an argparse group would hide --sql's value from the
        # override split: flows/command.py records the options that take a value as they are added to a parser)
        raise InspectError("--sql, --queries and --verify are one at a time")
    if sql is not None and not sql.strip():
        raise InspectError('--sql needs a query (e.g. --sql "SELECT * FROM purify_compare")')
    if sql is not None and run_id is not None:  # it ran the query over every run, as if --run were not there
        raise InspectError(f"--run restricts the summary tables, not --sql: add WHERE run_id = '{run_id}' to the query")
    if not print_queries and not cfg.storage.root.is_dir():  # a mistyped root must not become a new, empty one
        raise WorkspaceError(
            f"storage.root {cfg.storage.root} does not exist (no run has written there; check storage.root or --config)"
        )
    try:
        return _verify(cfg) if verify else _inspect(cfg, sql, run_id, print_queries, show_all, wide)
    except duckdb.Error as e:
        if isinstance(e, duckdb.IOException):
            raise InspectError(
                f"{cfg.storage.root / cfg.storage.catalog}: cannot open the catalog ({first_line(e)})"
            ) from None
        raise InspectError(f"SQL error: {first_line(e)}") from None


def _verify(cfg: CleanerConfig) -> int:
    """Every committed part checked in full; each bad shard named with what is wrong."""
    import sys

    from storage import shards
    from storage.catalog import Catalog

    before = shards.FULL_READS
    with Catalog(cfg.storage.root, verify=True) as cat:
        bad = [p for p in cat.problems if p.committed]
        for problem in cat.problems:
            print(
                f"cleaner inspect --verify: {'BAD' if problem.committed else 'uncommitted'} {problem}", file=sys.stderr
            )
    print(f"verified {cfg.storage.root}: {shards.FULL_READS - before} parts read in full, {len(bad)} bad shard(s)")
    return 1 if bad else 0


def _inspect(
    cfg: CleanerConfig,
    sql: str | None,
    run_id: str | None,
    print_queries: bool,
    show_all: bool = False,
    wide: bool = False,
) -> int:
    import sys

    import duckdb
    from rich.console import Console

    # pipes and logs get whole columns; `:x:` in a value or a query is text, not an emoji
    console = Console(width=None if sys.stdout.isatty() else 220, emoji=False)
    db = (cfg.storage.root / cfg.storage.catalog).resolve()
    if print_queries:
        console.print(f"duckdb -readonly {db}")
        for title, q in EXAMPLE_QUERIES.items():
            console.print(f"-- {title}\n{q};\n")
        return 0
    from storage.catalog import Catalog, publish, scan

    try:
        publish(cfg.storage.root, db)  # scanned in its turn: a scan made before it could be older than the file
    except Exception as e:  # noqa: BLE001 - the tables below are built in memory and do not need the file
        # e.g. a read-only root: the reason, and nobody sent to rerun inspect (what it prints does not need the file)
        reason = (e.strerror or str(e)).lower() if isinstance(e, OSError) else (str(e).strip().splitlines() or [""])[0]
        print(
            f"cleaner inspect: catalog {db} not republished ({reason or type(e).__name__}); the tables below are "
            "read from the shards directly",
            file=sys.stderr,
        )
    scanned = scan(cfg.storage.root)
    with Catalog(cfg.storage.root, scanned=scanned) as cat:  # in memory: a process holding the file blocks nothing
        for problem in cat.problems:  # named, never silently dropped; the tables below leave them out
            print(f"cleaner inspect: skipped {problem}", file=sys.stderr)
        if sql is not None:
            try:
                result = cat.query(sql)
            except duckdb.Error as e:  # the user's SQL, whatever it opens: not the catalog's failure
                raise InspectError(f"SQL error: {first_line(e)}") from None
            print_table(console, sql, result)
            return 0
        known = [r["run_id"] for r in cat.query("SELECT DISTINCT run_id FROM raw_summary ORDER BY 1").to_pylist()]
        if run_id is not None and run_id not in known:
            raise InspectError(f"no run {run_id!r} in {cfg.storage.root} (runs: {', '.join(known) or 'none yet'})")
        conditions = ["run_id = '{}'".format(run_id.replace("'", "''"))] if run_id else []
        longest = cat.query(
            "SELECT coalesce(max(n), 0) AS n FROM (SELECT count(DISTINCT iteration) AS n "
            "FROM raw_summary GROUP BY run_id)"
        ).to_pylist()[0]["n"]
        cut = not show_all and longest > RECENT
        for title, q in SUMMARY_SQL.items():
            table = "raw_summary" if "raw_summary" in q else "purify_compare"
            where = conditions + ([RECENT_SQL.format(table=table, n=RECENT)] if cut else [])
            result = cat.query(q.format(where=("WHERE " + " AND ".join(where)) if where else ""))
            ids = result["run_id"].to_pylist() if title in PER_RUN else []
            runs = sorted(set(ids))
            for i, run in enumerate(runs):
                # a run's rows are contiguous (ORDER BY ALL, run_id first): a slice, where a compute filter would
                # import pandas (pyarrow converts the scalar through it), 0.3-0.6 s of every inspect
                part = result.slice(ids.index(run), ids.count(run))
                print_table(
                    console,
                    f"{title}: {run}",
                    part,
                    COLUMNS[title],
                    wide,
                    FOOTNOTES.get(title) if i == len(runs) - 1 else None,
                )
            if not runs:
                print_table(console, title, result, COLUMNS[title], wide, FOOTNOTES.get(title))
        from flows.report import ITERATIONS_SQL

        for run in [run_id] if run_id else known:  # the numbers `cleaner report` plots
            its = cat.con.sql(ITERATIONS_SQL, params={"run": run}).to_arrow_table()
            print_table(
                console,
                f"per iteration: {run}",
                its.slice(max(0, its.num_rows - RECENT)) if cut else its,
                COLUMNS["per iteration"],
                wide,
            )
        if cut:
            console.print(
                f"(the last {RECENT} iterations of each run; `cleaner inspect --all` shows every one)",
                style="italic",
                highlight=False,
            )
    console.print(f"catalog: duckdb -readonly {db}  (views: {', '.join(VIEWS)})")
    return 0


def run(args) -> int:
    return run_inspect(
        config_of(args),
        sql=args.sql,
        run_id=args.run,
        print_queries=args.queries,
        verify=args.verify,
        show_all=args.all,
        wide=args.wide,
    )


def add_parser(sub) -> None:
    p = command_parser(
        sub,
        "inspect",
        "summarise runs from the DuckDB catalog, or run SQL on its views",
        'Examples:\n  cleaner inspect\n  cleaner inspect --sql "SELECT error_label, count(*) FROM raw_attempts '
        'GROUP BY 1"\n  cleaner inspect --queries   # print example queries for duckdb\n\n' + columns_help(),
        f"Views: {', '.join(VIEWS)}. Every part is checked in full once "
        "(checksum, schema, rows) and then trusted while the file is unchanged; --verify checks all again.",
        func=run,
    )
    p.add_argument("--sql", help="run this SQL against the catalog and print the result")
    p.add_argument("--run", help="restrict the summary to one run id")
    p.add_argument("--queries", action="store_true", help="print example queries to try")
    p.add_argument("--all", action="store_true", help="summary tables of every iteration (default: each run's last 10)")
    p.add_argument(
        "--wide",
        action="store_true",
        help=(
            "every column of the summary tables (default: those that fit 100 columns; a table wider than the terminal "
            "is printed whole, for `less -S`)"
        ),
    )
    p.add_argument(
        "--verify",
        action="store_true",
        help=(
            "check every committed part in full (checksum, schema, rows) whatever the verification records say, "
            "name each bad file, and exit 1 if any is bad"
        ),
    )
