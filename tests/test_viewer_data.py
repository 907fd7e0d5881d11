"""`cleaner view` without a browser (issue 32 §1–§2): text in the catalog equal to the tokenizer's decode, the
token-level alignment of purified rows with their attempt trees, the SQL box's sandbox, bad input, a corrupt
shard, a busy port."""

from __future__ import annotations

import re
import shutil
import socket
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from tests.flow_helpers import ROOT, cleaner, run_cleaner
from tests.viewer_helpers import build_store

# `cleaner view` needs nothing of the tester's environment (no virtual environment on PATH, no Prefect settings).
BARE = {"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin", "TOKENIZERS_PARALLELISM": "false"}


@pytest.fixture(scope="module")
def store(purified_run, tmp_path_factory) -> Path:
    return build_store(purified_run, tmp_path_factory.mktemp("viewer-data"))


@pytest.fixture(scope="module")
def client(store):
    from flows.viewer.app import create_app

    return TestClient(create_app(store, store / "catalog.duckdb"))


def _tokenizer():
    from tokenizers import Tokenizer

    from pipeline.config import DEFAULT_POLICY

    return Tokenizer.from_file(str(DEFAULT_POLICY / "tokenizer.json"))


def test_text_views_equal_the_tokenizers_decode(store):
    """§2: a view query returns each purified response's and each raw attempt's text, equal to the run's
    tokenizer's decode of the ids, for every row of every partition."""
    from storage.catalog import Catalog

    tok = _tokenizer()
    decode = lambda ids: tok.decode(list(ids), skip_special_tokens=False)  # noqa: E731
    with Catalog(store) as cat:
        purified = cat.query(
            "SELECT p.response_ids, t.response_text FROM purified p JOIN purified_texts t USING (run_id, iteration, "
            "prompt_id, sample_idx, mode, gamma) WHERE p.run_id = 'w' AND p.measure IS NOT DISTINCT FROM t.measure"
        ).to_pylist()
        attempts = cat.query(
            "SELECT t.turn_text, t.feedback_text, a.code FROM raw_attempts a JOIN raw_attempt_texts t USING (run_id, "
            "iteration, prompt_id, sample_idx, position_idx, attempt_idx) WHERE a.run_id = 'w'"
        ).to_pylist()
        raw = cat.query(
            "SELECT r.lived_ids, t.response_text FROM raw_trajectories r JOIN raw_texts t USING "
            "(run_id, iteration, prompt_id, sample_idx) WHERE r.run_id = 'w'"
        ).to_pylist()
        n_purified = cat.query("SELECT count(*) AS n FROM purified WHERE run_id = 'w'").to_pylist()[0]["n"]
        n_attempts = cat.query("SELECT count(*) AS n FROM raw_attempts WHERE run_id = 'w'").to_pylist()[0]["n"]
        ids = cat.query(
            "SELECT a.turn_ids, a.feedback_ids FROM (SELECT UNNEST(flatten(list_transform(positions, "
            "lambda p: p.attempts))) AS a, prompt_id, sample_idx FROM raw_trajectories WHERE run_id = 'w') "
            "ORDER BY prompt_id, sample_idx, a.attempt_idx"
        ).to_pylist()
    assert len(purified) == n_purified > 64 and len(raw) == 64 and len(attempts) == n_attempts > 64
    assert all(r["response_text"] == decode(r["response_ids"]) for r in purified)
    assert all(r["response_text"] == decode(r["lived_ids"]) for r in raw)
    decoded = {(decode(r["turn_ids"]), decode(r["feedback_ids"])) for r in ids}
    assert {(r["turn_text"], r["feedback_text"]) for r in attempts} == decoded
    # the code of a call is in its turn's text, as the model wrote it (JSON-escaped)
    assert sum(bool(r["code"]) and r["code"].splitlines()[0] in r["turn_text"] for r in attempts) > 32


