"""A real store for the viewer tests, a viewer served from it in this process, and a headless Chromium.

The store is the session's purified tiny-policy run (tests/conftest.py `purified_run`: 16 tasks × 4 samples,
saar γ=0.5) copied, purified again in mode raw, with its report written and its catalog published, plus a
run `xss` whose one trajectory carries HTML in its question, code, tool output and sampled text.
"""

from __future__ import annotations

import os
import shutil
import threading
from pathlib import Path

import pyarrow as pa

CHROMIUM, CHROMEDRIVER = Path("/usr/bin/chromium"), Path("/usr/bin/chromedriver")
XSS_CODE = '<script>window.__xss = 1; alert(1)</script><img src=x onerror="window.__xss = 2; alert(2)">'
XSS_TOOL = 'Tool call failure\nreason: <img src=y onerror="window.__xss = 3">'
XSS_QUESTION = "What is <script>window.__xss = 4</script> 2 + 2?"


def build_store(purified_cfg, root: Path) -> Path:
    from flows.report import write_report
    from purifier.stage import run_purify_stage
    from pipeline.variants import plan_variants
    from storage.catalog import publish

    shutil.copytree(purified_cfg.storage.root / "runs", root / "runs")
    cfg = purified_cfg.model_copy(deep=True)
    cfg.storage.root = root
    run_purify_stage(cfg, "w", 0, plan_variants(cfg, ["raw"], [0.5]))
    write_xss_run(root)
    write_report(root, "w")
    publish(root, root / "catalog.duckdb")
    return root


def write_xss_run(root: Path) -> None:
    """Run `xss`: one recovered trajectory of run w with HTML wherever model output or tool output goes."""
    from pipeline.config import DEFAULT_POLICY
    from storage.catalog import Catalog
    from storage.layout import RunLayout
    from storage.schemas import RAW
    from storage.shards import write_shard
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(DEFAULT_POLICY / "tokenizer.json"))
    with Catalog(root) as cat:
        key = cat.query(
            "SELECT prompt_id, sample_idx FROM raw_kinds WHERE kind = 'recovered' ORDER BY ALL LIMIT 1"
        ).to_pylist()[0]
        row = (
            cat.con.sql(
                "SELECT * FROM raw_trajectories WHERE prompt_id = $p AND sample_idx = $s",
                params={"p": key["prompt_id"], "s": key["sample_idx"]},
            )
            .to_arrow_table()
            .to_pylist()[0]
        )
    row.update(run_id="xss", prompt_id="xss-<b>0</b>", question=XSS_QUESTION)
    failed = next(a for p in row["positions"] for a in p["attempts"] if (a["result"] or {}).get("status") == "failure")
    ids = tok.encode(f"I will run {XSS_CODE} now.", add_special_tokens=False).ids
    failed.update(code=XSS_CODE, turn_ids=ids, logprobs=[-0.5] * len(ids), call_start=-1)
    failed["result"]["text"] = XSS_TOOL
    write_shard(
        RunLayout(root, "xss").raw_dir(0),
        pa.Table.from_pylist([row], schema=RAW),
        RAW,
        "xss",
        inputs=[str(DEFAULT_POLICY)],
    )


class Served:
    """The viewer app on 127.0.0.1 (a free port) in a thread of this process."""

    def __init__(self, root: Path) -> None:
        import uvicorn

        from flows.viewer.app import create_app
        from flows.viewer.serve import bind

        self.sock = bind("127.0.0.1", 0)
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        self.server = uvicorn.Server(
            uvicorn.Config(create_app(root, root / "catalog.duckdb"), log_level="warning", lifespan="off")
        )
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True)
        self.thread.start()

    def close(self) -> None:
        self.server.should_exit = True
        self.thread.join(10)
        self.sock.close()


def chrome():
    """Debian's headless Chromium through its own chromedriver: nothing is downloaded at run time."""
    assert CHROMIUM.is_file() and CHROMEDRIVER.is_file(), (
        "the viewer's browser tests need Debian's chromium and chromium-driver: run scripts/install_browser.sh"
    )
    os.environ["SE_OFFLINE"] = "true"  # Selenium Manager must not look for a browser or driver online
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = str(CHROMIUM)
    for arg in (
        "--headless=new",
        "--no-sandbox",
        "--disable-dev-shm-usage",
        "--disable-gpu",
        "--window-size=1500,1000",
        "--disable-extensions",
        "--no-first-run",
    ):
        options.add_argument(arg)
    return webdriver.Chrome(service=Service(str(CHROMEDRIVER)), options=options)
