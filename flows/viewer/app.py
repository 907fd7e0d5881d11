"""`cleaner view`'s web app (FastAPI, server-rendered HTML): runs → iterations → trajectory table → one
trajectory, the run's report, and a SQL box, over a storage root's committed shards.

Bad input never becomes a 500: an unknown run, iteration or trajectory is a 404 page naming it with a link
back; a shard that fails validation is a banner naming its file while the rest of the page (and every other
page) is shown. Every response carries a Content-Security-Policy that runs no script at all (the pages need
none), on top of the escaping, and only Host headers naming this machine are served (a web page elsewhere
cannot reach the viewer through DNS rebinding); a fetch the browser marks as another site's (Sec-Fetch-Site:
cross-site, an <img> pointing at the SQL box) is refused unless it is a navigation (a link the user follows).
`Server-Timing` gives each page's server-side time.
"""

from __future__ import annotations

import re
import time
from pathlib import Path
from typing import Any
from urllib.parse import quote

import duckdb
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import FileResponse, RedirectResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.middleware.trustedhost import TrustedHostMiddleware

from flows.report_tables import partition_label
from flows.viewer import table as tables
from flows.viewer.pages import render, report_parts
from flows.viewer.sql_box import SqlRefused, run_sql
from flows.viewer.store import BadFilter, NotFound, Store
from flows.viewer.tokens import find_source, token_text
from flows.viewer.trajectory import COLOURS, build
from storage.errors import CleanerError, first_line

CSP = (
    "default-src 'none'; style-src 'unsafe-inline'; img-src 'self'; form-action 'self'; frame-ancestors 'none'; "
    "base-uri 'none'"
)
VIEWS = (
    "raw_trajectories, raw_attempts, raw_texts, raw_attempt_texts, raw_summary, purified, purified_texts, "
    "purified_summary, splices, purify_compare, dead_letters, metrics, raw_kinds, trajectory_kinds, "
    "failed_call_advantage, off_policy, catalog_problems"
)
REPORT_FILE = re.compile(r"^[\w.=-]+\.png$")
EXAMPLE_SQL = (
    "SELECT r.prompt_id, r.sample_idx, a.position_idx, a.attempt_idx, a.error_label, t.turn_text\n"
    "FROM raw_attempts a JOIN raw_attempt_texts t USING (run_id, iteration, prompt_id, sample_idx, "
    "position_idx, attempt_idx)\nJOIN raw_trajectories r USING (run_id, iteration, prompt_id, sample_idx)\n"
    "WHERE a.status = 'failure' LIMIT 20"
)


