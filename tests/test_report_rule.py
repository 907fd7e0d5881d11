"""`cleaner report` states the token-level hypothesis per purification mode of the
run with its numbers, the coarse rule only as disproved, tables that fit a 1000-px page, links to `cleaner
view`'s pages that work when the viewer serves the report, and every text escaped.

Hand-stated rows check the wording and arithmetic; a real tiny-policy rollout purified in every mode checks the
page against the catalog; headless Chromium (Debian's, through Selenium, as tests/test_viewer.py) checks the
layout at 1000 px, as a file and inside the viewer, and follows the links."""

from __future__ import annotations

import re
from html import unescape
from urllib.parse import parse_qs, urlsplit

import pytest

from flows.premise import token_rule_by_mode
from flows.report_tables import STYLE, rule_section, table
from tests.flow_helpers import rollout_copy

GAMMA = 0.5
WIDTH = 1000


def _row(iteration, mode, neg, pos, gamma=0.0, measure=None):
    return {
        "iteration": iteration,
        "mode": mode,
        "gamma": gamma,
        "measure": measure,
        "failed_call_tokens": 200,
        "trained": neg + pos,
        "on_negative": neg,
        "on_positive": pos,
        "share_negative": neg / 200,
        "share_positive": pos / 200,
    }


# Two iterations. raw trains 50+30 negative and 10+10 positive failed-call tokens; saar keeps 10+10 negative and
# none positive (stops 60 / 20: slower predicted); saar_correct keeps every negative one (stops 0 / 20: not
# slower); mask_failed at iteration 1 only, where raw has no partition (no prediction there); roc is no removal.
FAILED = [
    _row(0, "raw", 50, 10),
    _row(0, "saar", 10, 0, GAMMA, "rapidfuzz-segment"),
    _row(0, "saar_correct", 50, 0, GAMMA, "rapidfuzz-segment"),
    _row(0, "roc", 5, 5),
    _row(1, "raw", 30, 10),
    _row(1, "saar", 10, 0, GAMMA, "rapidfuzz-segment"),
    _row(1, "saar_correct", 30, 0, GAMMA, "rapidfuzz-segment"),
    _row(2, "mask_failed", 3, 0),
]
KINDS = [
    {"iteration": 0, "kind": "recovered", "trajectories": 5, "mean_reward": 0.2, "correct": 0.6, "mean_advantage": 0.4}
]
EVIL = '<script>alert(1)</script>"&'
EXAMPLES = [
    {
        "iteration": 1,
        "mode": "saar",
        "gamma": GAMMA,
        "measure": "rapidfuzz-segment",
        "prompt_id": EVIL,
        "sample_idx": 2,
        "advantage": -0.7,
    }
]


def _text(fragment: str) -> str:
    """What a reader sees: tags dropped, entities decoded, whitespace collapsed."""
    return " ".join(unescape(re.sub(r"<[^>]+>", "", fragment)).split())


def _items(page: str) -> dict[str, str]:
    """The token-level rule's sentence per mode (li.mode-rule), as text."""
    return {m: _text(li) for m, li in re.findall(r'<li class="mode-rule" data-mode="([^"]+)">(.*?)</li>', page, re.S)}


def test_token_rule_by_mode_sums_each_partition_over_the_iterations_that_have_raw():
    by = {m["mode"]: m for m in token_rule_by_mode(FAILED)}
    assert set(by) == {"saar", "saar_correct"}  # roc is not a removal; mask_failed has no raw beside it
    assert by["saar"]["iterations"] == [0, 1]
    assert (by["saar"]["raw_negative"], by["saar"]["raw_positive"]) == (80, 20)
    assert (by["saar"]["removed_negative"], by["saar"]["removed_positive"], by["saar"]["slower"]) == (60, 20, True)
    assert (by["saar_correct"]["removed_negative"], by["saar_correct"]["removed_positive"]) == (0, 20)
    assert by["saar_correct"]["verdict"] == "not predicted to be slower than raw"


