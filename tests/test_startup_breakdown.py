"""Where a run's start-up went (alpa_job/record/startup.py): the phases of the thread that trains, in order,
add up to the time from the process's start to its first step; the work beside them is listed apart."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from alpa_job.record.startup import STARTUP_SEQUENCE, startup_breakdown, startup_text

PHASES = {
    "before_train": 1.1,
    "startup": 0.4,
    "abstract_state": 0.25,
    "open_devices": 0.02,
    "setup_and_compile": 2.6,
    "compile": 1.5,
    "init_compile": 0.5,
    "init_run_ahead": 0.3,
    "init_or_restore": 0.04,
    "first_step": 0.5,
    "to_first_step": 3.3,
    "process_to_first_step": 4.4,
}


def test_the_sequence_adds_up_to_the_time_to_the_first_step():
    out = startup_breakdown(PHASES)
    sequence = out["sequence_s"]
    assert list(sequence) == [name for name, _ in STARTUP_SEQUENCE]
    assert out["process_to_first_step_s"] == 4.4
    assert sum(sequence.values()) == pytest.approx(4.4, abs=1e-3)
    assert sequence["engine"] == pytest.approx(2.6 - 0.4 - 0.02 - 1.5, abs=1e-3)  # left between the measured
    assert sequence["loop_setup"] == pytest.approx(4.4 - 1.1 - 2.6 - 0.04 - 0.5, abs=1e-3)
    assert out["beside_s"] == {"init_compile": 0.5, "init_run_ahead": 0.3}


def test_no_breakdown_without_a_first_step_or_a_process_age():
    assert startup_breakdown({**PHASES, "process_to_first_step": None}) is None
    assert startup_breakdown({k: v for k, v in PHASES.items() if k != "before_train"}) is None


def test_the_line_names_each_phase_that_took_time_and_the_work_beside():
    text = startup_text(startup_breakdown(PHASES))
    assert text.startswith("4.40 s from the process's start to the first step: python, CLI, checks, imports 1.10;")
    assert "step compile or load 1.50" in text and "first step 0.50" in text
    assert "state init or restore" not in text  # under 0.05 s: left out
    assert text.endswith("(beside: initialiser compile 0.50, state made 0.30)")


def _python(code: str, timeout: int) -> str:
    """What a fresh Python process running `code` against this checkout prints (it must exit 0)."""
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, PYTHONPATH=repo)
    done = subprocess.run([sys.executable, "-c", code], cwd=repo, env=env, capture_output=True, text=True, timeout=timeout)
    assert done.returncode == 0, done.stderr[-2000:]
    return done.stdout


def test_a_runs_start_imports_neither_the_planner_nor_the_report_writer():
    """What `train` imports before its first step (the CLI's parser, every command's flags in it, and the
    runner) leaves out the planner and the report's HTML writer: each costs a warm start a tenth of a second."""
    code = (
        "import sys; from alpa_job import cli; cli.build_parser(); import alpa_job.launch.runner; "
        "print(sorted(m for m in sys.modules if m in ('alpa_job.planner.plan', 'alpa_job.inspect.write', 'alpa_job.inspect.render')))"
    )
    out = _python(code, timeout=120)
    assert out.strip() == "[]", out


def test_a_run_without_ray_never_imports_it(tmp_path):
    """`--address none` trains without Ray, start to end (its report's node address included): importing Ray
    costs a local run half a second for nothing."""
    out = tmp_path / "run"
    code = (
        "import sys; from alpa_job import cli; "
        "code = cli.main(['train', '--address', 'none', '--hidden-dim', '16', '--num-samples', '32', '--batch-size', '16', "
        f"'--steps', '1', '--compile-cache', 'none', '--no-tensorboard', '-q', '--out', {str(out)!r}]); "
        "print(code, 'ray' in sys.modules)"
    )
    printed = _python(code, timeout=300)
    assert printed.strip().splitlines()[-1] == "0 False", printed