def test_shards_without_a_tokenizer_commit_without_text(tmp_path):
    """A shard whose recorded checkpoint has no tokenizer (a synthetic store) has no text files, and the views
    have no rows for it (never a guessed tokenizer)."""
    import pyarrow as pa

    from tests.synthetic import synthetic_trajectories
    from pipeline.trajectory import trajectory_to_row
    from storage.catalog import Catalog
    from storage.layout import RunLayout
    from storage.schemas import RAW
    from storage.shards import read_manifest, write_shard

    out = RunLayout(tmp_path, "s").raw_dir(0)
    rows = [trajectory_to_row(t) for t in synthetic_trajectories(4, run_id="s")]
    write_shard(out, pa.Table.from_pylist(rows, schema=RAW), RAW, "x", inputs=["checkpoints/iteration=0000"])
    assert "texts" not in read_manifest(out).extra and not list(out.glob("text-*"))
    with Catalog(tmp_path) as cat:
        assert cat.query("SELECT count(*) AS n FROM raw_texts").to_pylist()[0]["n"] == 0
        assert cat.query("SELECT count(*) AS n FROM raw_trajectories").to_pylist()[0]["n"] == 4


def test_alignment_covers_every_purified_row_exactly():
    """Every mode's response is rebuilt from whole segments of the attempt tree (synthetic rows, many seeds): the
    kept spans are the response, raw keeps everything, SAAR removes every failed call it spliced over."""
    from flows.viewer.align import align, segments, splice_preference
    from tests.synthetic import synthetic_trajectories
    from pipeline.trajectory import trajectory_to_row
    from purifier.saar import purify

    decode = lambda ids: " ".join(map(str, ids))  # noqa: E731
    for t in synthetic_trajectories(60, seed=7, vocab=40, positions=3):
        segs = segments(trajectory_to_row(t))
        for mode, gamma in (
            ("saar", 0.0),
            ("saar", 0.5),
            ("saar", 1.01),
            ("raw", 0.0),
            ("mask_failed", 0.0),
            ("saar_correct", 0.5),
            ("void_turn", 0.0),
        ):
            p = purify(t, gamma, mode, decode)
            spans = align(segs, p.response_ids, splice_preference([vars(s) for s in p.splices]))
            assert all(s.status != "inserted" for s in spans)
            assert [i for s in spans if s.status == "kept" for i in p.response_ids[s.start : s.end]] == p.response_ids
            if mode == "raw":
                assert all(s.status == "kept" for s in spans)
            removed = {
                (s.segment.position_idx, s.segment.attempt_idx)
                for s in spans
                if s.status == "removed" and s.segment.kind in ("call", "turn")
            }
            for sp in p.splices:  # the failed attempt before each spliced retry lost its call
                assert (sp.position_idx, sp.attempt_idx - 1) in removed


def test_alignment_ties_remove_the_failed_call_and_inserted_spans_show():
    """A retry that repeats its failed turn token for token: without splices the failed one is removed, the retry
    kept; a shallow splice keeps the failed turn's reasoning and the retry's call; text a mode adds (not in the
    tree) is an inserted span."""
    from flows.viewer.align import Segment, align, splice_preference

    seg = lambda p, a, kind, ids, failed: Segment(p, a, kind, tuple(ids), (0.0,) * len(ids), failed)  # noqa: E731
    segs = [
        seg(0, 0, "reasoning", [1, 2], True),
        seg(0, 0, "call", [7, 8], True),
        seg(0, 0, "tool", [9], True),
        seg(0, 1, "reasoning", [1, 2], False),
        seg(0, 1, "call", [7, 8], False),
        seg(0, 1, "tool", [5], False),
    ]
    spans = align(segs, [1, 2, 7, 8, 5])
    assert [(s.status, s.segment.attempt_idx, s.segment.kind) for s in spans] == [
        ("removed", 0, "reasoning"),
        ("removed", 0, "call"),
        ("removed", 0, "tool"),
        ("kept", 1, "reasoning"),
        ("kept", 1, "call"),
        ("kept", 1, "tool"),
    ]
    shallow = align(
        segs, [1, 2, 7, 8, 5], splice_preference([{"position_idx": 0, "attempt_idx": 1, "kind": "shallow"}])
    )
    assert [(s.status, s.segment.attempt_idx, s.segment.kind) for s in shallow] == [
        ("kept", 0, "reasoning"),
        ("removed", 0, "call"),
        ("removed", 0, "tool"),
        ("removed", 1, "reasoning"),
        ("kept", 1, "call"),
        ("kept", 1, "tool"),
    ]
    inserted = align(segs, [1, 2, 7, 8, 42, 42, 5])
    assert any(s.status == "inserted" and (s.start, s.end) == (4, 6) for s in inserted)