def test_a_mode_that_removes_only_zero_advantage_failed_calls_is_not_said_to_train_the_same_tokens():
    """Failed-call tokens under advantage 0 (a group whose rewards are all equal) count in `trained` but under
    neither sign: a mode that stops training them trains other tokens than raw, with no difference predicted."""
    from flows.premise import token_predictions

    raw, saar = dict(_row(0, "raw", 0, 0), trained=40), dict(_row(0, "saar", 0, 0, GAMMA, "rapidfuzz-segment"))
    [line] = token_predictions([raw, saar], 0)
    assert "no difference predicted" in line and "same" not in line, line
    assert "40 failed-call tokens under advantage 0" in line, line


def test_the_section_states_the_token_rule_per_mode_with_its_numbers():
    html = rule_section("r", KINDS, FAILED, EXAMPLES)
    items = _items(html)
    assert items["saar"].startswith(
        "saar γ=0.5: over iterations 0–1 (2), raw trains 80 failed-call tokens under negative advantage and 20 "
        "under positive; saar γ=0.5 stops training 60 negative- and 20 positive-advantage ones. Token-level rule: "
        "slower first-call error reduction than raw predicted."
    )
    assert items["saar_correct"].startswith(
        "saar_correct γ=0.5: over iterations 0–1 (2), raw trains 80 failed-call tokens under negative advantage and "
        "20 under positive; saar_correct γ=0.5 stops training 0 negative- and 20 positive-advantage ones. "
        "Token-level rule: not predicted to be slower than raw."
    )
    assert "roc: drops whole rows" in _text(html)
    rule = _text(re.search(r'<p class="rule">(.*?)</p>', html, re.S).group(1))
    assert rule.startswith("Token-level rule, a hypothesis the pre-registered experiment did not bear out")
    assert "[−0.068, +0.016], n = 8 seeds" in rule and "four correlated signs" in rule and "point 2" in rule
    assert "when_purification_helps_writeup.md" in rule and "should_i_turn_saar_on_writeup.md" in rule
    answer = _text(re.search(r'<p class="answer" id="should-i">(.*?)</p>', html, re.S).group(1))
    assert answer.startswith("Should I turn SAAR on?") and "not distinguishable from raw on any metric" in answer


def test_the_coarse_rule_is_only_stated_as_disproved():
    html = rule_section("r", KINDS, FAILED, EXAMPLES)  # recovered mean advantage +0.4: the coarse rule says help
    text = _text(html)
    assert "predicted to help" not in text and "predicted to hurt" not in text
    coarse = _text(re.search(r'<p class="disproved" id="coarse-rule">(.*?)</p>', html, re.S).group(1))
    assert coarse.startswith("Coarse rule, disproved (it did not predict in the project's own experiment")
    assert "when_purification_helps_writeup.md point 5" in coarse and "it is not a prediction" in coarse
    assert 'href="file://' in html or "<code>docs/results/when_purification_helps_writeup.md</code>" in html
    assert text.count("mean advantage is positive") == 1  # nowhere but in the paragraph that says disproved


def test_without_a_raw_partition_the_page_says_how_to_add_one():
    html = rule_section("my run", KINDS, [r for r in FAILED if r["mode"] != "raw"], [])
    assert "No prediction: the run has no raw partition" in _text(html)
    assert "cleaner replay --run 'my run' --iteration 0 --mode raw mask_failed roc saar saar_correct" in _text(html)
    assert 'id="token-rule"' in html and "mode-rule" not in html


def test_every_text_is_escaped_and_links_are_relative_to_the_viewers_report_route():
    html = rule_section("r", KINDS, FAILED, EXAMPLES)
    assert "<script>" not in html and "&lt;script&gt;alert(1)&lt;/script&gt;&quot;&amp;" in html
    hrefs = re.findall(r'href="([^"]*)"', html)
    trajectory = [h for h in hrefs if "/trajectory?" in h]
    assert trajectory == ["../1/trajectory?prompt=%3Cscript%3Ealert%281%29%3C%2Fscript%3E%22%26&amp;sample=2"]
    query = parse_qs(urlsplit(unescape(trajectory[0])).query)
    assert query == {"prompt": [EVIL], "sample": ["2"]}
    assert "../0?partition=saar%3A0.5%3Arapidfuzz-segment&amp;kind=recovered" in hrefs
    assert "../0?kind=recovered" in hrefs  # the kinds table links each kind to its trajectories
    cells = table([{"run_id": "x", "iteration": 0, "partition": "<b>saar</b>", "tokens_removed": 909}])
    assert cells.startswith('<div class="scroll"><table>') and "run_id" not in cells
    assert '<td class="text">&lt;b&gt;saar&lt;/b&gt;</td>' in cells and '<td class="num">909</td>' in cells
    assert "<th>tokens_<wbr>removed</th>" in cells  # long headers wrap after their underscores


