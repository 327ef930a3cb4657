"""`inspect` on a 10,000-leaf report (a mixture-of-experts GPT, built by bench/inspect_scale.py from the real
record types): every format renders it; the terminal stays bounded (leaves grouped across layers/experts, at
most TABLE_ROWS rows, a line saying how many more and where to see them); JSON, Markdown, HTML and
`--all-rows` keep every leaf. Timing is the bench's job, not asserted here."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from alpa_job.inspect import render
from alpa_job.record.report_file import report_json
from alpa_job.record.run_record import RunRecord

import inspect_scale  # bench/, on pytest's pythonpath

REPO = Path(__file__).resolve().parent.parent

LEAVES = 10_000


@pytest.fixture(scope="module")
def big() -> RunRecord:
    return inspect_scale.build_record(leaves=LEAVES, steps=50)


def _param_table(text: str) -> str:
    return text.split("parameters and optimizer state", 1)[1].split(" collectives ", 1)[0]


def test_the_terminal_groups_per_layer_leaves_and_stays_bounded(big):
    text = render.to_table(big)
    table = _param_table(text)
    rows = [line for line in table.splitlines() if line.startswith("│ ") and line[2:3].isdigit()]
    assert 10 < len(rows) <= render.TABLE_ROWS
    assert sum(int(r.split("│")[1].strip().replace(",", "")) for r in rows) == LEAVES  # every leaf counted once
    assert "params/layer_*/moe/expert_*/wi/kernel" in table
    # an index every member shares stays (Adam is the chain's transform 0), one that differs is a *
    grouped = [row[1] for row in render.grouped_param_rows(big)]
    assert "opt_state/0/mu/layer_*/moe/expert_*/wo/bias" in grouped and "opt_state/*/count" in grouped
    assert "10,000 leaves in %d groups" % len(rows) in table and "--all-rows" in table
    assert len(text.splitlines()) < 300


def test_leaves_that_do_not_group_are_capped_with_a_more_line(big):
    # every leaf its own shape: nothing groups, so the table shows TABLE_ROWS rows and says what it left out
    record = dataclasses.replace(big, params=[dataclasses.replace(r, shape=[i + 1]) for i, r in enumerate(big.params)])
    header, rows, note = render.terminal_param_table(record)
    assert len(rows) == render.TABLE_ROWS
    hidden = LEAVES - render.TABLE_ROWS
    assert "... %s more groups (%s leaves) not shown" % (format(hidden, ","), format(hidden, ",")) in note
    text = render.to_table(record)
    assert note in text and len(text.splitlines()) < 300


def test_every_format_keeps_every_leaf(big, tmp_path):
    paths = [r.path for r in big.params]
    assert len(set(paths)) == LEAVES
    data = json.loads(report_json(big))
    assert [r["path"] for r in data["params"]] == paths
    md = render.to_markdown(big)
    assert all("| %s |" % p in md for p in paths)
    full = render.to_table(big, all_rows=True)
    assert all(p in full for p in paths)
    page = render.to_html(big, rendered_plots=[])
    assert all(">%s<" % p in page for p in paths)
    # each parameter's Adam state (mu and nu) is folded under it, found by its path
    assert page.count('<tr class="param">') == sum(p.startswith("params/") for p in paths)
    assert page.count('<tr class="opt ') == sum("/mu/" in p or "/nu/" in p for p in paths)
    assert "2 arrays" in page


def test_the_cli_renders_the_big_report_in_every_format(tmp_path):
    run = inspect_scale.write_report(str(tmp_path / "A"), leaves=LEAVES, steps=50)
    env = dict(os.environ, PYTHONPATH=str(REPO))

    def inspect(*args):
        p = subprocess.run(
            [sys.executable, "-m", "alpa_job", "inspect", run, *args], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120
        )
        assert p.returncode == 0, p.stderr[-2000:]
        return p.stdout

    assert "10,000 leaves in" in inspect()
    assert "opt_state/0/nu/layer_1/moe/expert_31/wo/bias" in inspect("--all-rows")
    assert json.loads(inspect("--format", "json"))["params"][-1]["path"] == "opt_state/2/count"
    assert inspect("--format", "md").count("\n| opt_state/") == LEAVES - 1 - (LEAVES - 2) // 3
    assert inspect("--format", "html").strip() == os.path.join(run, "report.html")
    assert os.path.getsize(os.path.join(run, "report.html")) > 1_000_000