def test_sql_box_reads_the_catalog_and_nothing_outside_the_root(client, store):
    ok = client.get(
        "/sql", params={"q": "SELECT count(*) = (SELECT count(*) FROM purified) AS same FROM purified_texts"}
    )
    assert ok.status_code == 200 and "<td>True</td>" in ok.text
    outside = [
        "SELECT * FROM read_csv('/etc/passwd')",
        f"SELECT * FROM read_text('{store}/../../../../etc/passwd')",
        "SELECT * FROM glob('/etc/*')",
        f"COPY (SELECT 1) TO '{store}/runs/w/x.csv'",
        # EXPLAIN ANALYZE runs the statement it explains: COPY … TO wrote into the store through it
        f"EXPLAIN ANALYZE COPY (SELECT 1) TO '{store}/runs/w/x.csv'",
        f"EXPLAIN COPY (SELECT 1) TO '{store}/runs/w/x.csv'",
        "ATTACH '/tmp/other.duckdb' AS o",
        "SET enable_external_access = true",
        "INSTALL httpfs",
    ]
    for q in outside:
        r = client.get("/sql", params={"q": q})
        assert r.status_code == 400 and 'id="sql-error"' in r.text, q
        assert "root:x:0" not in r.text and "Permission Error" in r.text or "only SELECT" in r.text, (q, r.text[-800:])
    assert not (store / "runs" / "w" / "x.csv").exists()
    escaped = client.get("/sql", params={"q": "SELECT '<script>alert(1)</script>' AS x"})
    assert "<script>alert(1)" not in escaped.text and "&lt;script&gt;alert(1)&lt;/script&gt;" in escaped.text


def test_a_request_another_site_makes_through_the_browser_is_refused(client):
    """A page elsewhere could make the researcher's browser request the SQL box (an <img src=…/sql?q=…>): a GET
    with no origin check. Fetches a browser marks cross-site are refused, but for a navigation."""
    r = client.get(
        "/sql", params={"q": "SELECT 1"}, headers={"Sec-Fetch-Site": "cross-site", "Sec-Fetch-Mode": "no-cors"}
    )
    assert r.status_code == 403 and "another site" in r.text
    # a link followed from elsewhere (the report opened as a file, a notebook on localhost) is a navigation
    followed = {"Sec-Fetch-Site": "cross-site", "Sec-Fetch-Mode": "navigate"}
    assert client.get("/runs/w/report/", headers=followed).status_code == 200
    assert client.get("/sql", params={"q": "SELECT 1"}, headers={"Sec-Fetch-Site": "same-origin"}).status_code == 200
    assert client.get("/", headers={"Sec-Fetch-Site": "none"}).status_code == 200  # typed in the address bar


