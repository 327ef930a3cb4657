"""`python -m alpa_job inspect DUMP_DIR` on the Alpa dump fixtures (made from real alpa 0.2.3
PlacementSpec objects by tests/alpa_fixtures/make_dumps.py): every leaf's label, in json/md/html."""

from __future__ import annotations

import html
import json
import os

import pytest

from helpers_cli import run_cli

FIXTURES = os.path.join(os.path.dirname(os.path.abspath(__file__)), "alpa_fixtures")
NAMES = sorted(d for d in os.listdir(FIXTURES) if os.path.isfile(os.path.join(FIXTURES, d, "expected.json")))


def _expected(name):
    with open(os.path.join(FIXTURES, name, "expected.json")) as f:
        return json.load(f)["leaves"]


@pytest.mark.parametrize("name", NAMES)
def test_inspect_labels_every_leaf_in_json_md_html(name, tmp_path):
    folder = os.path.join(FIXTURES, name)
    expected = _expected(name)
    assert expected, "fixture without leaves"

    as_json = run_cli("inspect", folder, "--format", "json", timeout=120)
    assert as_json.returncode == 0, as_json.stderr
    report = json.loads(as_json.stdout)
    assert report["engine"] == "alpa"
    assert {r["path"]: r["strategy"] for r in report["params"]} == expected

    md = run_cli("inspect", folder, "--format", "md", timeout=120)
    assert md.returncode == 0
    # The parameter table's rows: path | shape | dtype | bytes | bytes/device | spec | mesh_ids | strategy
    cells = [line.replace("\\|", "").split("|") for line in md.stdout.splitlines() if line.startswith("| ")]
    md_rows = {c[1].strip(): c[8].strip() for c in cells if len(c) == 10}
    for path, label in expected.items():
        assert md_rows.get(path) == label, path

    page = tmp_path / "report.html"  # the fixture folder stays untouched
    out = run_cli("inspect", folder, "--format", "html", "--output", str(page), timeout=120)
    assert out.returncode == 0
    text = page.read_text()
    for path, label in expected.items():
        assert f"<td>{html.escape(path)}</td>" in text
    assert text.count("<td>MP+ZeRO</td>") == sum(1 for v in expected.values() if v == "MP+ZeRO")
