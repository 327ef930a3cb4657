"""The test bed's code stays readable (no test bed needed: read from the source).

- no function in scripts/testbed or scripts/kit_testbed/ is over MAX_LINES lines without a ``# long:``
  comment saying why (on its ``def`` line or just above it);
- no module reaches into the test bed's private names (``hosts._x``, ``from kit_testbed.ray_layer import
  _x``, ``bed._x`` for a private member of its classes): what others need is public and documented.
"""

from __future__ import annotations

import ast
import os
from typing import Dict, List, Set

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPTS = os.path.join(REPO, "scripts")
PACKAGE = "kit_testbed"
MAX_LINES = 60


def _module_file(module: str) -> str:
    return os.path.join(SCRIPTS, *module.split(".")) + ".py"


def _package_files() -> List[str]:
    folder = os.path.join(SCRIPTS, PACKAGE)
    return sorted(os.path.join(folder, n) for n in os.listdir(folder) if n.endswith(".py"))


# Every module of the package (a new one is checked without being listed here).
TESTBED_MODULES = tuple(f"{PACKAGE}.{os.path.basename(p)[: -len('.py')]}" for p in _package_files() if not p.endswith("__init__.py"))


def _testbed_files() -> List[str]:
    return [os.path.join(SCRIPTS, "testbed")] + _package_files()


def _module_of(path: str) -> str:
    """The name a file is imported by (the package's modules by their dotted name)."""
    stem = os.path.basename(path)[: -len(".py")] if path.endswith(".py") else os.path.basename(path)
    return f"{PACKAGE}.{stem}" if os.path.dirname(path) == os.path.join(SCRIPTS, PACKAGE) else stem


def _python_files() -> List[str]:
    """Every Python file that may use the test bed: scripts/ (`testbed` has no suffix) and its package,
    tests/, bench/."""
    found = list(_package_files())
    for folder in ("scripts", "tests", "bench"):
        root = os.path.join(REPO, folder)
        for name in sorted(os.listdir(root)) if os.path.isdir(root) else []:
            path = os.path.join(root, name)
            if name.endswith(".py") or (
                os.path.isfile(path) and open(path, errors="replace").readline().startswith("#!/usr/bin/env python")
            ):
                found.append(path)
    return found


def _parse(path: str) -> ast.Module:
    with open(path) as f:
        return ast.parse(f.read(), filename=path)


def long_functions(source: str, limit: int = MAX_LINES) -> List[str]:
    """Functions over ``limit`` lines with no ``# long:`` reason on the def line or the line above it."""
    lines = source.splitlines()
    out = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            length = node.end_lineno - node.lineno + 1
            first = min([node.lineno] + [d.lineno for d in node.decorator_list])
            around = lines[max(0, first - 2) : node.lineno]
            if length > limit and not any("# long:" in line for line in around):
                out.append(f"{node.name} (line {node.lineno}, {length} lines)")
    return out


def _is_private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def _private_members(tree: ast.Module) -> Set[str]:
    """Private methods and ``self._x`` attributes of the module's classes."""
    out: Set[str] = set()
    for cls in (n for n in tree.body if isinstance(n, ast.ClassDef)):
        for node in ast.walk(cls):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and _is_private(node.name):
                out.add(node.name)
            elif (
                isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "self" and _is_private(node.attr)
            ):
                out.add(node.attr)
    return out


def _own_names(tree: ast.Module) -> Set[str]:
    """Names a file defines itself (its own private helpers may share a name with the test bed's)."""
    out = {n.name for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))}
    out |= {
        n.attr
        for n in ast.walk(tree)
        if isinstance(n, ast.Attribute) and isinstance(n.value, ast.Name) and n.value.id == "self" and isinstance(n.ctx, ast.Store)
    }
    return out


def private_uses(tree: ast.Module, module: str, members: Dict[str, Set[str]]) -> List[str]:
    """Where a file (itself the module ``module``) uses another test-bed module's private names."""
    aliases = {}  # local name -> test-bed module
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            aliases.update({a.asname or a.name: a.name for a in node.names if a.name in TESTBED_MODULES})
        elif isinstance(node, ast.ImportFrom) and node.module == PACKAGE:  # from kit_testbed import hosts as tb
            aliases.update({a.asname or a.name: f"{PACKAGE}.{a.name}" for a in node.names if f"{PACKAGE}.{a.name}" in TESTBED_MODULES})
    others = {m: names for m, names in members.items() if m != module}
    foreign = set().union(*others.values()) - _own_names(tree) if others else set()
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module in TESTBED_MODULES and node.module != module:
            out += [f"line {node.lineno}: from {node.module} import {a.name}" for a in node.names if _is_private(a.name)]
        elif isinstance(node, ast.Attribute) and _is_private(node.attr):
            owner = aliases.get(node.value.id) if isinstance(node.value, ast.Name) else None
            if owner and owner != module:
                out.append(f"line {node.lineno}: {owner}.{node.attr}")
            elif node.attr in foreign:
                out.append(f"line {node.lineno}: .{node.attr} (a private member of the test bed's classes)")
    return out


def _members_of_the_testbed() -> Dict[str, Set[str]]:
    return {m: _private_members(_parse(_module_file(m))) for m in TESTBED_MODULES}


def test_the_checks_can_fail():
    body = "\n".join(f"    x = {i}" for i in range(MAX_LINES))
    assert long_functions(f"def f():\n{body}\n") == [f"f (line 1, {MAX_LINES + 1} lines)"]
    assert long_functions(f"# long: one table, read top to bottom\ndef f():\n{body}\n") == []
    members = {"kit_testbed.hosts": {"_save"}}
    tree = ast.parse(
        "from kit_testbed import hosts as tb\nfrom kit_testbed.ray_layer import _kill\ntb._wait(1)\nbed._save()\ntb.wait_for(1)\n"
    )
    assert private_uses(tree, "user", members) == [
        "line 2: from kit_testbed.ray_layer import _kill",
        "line 3: kit_testbed.hosts._wait",
        "line 4: ._save (a private member of the test bed's classes)",
    ]
    assert private_uses(ast.parse("class A:\n    def _save(self): pass\nA()._save()\n"), "user", members) == []


def test_no_long_function_without_a_reason():
    too_long = {os.path.relpath(p, REPO): long_functions(open(p).read()) for p in _testbed_files()}
    too_long = {p: fns for p, fns in too_long.items() if fns}
    assert not too_long, (
        f"functions over {MAX_LINES} lines: split them into named steps, or say why not in a `# long:` comment above the def: {too_long}"
    )


def test_no_module_uses_the_test_beds_private_names():
    members = _members_of_the_testbed()
    assert "save" not in members["kit_testbed.hosts"] and "_launchers" in members["kit_testbed.hosts"]  # the check sees them
    found = {}
    for path in _python_files():
        uses = private_uses(_parse(path), _module_of(path), members)
        if uses:
            found[os.path.relpath(path, REPO)] = uses
    assert not found, f"private names of the test bed used outside their module (make them public): {found}"
