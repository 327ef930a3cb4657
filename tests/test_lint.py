"""The code is lint-clean and formatted: ruff's lint (pyflakes and pycodestyle) and ruff's formatter,
configured in pyproject.toml, over the whole tree."""

from __future__ import annotations

import os
import subprocess
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RUFF = os.path.join(os.path.dirname(sys.executable), "ruff")


def _ruff(*args: str, command: str = "check") -> subprocess.CompletedProcess:
    return subprocess.run([RUFF, command, "--no-cache", *args], cwd=REPO, capture_output=True, text=True, timeout=120)


def test_the_tree_is_lint_clean():
    p = _ruff(".")
    assert p.returncode == 0, p.stdout[-4000:] + p.stderr[-2000:]


def test_the_lint_sees_what_it_is_meant_to(tmp_path):
    """The project's settings catch an unused import and a name used before it exists."""
    bad = tmp_path / "bad.py"
    bad.write_text("import os\n\n\ndef f():\n    return undefined_name\n")
    p = _ruff("--config", os.path.join(REPO, "pyproject.toml"), str(bad))
    assert p.returncode == 1 and "F401" in p.stdout and "F821" in p.stdout, p.stdout


def test_the_tree_is_formatted():
    p = _ruff("--check", ".", command="format")
    assert p.returncode == 0, "run `.venv/bin/ruff format .`: " + p.stdout[-4000:] + p.stderr[-2000:]


def test_the_format_check_sees_what_it_is_meant_to(tmp_path):
    """An unformatted file (a misplaced space, single quotes) fails the check; its formatted form passes."""
    bad = tmp_path / "bad.py"
    bad.write_text("x = [1,2]\ny = 'a'\n")
    config = ("--config", os.path.join(REPO, "pyproject.toml"))
    assert _ruff(*config, "--check", str(bad), command="format").returncode == 1
    bad.write_text('x = [1, 2]\ny = "a"\n')
    assert _ruff(*config, "--check", str(bad), command="format").returncode == 0