@pytest.mark.parametrize(
    "path, names",
    [
        ("/runs/nope", "unknown run 'nope'"),
        ("/runs/w/99", "unknown iteration 99 of run 'w'"),
        ("/runs/w/zero", "unknown iteration 'zero'"),
        ("/runs/w/0/trajectory?prompt=none&sample=0", "no prompt 'none' sample 0"),
        ("/runs/w/0/trajectory?prompt=none&sample=x", "unknown sample 'x'"),
        ("/runs/nope/0/trajectory?prompt=a&sample=0", "unknown run 'nope'"),
        ("/runs/w/report/..%2F..%2Fcatalog.png", "no page at /runs/w/report/../../catalog.png"),
        ("/runs/w/report/catalog.duckdb", "no report file 'catalog.duckdb'"),
        ("/nowhere", "no page at /nowhere"),
    ],
)
def test_unknown_keys_are_a_404_page_that_links_back(client, path, names):
    r = client.get(path)
    assert r.status_code == 404, r.text[-1500:]
    text = r.text.replace("&#39;", "'")
    assert names in text and 'id="back" href="/' in text


def test_the_report_files_address_leads_to_the_report_page(client):
    r = client.get("/runs/w/report/index.html", follow_redirects=False)
    assert r.status_code in (302, 307) and r.headers["location"] == "/runs/w/report/", r.status_code


@pytest.mark.parametrize(
    "query, names",
    [
        ("kind=bogus", "unknown kind 'bogus': one of clean, recovered"),
        ("spliced=maybe", "unknown spliced 'maybe': one of yes, no"),
        ("advantage=up", "unknown advantage 'up': one of positive, negative, zero"),
        ("partition=bogus", "unknown partition 'bogus': one of "),
        ("reward_min=abc", "reward_min 'abc' is not a number"),
        ("reward_max=nan", "reward_max 'nan' is not a number"),
    ],
)
def test_a_filter_value_the_table_does_not_know_is_a_400_that_says_which(client, query, names):
    """Ignored before: the page showed every row while saying it filtered them (or 0 rows, for an unknown kind)."""
    r = client.get(f"/runs/w/0?{query}")
    assert r.status_code == 400, r.text[-1500:]
    assert names in r.text.replace("&#39;", "'") and 'id="back" href="/runs/w/0"' in r.text
    assert client.get("/runs/w/0?kind=recovered&spliced=yes&reward_min=-1&advantage=negative").status_code == 200


def test_splices_with_no_partition_chosen_are_the_most_any_partition_made(client, store):
    """Not their sum over the partitions (a trajectory spliced once under three γ showed 3)."""
    import re

    from storage.catalog import Catalog

    with Catalog(store) as cat:
        want = {
            (r["prompt_id"], r["sample_idx"]): r["n"]
            for r in cat.query(
                "SELECT prompt_id, sample_idx, max(splices) AS n FROM purified_summary "
                "WHERE run_id = 'w' AND iteration = 0 GROUP BY ALL"
            ).to_pylist()
        }
        partitions = cat.query(
            "SELECT count(DISTINCT (mode, gamma, measure)) AS n FROM purified_summary WHERE "
            "run_id = 'w' AND iteration = 0"
        ).to_pylist()[0]["n"]
    assert partitions > 1 and any(want.values())
    page = client.get("/runs/w/0").text
    shown = {
        (p, int(s)): int(n)
        for p, s, n in re.findall(
            r'<tr class="traj"><td><a class="open" href="[^"]*">([^<]+)</a></td><td class="num">(\d+)</td>.*?'
            r'<td class="num">(\d+)</td><td class="num">[^<]*</td></tr>',
            page,
            flags=re.S,
        )
    }
    assert shown and all(shown[k] == want.get(k, 0) for k in shown), (shown, want)
    assert "Splices: the most any partition made" in page


