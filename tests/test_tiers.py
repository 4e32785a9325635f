"""The README's table of tiers and docs/tests.md say exactly what each tier runs: both are what
tests/tiers.py generates from the markers now (a test added, moved between tiers or removed
without `python tests/tiers.py --write` fails here), and the generator reads a tier as pytest's
``-m`` does."""

import os
import subprocess
import sys

import tiers


def test_the_readme_and_docs_tests_md_are_what_the_markers_select():
    done = subprocess.run([sys.executable, os.path.join(tiers.ROOT, "tests", "tiers.py")],
                          capture_output=True, text=True, timeout=600, cwd=tiers.ROOT)
    assert done.returncode == 0, done.stderr[-2000:]
    table, doc = done.stdout.split("\n# The tests, tier by tier\n", 1)
    readme = open(tiers.README).read()
    assert tiers.with_table(readme, table) == readme, "stale: python tests/tiers.py --write"
    assert "# The tests, tier by tier\n" + doc == open(tiers.DOC).read() + "\n", \
        "stale: python tests/tiers.py --write"


def test_a_tier_is_read_as_pytest_reads_it():
    expressions = tiers.marker_expressions()
    fast, ci = expressions["test-fast"], expressions["test"]
    assert tiers.selected(fast, set()) and tiers.selected(ci, set())
    for marker in ("slow", "oracle", "iree", "nvimgcodec", "all"):  # each leaves test-fast
        assert not tiers.selected(fast, {marker}), marker
    assert tiers.selected(ci, {"slow", "oracle", "iree", "nvimgcodec"})
    assert not tiers.selected(ci, {"slow", "all"}) and tiers.selected(None, {"all"})
