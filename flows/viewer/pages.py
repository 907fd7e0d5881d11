"""Rendering: Jinja2 templates (flows/viewer/templates) with autoescaping on for every template, so any text a
page shows — model output, code, tool output, error messages, SQL results — is escaped; only the token HTML
built with html.escape (flows/viewer/trajectory.py) and the run's own report body are passed as Markup."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from jinja2 import Environment, FileSystemLoader, select_autoescape
from markupsafe import Markup
from starlette.responses import HTMLResponse

from flows.premise import cell

TEMPLATES = Path(__file__).resolve().parent / "templates"


def _cell(v: Any) -> str:
    text = cell(v) if isinstance(v, (float, int)) and not isinstance(v, bool) else str(v) if v is not None else "NULL"
    return text if len(text) <= 2000 else text[:2000] + f"… ({len(text)} characters)"


ENV = Environment(
    loader=FileSystemLoader(str(TEMPLATES)),
    autoescape=select_autoescape(default=True, default_for_string=True, enabled_extensions=("jinja", "html")),
)
ENV.filters["num"] = cell
ENV.filters["cell"] = _cell


def render(template: str, status: int = 200, **context: Any) -> HTMLResponse:
    context.setdefault("crumbs", [])
    context.setdefault("problems", [])
    return HTMLResponse(ENV.get_template(template).render(**context), status_code=status)


_BODY = re.compile(r"<body[^>]*>(.*)</body>", re.S | re.I)
_STYLE = re.compile(r"<style[^>]*>(.*?)</style>", re.S | re.I)


def report_parts(page: str) -> tuple[Markup, Markup]:
    """(style, body) of an index.html that `cleaner report` wrote: its own output, already escaped there; its
    rule for `body` is dropped so the viewer's frame keeps its layout."""
    body = _BODY.search(page)
    style = " ".join(_STYLE.findall(page))
    style = re.sub(r"(^|\})\s*body\s*\{[^}]*\}", r"\1", style)
    return Markup(style.replace("</", "")), Markup(body.group(1) if body else page)