def test_the_style_fits_tables_to_the_page():
    rules = {k.strip(): v for k, v in re.findall(r"([^{}]+)\{([^}]*)\}", STYLE)}
    assert "overflow-x:auto" in rules[".scroll"] and "max-width:100%" in rules[".scroll"]
    assert "white-space:nowrap" in rules["td.num"] and "overflow-wrap:break-word" in rules["td.text"]
    assert "position:sticky" in rules[".scroll tr>:first-child"]  # the key column stays when a table scrolls
    assert "white-space:pre-wrap" in rules["pre"] and "max-width:100%" in rules["img"]
    assert "display:none" in rules[".report #viewer-note"]  # inside the viewer, no "how to open the viewer"


# ---- a real run, purified in every mode ---------------------------------------------------------------------
@pytest.fixture(scope="module")
def store(world_rollout, tmp_path_factory):
    from flows.report import write_report
    from pipeline.modes import MODES
    from purifier.stage import run_purify_stage
    from pipeline.variants import plan_variants
    from storage.catalog import publish

    cfg = rollout_copy(world_rollout, tmp_path_factory, "report-rule")
    root = cfg.storage.root
    run_purify_stage(cfg, "w", 0, plan_variants(cfg, list(MODES), [GAMMA]))
    page = write_report(root, "w").read_text()
    publish(root, root / "catalog.duckdb")
    return root, page


def test_the_page_states_the_rule_for_every_mode_in_the_run(store):
    from storage.catalog import Catalog

    root, page = store
    with Catalog(root) as cat:
        rows = cat.query(
            "SELECT m.mode, m.gamma, r.on_negative AS raw_neg, r.on_positive AS raw_pos, "
            "r.on_negative - m.on_negative AS neg, r.on_positive - m.on_positive AS pos "
            "FROM failed_call_advantage m JOIN failed_call_advantage r ON r.mode = 'raw' "
            "AND r.run_id = m.run_id AND r.iteration = m.iteration "
            "WHERE m.run_id = 'w' AND m.mode NOT IN ('raw', 'roc')"
        ).to_pylist()
    items = _items(page)
    assert set(items) == {r["mode"] for r in rows} >= {"saar", "saar_correct", "mask_failed", "saar_is"}
    for r in rows:
        name = {"saar": "saar γ=0.5", "saar_correct": "saar_correct γ=0.5", "saar_is": "saar_is τ=0.5"}.get(
            r["mode"], r["mode"]
        )
        assert items[r["mode"]].startswith(
            f"{name}: over iteration 0, raw trains {r['raw_neg']} failed-call tokens under negative advantage and "
            f"{r['raw_pos']} under positive; {name} stops training {r['neg']} negative- and {r['pos']} "
            "positive-advantage ones. Token-level rule: "
        ), items[r["mode"]]
        slower = "slower first-call error reduction than raw predicted" in items[r["mode"]]
        assert slower == (r["neg"] > r["pos"])
    text = _text(page)
    assert "predicted to help" not in text and "predicted to hurt" not in text
    assert page.index('id="rule"') < page.index("<h2>Per iteration</h2>")  # the rule comes first
    assert re.search(r'<p class="note" id="viewer-note">.*cleaner view storage\.root=', page, re.S)


def test_the_pages_links_point_at_the_viewers_pages(store):
    from storage.catalog import Catalog

    root, page = store
    hrefs = [unescape(h) for h in re.findall(r'href="([^"]*)"', page)]
    relative = [h for h in hrefs if not h.startswith(("http://127.0.0.1:", "file://"))]
    assert relative and all(h.startswith("../") for h in relative)
    assert "../../w" in relative and "../0" in relative and "../0?spliced=yes" in relative
    trajectories = [parse_qs(urlsplit(h).query) for h in relative if "/trajectory?" in h]
    assert trajectories
    with Catalog(root) as cat:
        keys = {
            (r["prompt_id"], r["sample_idx"])
            for r in cat.query("SELECT prompt_id, sample_idx FROM raw_trajectories WHERE run_id = 'w'").to_pylist()
        }
    assert all((q["prompt"][0], int(q["sample"][0])) in keys for q in trajectories)


