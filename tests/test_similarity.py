"""The shallow/deep measures (issue 14 §1.6 and §2): exact γ, difflib exactly, code-only target,
and measures side by side in the shard layout."""

from __future__ import annotations

import difflib

import pytest
from rapidfuzz import fuzz

from pipeline.similarity import DEFAULT_MEASURE, REFERENCE_MEASURE, Measure
from pipeline.splice import decide, piece_from_attempt
from pipeline.modes import partition_measure
from storage.layout import RunLayout
from tests.doubles import call

GAMMAS = (0.1, 0.2, 0.3, 0.45, 0.5, 0.7, 0.9)
MEASURES = [Measure(s, on) for s in ("rapidfuzz", "difflib") for on in ("segment", "code")]


def pair_at(gamma: float, prefix: str = "", n: int = 100) -> tuple[str, str]:
    """Two strings of length n whose similarity is exactly γ under both measures, built from integers
    (k shared characters, the rest disjoint): never from a measure's own output. n < 200 keeps
    difflib's autojunk out of the construction."""
    k = round(gamma * n) - len(prefix)
    assert 0 <= k <= n - len(prefix)
    rest = n - len(prefix) - k
    return prefix + "x" * k + "y" * rest, prefix + "x" * k + "z" * rest


@pytest.mark.parametrize("gamma", GAMMAS)
@pytest.mark.parametrize("name", ["rapidfuzz", "difflib"])
def test_similarity_equal_to_gamma_is_shallow(name, gamma):
    m = Measure(name, "segment")
    a, b = pair_at(gamma)
    assert m.ratio(a, b).at_least(gamma)  # ≥ γ: shallow, as the reference's `similarity < 0.5 → deep`
    assert not m.ratio(a, b).at_least(round(gamma + 0.01, 2))


def test_float_ratio_is_an_ulp_off_where_exact_comparison_is_not():
    # why the comparison is on integers: rapidfuzz's own float puts these pairs below γ
    below = [g for g in GAMMAS if fuzz.ratio(*pair_at(g)) / 100 < g]
    assert below  # 0.1, 0.2, 0.45 on this rapidfuzz build: the bug the exact comparison fixes
    assert all(DEFAULT_MEASURE.ratio(*pair_at(g)).at_least(g) for g in below)


@pytest.mark.parametrize("gamma", [0.2, 0.45])
def test_exact_gamma_through_the_splice_on_token_ids(chat, gamma):
    # whole call segments on the real tokenizer: marker + payload, similarity exactly γ
    seg_a, seg_b = pair_at(gamma, prefix="<tool_call>")
    pieces = []
    for i, seg in enumerate((seg_a, seg_b)):
        ids = chat.encode("Reasoning.\n" + seg)
        assert chat.decode(ids[chat.call_start(ids) :]) == seg
        pieces.append(piece_from_attempt(i, ids, [0.0] * len(ids), chat.call_start(ids)))
    for m in (DEFAULT_MEASURE, REFERENCE_MEASURE):
        assert decide(pieces[0], pieces[1], gamma, chat.decode, m).kind == "shallow"
        assert decide(pieces[0], pieces[1], round(gamma + 0.01, 2), chat.decode, m).kind == "deep"


def test_difflib_is_the_reference_ratio_with_autojunk():
    # a real-length pair (≥ 200 characters) where difflib's autojunk heuristic moves the ratio
    a = call("total = 0\nfor i in range(100):\n    total += i * i\nprint(total)  # sum of squares below one hundred")
    b = call("s = sum(i * i for i in range(100))\nprint(s)  # the same sum of squares, written in a single line")
    a, b = a * 2, b * 2
    ref = difflib.SequenceMatcher(None, a, b).ratio()
    assert REFERENCE_MEASURE(a, b) == ref
    assert ref != difflib.SequenceMatcher(None, a, b, autojunk=False).ratio()
    assert DEFAULT_MEASURE(a, b) != ref


def test_code_target_compares_only_the_code():
    a, b = (
        call("prnt(6 * 7)").split("\n", 1)[1],
        call("import math\nresult = math.prod([6, 7])\nprint(result)").split("\n", 1)[1],
    )
    seg, code = Measure("rapidfuzz", "segment")(a, b), Measure("rapidfuzz", "code")(a, b)
    assert code == fuzz.ratio("prnt(6 * 7)", "import math\nresult = math.prod([6, 7])\nprint(result)") / 100
    assert code < 0.5 < seg  # the JSON wrapper dominates short code in the segment
    # a call that does not parse: the code target falls back to the whole segment
    broken = "<tool_call>\nnot json\n</tool_call>"
    assert Measure("rapidfuzz", "code")(a, broken) == Measure("rapidfuzz", "segment")(a, broken)


def test_measures_get_their_own_partitions(tmp_path):
    layout = RunLayout(tmp_path, "r")
    dirs = {layout.purified_dir(0, "saar", 0.5, partition_measure("saar", m)) for m in MEASURES}
    assert len(dirs) == 4
    # the default measure keeps the partition it always had; modes without splices ignore the measure
    assert layout.purified_dir(0, "saar", 0.5, partition_measure("saar", DEFAULT_MEASURE)).name == "gamma=0.50"
    assert (
        layout.purified_dir(0, "saar", 0.5, partition_measure("saar", REFERENCE_MEASURE)).name
        == "gamma=0.50-difflib-segment"
    )
    assert partition_measure("raw", REFERENCE_MEASURE) == ""


def test_default_measure_is_the_one_whose_partitions_have_no_suffix():
    from pipeline.similarity import DEFAULT_MEASURE
    from storage.layout import DEFAULT_MEASURE_KEY

    assert DEFAULT_MEASURE.key == DEFAULT_MEASURE_KEY  # storage cannot import pipeline: the two must agree