def _int(text: str, what: str, back: str, back_label: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise NotFound(f"unknown {what} {text!r}: not a number", back, back_label) from None


def trajectory_href(run_id: str, iteration: int, prompt_id: str, sample_idx: int) -> str:
    return (
        f"/runs/{quote(run_id, safe='')}/{iteration}/trajectory?prompt={quote(prompt_id, safe='')}&sample={sample_idx}"
    )


def create_app(
    root: Path, catalog_file: Path, hosts: tuple[str, ...] = ("127.0.0.1", "localhost", "[::1]", "::1")
) -> FastAPI:
    store = Store(root, catalog_file)
    app = FastAPI(title="cleaner view", docs_url=None, redoc_url=None, openapi_url=None)
    app.add_middleware(TrustedHostMiddleware, allowed_hosts=[*hosts, "testserver"])
    base: dict[str, Any] = {"root": str(store.root)}

    @app.middleware("http")
    async def headers(request: Request, call_next):
        t0 = time.perf_counter()
        # another site's page making this browser fetch (an <img> on the SQL box); a link the user follows (a
        # report opened as a file, a notebook on localhost) is a navigation, and passes
        if (
            request.headers.get("sec-fetch-site") == "cross-site"
            and request.headers.get("sec-fetch-mode") != "navigate"
        ):
            response = Response(
                "refused: a request another site's page made through your browser (open the viewer's address yourself)",
                status_code=403,
                media_type="text/plain",
            )
        else:
            response = await call_next(request)
        response.headers["Content-Security-Policy"] = CSP
        response.headers["X-Content-Type-Options"] = "nosniff"
        response.headers["Referrer-Policy"] = "no-referrer"
        response.headers["Server-Timing"] = f"app;dur={(time.perf_counter() - t0) * 1000:.1f}"
        return response

    def error_page(
        status: int,
        message: str,
        back: str = "/",
        back_label: str = "all runs",
        heading: str = "Not found",
        title: str = "not found",
    ) -> Response:
        return render(
            "error.jinja",
            status,
            heading=heading,
            message=message,
            back=back,
            back_label=back_label,
            title=title,
            error=status != 404,
            **base,
        )

    @app.exception_handler(NotFound)
    async def not_found(_request: Request, e: NotFound):
        return error_page(e.status, str(e), e.back, e.back_label, heading=e.heading, title=e.heading.lower())

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, e: StarletteHTTPException):
        if e.status_code == 404:
            return error_page(404, f"no page at {request.url.path}")
        return error_page(e.status_code, str(e.detail), heading=str(e.status_code), title=str(e.status_code))

    @app.exception_handler(RequestValidationError)
    async def bad_request(_request: Request, e: RequestValidationError):
        return error_page(404, f"bad address: {e.errors()[0].get('msg')}")

    @app.exception_handler(duckdb.Error)
    @app.exception_handler(CleanerError)
    @app.exception_handler(OSError)
    async def unreadable(_request: Request, e: Exception):
        # a shard changed or removed after the catalog listed it: named, and the other pages still work
        return error_page(503, first_line(e), heading="Could not read the store", title="unreadable")

    @app.get("/")
    def index():
        return render(
            "index.jinja",
            runs=store.runs(),
            problems=store.problems(),
            catalog=str(store.catalog_file),
            published=store.catalog_file.is_file(),
            title="runs",
            **base,
        )

    @app.get("/sql")
    def sql(q: str = ""):
        result, error = None, None
        if q.strip():
            try:
                con = store.published()
                if con is None:
                    raise SqlRefused(
                        f"no catalog at {store.catalog_file} yet: a stage commit or `cleaner inspect` publishes it"
                    )
                result = run_sql(con, q)
            except SqlRefused as e:
                error = str(e)
        return render(
            "sql.jinja",
            400 if error else 200,
            q=q or EXAMPLE_SQL,
            result=result,
            error=error,
            max_rows=1000,
            views=VIEWS,
            title="SQL",
            crumbs=[("/sql", "SQL")],
            **base,
        )

    def run_problems(run_id: str) -> list[dict[str, Any]]:
        prefix = str(store.root / "runs" / run_id) + "/"
        return [p for p in store.problems() if str(p["path"]).startswith(prefix)]

    @app.get("/runs/{run_id}")
    def run_page(run_id: str):
        store.check_run(run_id)
        its = store.iterations(run_id)
        for it in its:
            it["partitions"] = tables.named(it["partitions"])
        return render(
            "run.jinja",
            run=run_id,
            iterations=its,
            problems=run_problems(run_id),
            title=run_id,
            crumbs=[(f"/runs/{quote(run_id, safe='')}", run_id)],
            **base,
        )

    @app.get("/runs/{run_id}/report")
    def report_redirect(run_id: str):
        store.check_run(run_id)
        return RedirectResponse(f"/runs/{quote(run_id, safe='')}/report/")

    @app.get("/runs/{run_id}/report/")
    def report(run_id: str):
        layout = store.check_run(run_id)
        page = layout.run_dir / "report" / "index.html"
        style, body = report_parts(page.read_text()) if page.is_file() else ("", None)
        examples = store.spliced_examples(run_id)
        for e in examples:
            e["href"] = trajectory_href(run_id, e["iteration"], e["prompt_id"], e["sample_idx"])
            e["label"] = partition_label(e)
        iterations = [
            r["iteration"]
            for r in store.query(
                "SELECT DISTINCT iteration FROM raw_summary WHERE run_id = $run ORDER BY 1", run=run_id
            )
        ]
        return render(
            "report.jinja",
            run=run_id,
            report=body,
            report_style=style,
            examples=examples,
            iterations=iterations,
            problems=run_problems(run_id),
            title=f"report {run_id}",
            crumbs=[(f"/runs/{quote(run_id, safe='')}", run_id), (f"/runs/{quote(run_id, safe='')}/report/", "report")],
            **base,
        )

    @app.get("/runs/{run_id}/report/{name}")
    def report_file(run_id: str, name: str):
        layout = store.check_run(run_id)
        if name == "index.html":  # the file `cleaner report` writes is this page in the viewer
            return RedirectResponse(f"/runs/{quote(run_id, safe='')}/report/")
        path = layout.run_dir / "report" / name
        if not REPORT_FILE.match(name) or not path.is_file():
            raise NotFound(
                f"no report file {name!r} for run {run_id!r}", f"/runs/{quote(run_id, safe='')}/report/", "the report"
            )
        return FileResponse(path, media_type="image/png")

    def crumbs(run_id: str, iteration: int) -> list[tuple[str, str]]:
        r = quote(run_id, safe="")
        return [(f"/runs/{r}", run_id), (f"/runs/{r}/{iteration}", f"iteration {iteration}")]

    @app.get("/runs/{run_id}/{iteration}")
    def iteration_page(
        run_id: str,
        iteration: str,
        kind: str = "",
        label: str = "",
        partition: str = "",
        spliced: str = "",
        reward_min: str = "",
        reward_max: str = "",
        advantage: str = "",
        q: str = "",
    ):
        it = _int(iteration, "iteration", f"/runs/{quote(run_id, safe='')}", f"run {run_id}")
        scope = store.scope(run_id, it)
        parts = tables.partitions(scope)
        try:
            f = tables.filters(
                parts,
                kind=kind,
                label=label,
                partition=partition,
                spliced=spliced,
                reward_min=reward_min,
                reward_max=reward_max,
                advantage=advantage,
                q=q,
            )
        except ValueError as e:
            raise BadFilter(str(e), f"/runs/{quote(run_id, safe='')}/{it}", f"iteration {it}, unfiltered") from None
        rows, total_matching = tables.trajectories(scope, f, parts)
        for r in rows:
            r["href"] = trajectory_href(run_id, it, r["prompt_id"], r["sample_idx"])
        total = scope.rows("SELECT count(*) AS n FROM raw_summary")[0]["n"]
        return render(
            "iteration.jinja",
            run=run_id,
            iteration=it,
            f=f,
            kinds=tables.KINDS,
            labels=tables.labels(scope),
            partitions=parts,
            rows=rows,
            total=total,
            truncated=total_matching > len(rows),
            adv_source="the chosen partition's" if partition else "GRPO advantage in the prompt group (raw rewards)",
            splice_source="the chosen partition's" if partition else "the most any partition made",
            problems=[vars(p) for p in scope.problems],
            title=f"{run_id} iteration {it}",
            crumbs=crumbs(run_id, it),
            **base,
        )

    @app.get("/runs/{run_id}/{iteration}/trajectory")
    def trajectory_page(run_id: str, iteration: str, prompt: str = "", sample: str = "", colour: str = "delta"):
        it = _int(iteration, "iteration", f"/runs/{quote(run_id, safe='')}", f"run {run_id}")
        back = f"/runs/{quote(run_id, safe='')}/{it}"
        s = _int(sample, "sample", back, f"iteration {it}")
        scope, raw, purified, dead = store.trajectory(run_id, it, prompt, s)
        source = find_source(store.root, run_id, it)
        if source is None:
            raise CleanerError(
                f"no tokenizer for run {run_id!r} iteration {it}: neither the checkpoint its raw shard "
                "records nor run.json's rollout.policy holds a tokenizer.json"
            )
        colour = colour if colour in COLOURS else "delta"
        positions, final, variants = build(token_text(source), raw, purified, colour)  # type: ignore[arg-type]
        kind = scope.rows(
            "SELECT kind, advantage FROM raw_kinds WHERE prompt_id = $p AND sample_idx = $s", p=prompt, s=s
        )
        return render(
            "trajectory.jinja",
            run=run_id,
            iteration=it,
            prompt_id=prompt,
            sample_idx=s,
            raw=raw,
            kind=kind[0]["kind"] if kind else "",
            advantage=kind[0]["advantage"] if kind else None,
            tokenizer=f"{source.path} — {source.why}",
            dead=dead,
            positions=positions,
            final=final,
            variants=variants,
            colours=COLOURS,
            colour=colour,
            problems=[vars(p) for p in scope.problems],
            title=f"{prompt} #{s}",
            crumbs=[*crumbs(run_id, it), ("", f"{prompt} #{s}")],
            **base,
        )

    return app