# ---- in the browser, 1000 px wide ----------------------------------------------------------------------------
@pytest.fixture(scope="module")
def browser():
    from tests.viewer_helpers import chrome

    driver = chrome()
    driver.execute_cdp_cmd(
        "Emulation.setDeviceMetricsOverride", {"width": WIDTH, "height": 900, "deviceScaleFactor": 1, "mobile": False}
    )
    yield driver
    driver.quit()


@pytest.fixture(scope="module")
def served(store):
    from tests.viewer_helpers import Served

    server = Served(store[0])
    yield server
    server.close()


FIT = """const page = document.documentElement;
return {page: page.scrollWidth, view: page.clientWidth, tables: [...document.querySelectorAll('table')].map(
  t => ({id: t.id, need: t.scrollWidth, box: t.closest('.scroll') ? t.closest('.scroll').clientWidth : -1,
         right: t.getBoundingClientRect().right}))}"""


def _fits(browser) -> None:
    got = browser.execute_script(FIT)
    assert got["page"] <= got["view"] <= WIDTH, got  # the page never scrolls sideways
    assert len(got["tables"]) >= 5, got
    for t in got["tables"]:
        assert t["box"] > 0 and t["need"] <= t["box"] + 1 and t["right"] <= got["view"], (
            t
        )  # no table scrolls at 1000 px


def test_the_report_fits_1000_px_as_a_file_and_says_how_to_open_the_viewer(store, browser):
    from selenium.webdriver.common.by import By

    root, _ = store
    browser.get((root / "runs" / "w" / "report" / "index.html").as_uri())
    _fits(browser)
    note = browser.find_element(By.ID, "viewer-note")
    assert note.is_displayed() and "cleaner view storage.root=" in note.text
    assert "http://127.0.0.1:8765/runs/w/report/" in note.text


def test_inside_the_viewer_the_report_fits_and_its_links_open_the_viewers_pages(served, browser):
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support import expected_conditions as EC
    from selenium.webdriver.support.ui import Select, WebDriverWait

    def go(element) -> None:
        old = browser.find_element(By.TAG_NAME, "html")
        element.click()
        WebDriverWait(browser, 30).until(EC.staleness_of(old))

    browser.get(served.url + "/runs/w/report/")
    _fits(browser)
    assert not browser.find_element(By.ID, "viewer-note").is_displayed()  # already in the viewer
    go(browser.find_element(By.CSS_SELECTOR, '#token-rule li[data-mode="saar"] a[href*="/trajectory?"]'))
    assert urlsplit(browser.current_url).path == "/runs/w/0/trajectory" and browser.find_element(By.ID, "purified")
    browser.get(served.url + "/runs/w/report/")
    go(browser.find_element(By.CSS_SELECTOR, "#token-rule-iterations a"))
    assert urlsplit(browser.current_url).path == "/runs/w/0"
    assert Select(browser.find_element(By.NAME, "partition")).first_selected_option.text.startswith("mask_failed")
    browser.get(served.url + "/runs/w/report/")
    go(browser.find_element(By.LINK_TEXT, "the run's iterations"))
    assert urlsplit(browser.current_url).path == "/runs/w"


def test_the_plots_mark_the_runs_own_thresholds_not_the_commands(tmp_path):
    """`cleaner report` drew γ = 0.5 (the command's config) as 'the trained γ' of a run trained at γ 1.01, and τ = 0.5
    whatever τ the run trained saar_is at: the marks come from the run's frozen config (run.json)."""
    from flows.report import run_thresholds
    from flows.run_config import freeze_run_config
    from pipeline.config import load_config
    from storage.layout import RunLayout

    for run, overrides, want in (
        ("g", ["train.gamma=1.01", "purify.gammas=[1.01]"], (1.01, 0.5)),
        ("t", ["train.mode=saar_is", "train.tau=0.3", "purify.gammas=[0.7]"], (0.7, 0.3)),
    ):
        freeze_run_config(load_config(None, [f"storage.root={tmp_path}", *overrides]), run)
        assert run_thresholds(RunLayout(tmp_path, run).run_json) == want
    assert run_thresholds(tmp_path / "none.json") == (0.5, 0.5)