def test_a_corrupt_shard_is_a_banner_and_every_page_still_works(store, tmp_path):
    from flows.viewer.app import create_app
    from storage.catalog import publish

    root = tmp_path / "copy"
    shutil.copytree(store / "runs", root / "runs")
    part = root / "runs/w/iteration=0000/purified/mode=saar/gamma=0.50/part-00000.parquet"
    data = bytearray(part.read_bytes())
    data[len(data) // 2] ^= 0xFF  # a flipped byte: the size is right, the checksum is not
    part.write_bytes(bytes(data))
    publish(root, root / "catalog.duckdb")  # what the next commit (or `cleaner inspect`) does
    client = TestClient(create_app(root, root / "catalog.duckdb"))
    index = client.get("/")
    assert index.status_code == 200 and str(part.parent) in index.text and "checksum mismatch" in index.text
    table = client.get("/runs/w/0")
    assert table.status_code == 200 and str(part.parent) in table.text and 'class="traj"' in table.text
    link = re.search(r'href="(/runs/w/0/trajectory[^"]+)"', table.text).group(1).replace("&amp;", "&")
    page = client.get(link)
    assert page.status_code == 200 and str(part.parent) in page.text
    assert "<b>raw</b>" in page.text and "saar γ=0.5" not in page.text  # the good partition shown, the bad named
    for path in ("/runs/w", "/runs/w/report/", "/sql?q=SELECT+1"):
        assert client.get(path).status_code == 200, path


def test_port_in_use_is_one_line(store):
    busy = socket.socket()
    busy.bind(("127.0.0.1", 0))
    busy.listen(1)
    port = busy.getsockname()[1]
    try:
        out = run_cleaner(["view", "--port", str(port), f"storage.root={store}"], store, env=BARE, timeout=60)
    finally:
        busy.close()
    assert out.returncode != 0 and out.stdout == ""
    assert out.stderr.strip().splitlines() == [
        f"cleaner view: port {port} on 127.0.0.1 is in use (another `cleaner "
        "view`, or another server); choose another with --port"
    ]


@pytest.mark.parametrize("port", ["99999", "-5", "http"])
def test_a_port_out_of_range_is_one_line(store, port):
    out = run_cleaner(["view", "--port", port, f"storage.root={store}"], store, env=BARE, timeout=60)
    assert out.returncode == 2 and out.stdout == "" and "Traceback" not in out.stderr, out.stderr
    assert f"argument --port: {port!r} is not a port (0-65535" in out.stderr, out.stderr


def test_cleaner_view_prints_its_url_serves_and_warns_off_loopback(store):
    from flows.viewer.serve import is_loopback

    assert is_loopback("127.0.0.1") and is_loopback("localhost") and is_loopback("::1")
    assert not is_loopback("0.0.0.0") and not is_loopback("192.168.1.2")
    p = cleaner(["view", "--port", "0", f"storage.root={store}"], store, env=BARE)
    try:
        url = next((m.group(0) for line in p.stdout if (m := re.search(r"http://127\.0\.0\.1:\d+/", line))), None)
        assert url, f"exited {p.wait(20)} without printing its URL"
        import urllib.error
        import urllib.request

        # it listens before it prints its URL: the first request is queued until uvicorn answers it
        with urllib.request.urlopen(url + "runs/w", timeout=60) as r:
            assert r.status == 200 and "iteration" in r.read().decode()
        # a page of another site resolving its name to this machine (DNS rebinding) is refused
        req = urllib.request.Request(url, headers={"Host": "evil.example:80"})
        with pytest.raises(urllib.error.HTTPError) as refused:
            urllib.request.urlopen(req, timeout=10)
        assert refused.value.code == 400
    finally:
        p.terminate()
        p.wait(20)


def test_the_viewer_follows_a_flow_that_writes(store, tmp_path):
    """A shard being written is left out (and said so); once committed and the catalog published, the open
    viewer shows it without a restart."""
    import pyarrow.compute as pc

    from flows.viewer.app import create_app
    from pipeline.config import DEFAULT_POLICY
    from storage.catalog import publish
    from storage.layout import RunLayout
    from storage.schemas import RAW
    from storage.shards import read_shard, write_shard

    root = tmp_path / "live"
    shutil.copytree(store / "runs", root / "runs")
    publish(root, root / "catalog.duckdb")
    client = TestClient(create_app(root, root / "catalog.duckdb"))
    layout = RunLayout(root, "w")
    assert client.get("/runs/w").status_code == 200 and client.get("/runs/w/1").status_code == 404
    writing = layout.raw_dir(1)
    writing.mkdir(parents=True)
    shutil.copy(layout.raw_dir(0) / "part-00000.parquet", writing / "part-00000.parquet")  # no manifest yet
    publish(root, root / "catalog.duckdb")
    busy = client.get("/runs/w/1")
    assert busy.status_code == 404 and "holds no committed raw shard yet" in busy.text
    assert "not committed yet" in client.get("/").text and client.get("/runs/w/0").status_code == 200
    (writing / "part-00000.parquet").unlink()
    table = read_shard(layout.raw_dir(0), RAW)
    table = table.set_column(
        table.schema.get_field_index("iteration"), "iteration", pc.cast(pc.add(table["iteration"], 1), "int32")
    )
    write_shard(writing, table, RAW, "next", inputs=[str(DEFAULT_POLICY)])
    publish(root, root / "catalog.duckdb")  # what the stage's commit does
    assert re.search(r'href="/runs/w/1"', client.get("/runs/w").text)
    page = client.get("/runs/w/1")
    assert page.status_code == 200 and page.text.count('class="traj"') == 64
    link = re.search(r'href="(/runs/w/1/trajectory[^"]+)"', page.text).group(1).replace("&amp;", "&")
    assert client.get(link).status_code == 200


def test_the_viewer_of_a_copied_store_reads_the_copy(store, tmp_path, monkeypatch):
    """`cleaner view` on a copied store: its catalog names the original's files, so the index and run pages were
    503s ("Cannot access file …/ws/…") while the iteration pages worked. The command publishes the copy's."""
    import flows.viewer.serve
    from flows.cli import main

    copy = tmp_path / "copy"
    shutil.copytree(store, copy)
    monkeypatch.setattr(flows.viewer.serve, "serve", lambda *a, **kw: 0)  # the server itself is not the point
    assert main(["view", f"storage.root={copy}"]) == 0
    from flows.viewer.app import create_app

    client = TestClient(create_app(copy, copy / "catalog.duckdb"))
    assert client.get("/").status_code == 200 and client.get("/runs/w").status_code == 200


def test_the_viewer_of_a_root_that_is_not_there_publishes_nothing(tmp_path, monkeypatch, capsys):
    """Publishing first printed a catalog error ("not refreshed … .tmp") before the root's own refusal."""
    import flows.viewer.serve
    from flows.cli import main

    monkeypatch.setattr(flows.viewer.serve, "serve", lambda *a, **kw: 0)
    assert main(["view", f"storage.root={tmp_path / 'typo'}"]) == 0
    assert "not refreshed" not in capsys.readouterr().err and not (tmp_path / "typo").exists()


def test_a_store_nothing_published_shows_runs_committed_since(store, tmp_path, monkeypatch):
    """The in-memory catalog of an unpublished root was built once: a run committed later showed 0 iterations."""
    import flows.viewer.store as viewer_store
    from flows.viewer.store import Store

    monkeypatch.setattr(viewer_store, "FALLBACK_TTL_S", 0.0)
    root = tmp_path / "root"
    root.mkdir()
    s = Store(root, root / "catalog.duckdb")
    assert s.runs() == []
    shutil.copytree(store / "runs" / "w", root / "runs" / "w")
    assert [(r["run_id"], r["iterations"]) for r in s.runs()] == [("w", 1)]


def test_a_filter_on_a_label_no_row_has_says_so(client):
    """`?label=Bogus` showed "any" in the label menu over an empty table: the filter looked off."""
    r = client.get("/runs/w/0", params={"label": "Bogus"})
    assert r.status_code == 200 and 'value="Bogus" selected>Bogus (none in this iteration)</option>' in r.text
    assert "recovered calls" in client.get("/runs/w").text
