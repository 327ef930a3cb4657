"""Comments that stay true: the package's comments and docstrings cite nothing a user cannot open.

A user of the installed package has alpa_job/ and the kit's own folders (ansible/, k8s/, docker/,
README), not this repository's tracker or its tests/, bench/, scripts/ or CI, and not the notes of
the machines it was developed on. So no comment or docstring in alpa_job/ (Python, and the YAML it
ships) names an issue number (`issue 12`, `#776`) or such a path; an upstream project's bug is cited
by its public URL (https://github.com/alpa-projects/alpa/issues/776), which anyone can open.
Measured timings belong in bench/RESULTS.md too, but "a number with a unit" is too common in true
comments (defaults, limits) to check mechanically: reviews keep those out.
"""

from __future__ import annotations

import ast
import io
import os
import re
import tokenize
from typing import Dict, Iterator, List, Tuple

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PACKAGE = os.path.join(REPO, "alpa_job")

# What a comment may not say, each with the reason the failure message gives.
FORBIDDEN: List[Tuple[re.Pattern, str]] = [
    (re.compile(r"(?i)\bissues?\s*#?\s*\d+"), "an issue number (say why in words; the number goes in the commit log)"),
    (re.compile(r"(?i)(?<![\w&/#])(?<!issue )(?<!issues )#\d{1,5}(?![\w-])"), "an issue number (#N: cite an upstream bug by its URL)"),
    (re.compile(r"(?<![\w./-])(?:\.\./)*(?:tests|bench|scripts|\.ci)/"), "a repository path the package's user cannot open"),
    (re.compile(r"(?:\.\./)+shared/|/work/"), "a path of the machines the kit was developed on"),
    (re.compile(r"(?i)\bseeds?/|\bseed failures?\b"), "the development seeds, which the package's user never sees"),
]


def python_comments(source: str) -> Iterator[Tuple[int, str]]:
    """(line, text) of every comment and every module/class/function docstring."""
    for token in tokenize.generate_tokens(io.StringIO(source).readline):
        if token.type == tokenize.COMMENT:
            yield token.start[0], token.string
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            docstring = ast.get_docstring(node, clean=False)
            if docstring is not None:
                yield node.body[0].lineno, docstring


def yaml_comments(source: str) -> Iterator[Tuple[int, str]]:
    """(line, text) of every YAML comment: a '#' at a line's start or after a space (not in a value)."""
    for number, line in enumerate(source.splitlines(), 1):
        match = re.search(r"(?:^|\s)(#.*)$", line)
        if match:
            yield number, match.group(1)


def problems(source: str, kind: str = "py") -> List[Tuple[int, str, str]]:
    """(line, offending text, why) for each forbidden thing in the comments of `source`."""
    comments = python_comments(source) if kind == "py" else yaml_comments(source)
    found = []
    for line, text in comments:
        for pattern, why in FORBIDDEN:
            for match in pattern.finditer(text):
                found.append((line, match.group(0), why))
    return found


def package_problems() -> Dict[str, List[Tuple[int, str, str]]]:
    """alpa_job's files (relative paths) -> their problems, for the files that have any."""
    out = {}
    for root, _dirs, files in os.walk(PACKAGE):
        for name in sorted(files):
            kind = "py" if name.endswith(".py") else "yaml" if name.endswith((".yaml", ".yml")) else None
            if kind is None:
                continue
            path = os.path.join(root, name)
            with open(path, encoding="utf-8") as handle:
                found = problems(handle.read(), kind)
            if found:
                out[os.path.relpath(path, REPO).replace(os.sep, "/")] = found
    return out


def test_the_package_comments_cite_nothing_a_user_cannot_open():
    report = [f"{path}:{line}: {text!r} is {why}" for path, found in sorted(package_problems().items()) for line, text, why in found]
    assert not report, "\n".join(report)


BAD_SAMPLE = '''"""Module doc (issue 13: fail fast).

Measured in bench/gpu_init_compile.py and ../shared/notes/gpu.md; tests/test_flops.py checks it.
"""
import os  # Alpa #886: Ray Client does not work


def f(seed):
    """Guards for the Alpa seed failures (see .ci/run.sh and scripts/testbed, Issue #12)."""
    return seed  # /work/.library/device/KINDS.md
'''

GOOD_SAMPLE = '''"""Module doc: fail fast, before Ray starts.

Alpa cannot run over Ray Client (https://github.com/alpa-projects/alpa/issues/886); see
alpa_job/cluster/spec.py, ansible/site.yml and k8s/ for the port plan.
"""
COLOR = "#1f77b4"  # matplotlib's first colour; the 20 s default is a limit, not a measurement


def f(seed, bench):
    """Batches are a pure function of (seed, epoch); the benches and tests pass address none."""
    return seed  # alpa_job/tests would be a package path, and so is fine
'''


def test_the_check_fails_on_a_bad_sample_and_passes_a_good_one():
    found = problems(BAD_SAMPLE)
    texts = [text for _line, text, _why in found]
    for expected in ("issue 13", "bench/", "../shared/", "tests/", "#886", "seed failures", ".ci/", "scripts/", "Issue #12", "/work/"):
        assert expected in texts, (expected, found)
    assert problems(GOOD_SAMPLE) == []
    yaml_found = problems("a: 1  # Ray Client (issue #886)\nb: '#123'\n# see bench/RESULTS.md\n", "yaml")
    assert [text for _line, text, _why in yaml_found] == ["issue #886", "bench/"]
