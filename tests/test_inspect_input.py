"""What the input did and the eval curve, in the report: the schema's input/evals/per-process reads, the
Input section of the terminal view, report.md and report.html, the eval points on the loss plot, and the
run comparison's data wait and eval loss columns. Records are built in memory: no Ray, no training."""

from __future__ import annotations

import json

import pytest

from alpa_job.inspect import compare, render
from alpa_job.inspect.plots import all_plots, loss_figure
from alpa_job.record.run_record import RunRecord
from helpers_report import assert_valid_report, record_with_input, schema_errors, without_input


@pytest.fixture(autouse=True)
def _close_figures():
    yield
    import matplotlib.pyplot as plt

    plt.close("all")


# ----------------------------------------------------------------------------- schema
def test_schema_accepts_input_evals_and_per_process_reads():
    data = record_with_input(processes=2).to_dict()
    assert data["input"]["pipeline"] == "grain" and len(data["evals"]) == 3
    assert [p["rows_read"] for p in data["processes"]] == [480, 480]
    assert_valid_report(data)
    assert RunRecord.from_dict(data).to_dict() == data


@pytest.mark.parametrize(
    "where, mutate",
    [
        ("input/rows_read", lambda d: d["input"].update(rows_read="960")),
        ("input/data_wait_fraction", lambda d: d["input"].update(data_wait_fraction="0.05%")),
        ("input/pipeline", lambda d: d["input"].update(pipeline="tf.data")),
        ("input", lambda d: d["input"].pop("bytes_read")),
        ("input", lambda d: d["input"].update(shuffle=True)),
        ("input", lambda d: d.update(input=[])),
        ("evals/1/loss", lambda d: d["evals"][1].update(loss="5.3")),
        ("evals/0", lambda d: d["evals"][0].update(split="eval")),
        ("evals", lambda d: d.update(evals={"step": 10})),
        ("processes/1/bytes_read", lambda d: d["processes"][1].update(bytes_read=-1)),
        ("process/rows_read", lambda d: d["process"].update(rows_read=1.5)),
    ],
)
def test_schema_rejects_wrong_input_and_eval_data(where, mutate):
    data = record_with_input(processes=2).to_dict()
    mutate(data)
    errors = schema_errors(data)
    assert errors and any(e.startswith(where + ":") for e in errors), errors


def test_old_report_without_input_validates_as_written_and_loads():
    old = without_input(record_with_input(processes=2).to_dict())
    assert "input" not in old and "rows_read" not in old["processes"][0]
    assert_valid_report(old)  # on disk, untouched
    record = RunRecord.from_dict(old)
    assert record.input is None and record.evals == [] and record.processes[1].rows_read is None
    assert_valid_report(record.to_dict())  # re-written by this kit: the new keys with their empty values
    assert record.to_dict()["input"] is None


# ----------------------------------------------------------------------------- rendering
def test_markdown_has_the_input_section_and_each_process_share():
    md = render.to_markdown(record_with_input(processes=2))
    section = md.split("## Input", 1)[1].split("\n## ", 1)[0]
    assert "| pipeline | grain |" in section and "| epochs | 0.3093 |" in section
    assert "| rows / bytes read (process 0) | 480 rows, 247680 B (241.9 KiB) |" in section
    assert "| rows / bytes read (all 2 processes) | 960 rows, 495360 B (483.8 KiB) |" in section
    assert "| data wait (process 0) | 0.287 ms per step, 0.05% of the loop (0.0086 s in all) |" in section
    assert "| process | host | rows read | bytes read |" in section
    assert "| 0 | node0 | 480 | 247680 B (241.9 KiB) |" in section
    assert "| 1 | node1 | 480 | 247680 B (241.9 KiB) |" in section
    assert "| eval loss (final) | 4.07, perplexity 58.56 at step 30 (2 batches) |" in md
    assert "| 20 | 5.3 | 200.34 | 2 |" in md.split("## Eval", 1)[1]


def test_one_process_run_has_no_per_process_table():
    md = render.to_markdown(record_with_input(processes=1))
    assert "| rows / bytes read | 960 rows, 495360 B (483.8 KiB) |" in md
    assert "| data wait | 0.287 ms per step" in md
    assert "rows read | bytes read" not in md and "(process 0)" not in md


def test_html_has_the_input_section_per_process_rows_and_the_eval_plot():
    record = record_with_input(processes=3)
    page = render.to_html(record)
    assert "<h2>Input</h2>" in page and '<table class="input">' in page
    shares = page.split('<table class="input-processes">', 1)[1].split("</table>", 1)[0]
    assert shares.count("<tr>") == 4  # the header and one row per process
    for pid in range(3):
        assert f"<td>{pid}</td><td>node{pid}</td><td>320</td><td>165120 B (161.2 KiB)</td>" in shares
    assert "0.05% of the loop" in page and "<h2>Eval</h2>" in page
    assert 'alt="Training and eval loss"' in page


