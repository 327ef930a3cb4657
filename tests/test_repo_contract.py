"""The repository's promises to a newcomer: the layout, README's two commands, CI running them."""

from __future__ import annotations

import os
import re

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _read(*parts):
    with open(os.path.join(REPO, *parts)) as f:
        return f.read()


def readme_commands():
    return re.findall(r"```sh\n(.+?)\n```", _read("README.md"), flags=re.S)


def test_top_level_layout():
    for name in ("docker", "ansible", "k8s", "alpa_job", "scripts", "tests", "README.md", "pyproject.toml"):
        assert os.path.exists(os.path.join(REPO, name)), name


def test_readme_has_exactly_two_setup_commands():
    setup = [c for c in readme_commands() if c.startswith("scripts/setup")]
    assert setup == ["scripts/setup && .venv/bin/python -m alpa_job", "scripts/setup --test && .venv/bin/python -m pytest"]


def test_ci_runs_the_readme_test_command_verbatim():
    test_command = [c for c in readme_commands() if c.startswith("scripts/setup --test")][0]
    ci_lines = [line.strip() for line in _read(".ci", "run").splitlines() if not line.startswith("#")]
    assert test_command in ci_lines


def test_package_code_has_no_py310_only_syntax():
    """Package code runs on the Alpa image's Python 3.9: no `match`, annotations deferred."""
    import ast

    for root, _dirs, files in os.walk(os.path.join(REPO, "alpa_job")):
        for name in files:
            if not name.endswith(".py"):
                continue
            path = os.path.join(root, name)
            source = _read(path)
            tree = ast.parse(source, feature_version=(3, 9))  # raises on 3.10+ syntax
            uses_annotations = any(isinstance(n, (ast.AnnAssign, ast.arg)) and getattr(n, "annotation", None) for n in ast.walk(tree))
            if uses_annotations and "|" in source:
                assert "from __future__ import annotations" in source, f"{path}: X | Y annotations need it on 3.9"