def test_terminal_view_has_the_input_tables():
    text = render.to_table(record_with_input(processes=2))
    for title in ("input", "input per process", "eval"):
        assert f" {title} " in text, title
    assert "tokens: 1 file(s)" in text and "node1" in text and "58.56" in text


def test_run_without_input_renders_as_before():
    record = RunRecord.from_dict(without_input(record_with_input(processes=2).to_dict()))
    record.evals, record.eval_loss = [], None
    md, page, text = render.to_markdown(record), render.to_html(record), render.to_table(record)
    assert "## Input" not in md and "## Eval" not in md and "eval loss" not in md
    assert "<h2>Input</h2>" not in page and "<h2>Eval</h2>" not in page and 'alt="Training loss"' in page
    assert " input " not in text


def test_report_with_only_an_eval_loss_keeps_its_summary_row():
    record = record_with_input(processes=1)
    record.evals = []
    assert ("eval loss", "4.07") in render.summary_pairs(record)


# ----------------------------------------------------------------------------- the loss plot
def test_loss_plot_draws_the_eval_points_over_the_train_loss():
    fig = loss_figure(record_with_input(processes=1))
    (ax,) = fig.axes
    train, evals = ax.get_lines()
    assert list(train.get_xdata()) == list(range(1, 31)) and train.get_ydata()[0] == pytest.approx(7.0)
    assert list(evals.get_xdata()) == [10, 20, 30]
    assert list(evals.get_ydata()) == pytest.approx([6.39, 5.3, 4.07])
    assert [t.get_text() for t in ax.get_legend().get_texts()] == ["train", "eval"]


def test_resumed_run_plots_train_loss_at_its_global_steps():
    (ax,) = loss_figure(record_with_input(processes=1, resumed_from_step=20)).axes
    train, evals = ax.get_lines()
    assert list(train.get_xdata()) == list(range(21, 31))
    assert list(evals.get_xdata()) == [10, 20, 30]


def test_loss_plot_without_evals_is_the_train_curve_alone():
    record = record_with_input(processes=1)
    record.evals = []
    (ax,) = loss_figure(record).axes
    assert len(ax.get_lines()) == 1 and ax.get_legend() is None
    assert [caption for _n, caption, _png in all_plots(record)] == ["Training loss"]


# ----------------------------------------------------------------------------- --compare
def _write(tmp_path, name, record):
    folder = tmp_path / name
    folder.mkdir()
    (folder / "report.json").write_text(json.dumps(record.to_dict()))
    return str(folder)


def test_compare_shows_data_wait_and_eval_loss(tmp_path):
    slow = record_with_input(processes=2)
    slow.input.data_wait_per_step_s = 0.0125
    slow.evals[-1].loss = 4.5
    fast, slow_name = "20261125-215104-gpt-fast", "20261125-215113-gpt-slow"  # run dirs' timestamped names
    paths = [_write(tmp_path, fast, record_with_input(processes=2)), _write(tmp_path, slow_name, slow)]
    data = compare.rows(paths)
    assert [(r["data_wait_ms"], r["eval_loss"]) for r in data] == [(0.287, 4.07), (12.5, 4.5)]
    md = compare.to_markdown(data)
    header = md.splitlines()[2]
    assert header.endswith("| loss last | data wait ms / step | eval loss |")
    assert "| 0.287 | 4.07 |" in md and "| 12.5 | 4.5 |" in md
    text = compare.to_text(data)
    assert "data wait ms / step" in text and "12.5" in text and "0.287" in text
    assert fast in text and slow_name in text  # the wider table still keeps each run's name on one line
    assert "<th>data wait ms / step</th><th>eval loss</th>" in compare.to_html(data)


def test_compare_of_runs_without_input_keeps_its_columns(tmp_path):
    old = [RunRecord.from_dict(without_input(record_with_input(processes=1).to_dict())) for _ in range(2)]
    for record in old:
        record.evals, record.eval_loss = [], None
    data = [compare.row(name, r) for name, r in zip(("a", "b"), old)]
    assert compare.columns(data) == list(compare.COLUMNS)
    assert len(compare.table_rows(data)[0]) == len(compare.COLUMNS)
    # one run with an eval split is enough for the column; the other shows '-'
    data[1] = compare.row("b", record_with_input(processes=1))
    assert compare.columns(data)[-2:] == ["data wait ms / step", "eval loss"]
    assert compare.table_rows(data)[0][-2:] == ["-", "-"]


def test_the_summary_says_where_fsdp_gathered_its_weights():
    record = record_with_input(processes=1)
    record.weight_gather = {"placement": "per layer", "layers": 24}
    assert (
        "weights gathered",
        "per layer (24 layers: each gathers its own before it runs and again in the backward)",
    ) in render.summary_pairs(record)
    record.weight_gather = {"placement": "xla", "reason": "--fsdp-gather auto: the step fits with XLA's placement"}
    assert ("weights gathered", "as XLA places them: --fsdp-gather auto: the step fits with XLA's placement") in render.summary_pairs(
        record
    )
    assert "weights gathered" in render.to_markdown(record)
