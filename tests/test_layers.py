"""The package's layers, read from the code's own imports (every import, function-local ones too).

- no import circle anywhere in alpa_job/ or scripts/;
- training (train/, engines/) never imports the readers (inspect/): it writes the record, never formats it;
- the record and its readers (record/, inspect/) never import an engine, training or the launcher;
- what runs on or about nodes (cluster/) never imports how a job is launched (launch/) or trained;
- the packages (and top-level modules) stand in ranks, PACKAGE_RANKS: each imports only from ranks below
  its own, so no two packages import each other, even through modules that do not form a circle.
"""

from __future__ import annotations

import ast
import os
from typing import Dict, List, Set

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPTS = os.path.join(REPO, "scripts")


def _package_modules(top: str = REPO, package: str = "alpa_job") -> Dict[str, str]:
    """A package's module names (as imported from `top`) -> file paths (a package is its __init__.py)."""
    found = {}
    for root, _dirs, files in os.walk(os.path.join(top, package)):
        for name in files:
            if not name.endswith(".py"):
                continue
            rel = os.path.relpath(os.path.join(root, name), top)[: -len(".py")]
            parts = rel.split(os.sep)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            found[".".join(parts)] = os.path.join(root, name)
    return found


def _script_modules() -> Dict[str, str]:
    """scripts/: its Python files (modules by their stem; `testbed` has no suffix but is Python) and its
    packages (the test bed's kit_testbed), imported from scripts/ as their callers do."""
    found = {}
    for name in os.listdir(SCRIPTS):
        path = os.path.join(SCRIPTS, name)
        if name.endswith(".py"):
            found[name[: -len(".py")]] = path
        elif os.path.isfile(os.path.join(path, "__init__.py")):
            found.update(_package_modules(SCRIPTS, name))
        elif os.path.isfile(path) and open(path, errors="replace").readline().startswith("#!/usr/bin/env python"):
            found[name] = path
    return found


MODULES = {**_package_modules(), **_script_modules()}


def _imports_of(path: str) -> Set[str]:
    """The known modules a file imports. `from P import N` imports P (its __init__ runs) and P.N when
    that is a module; `import A.B` imports A.B."""
    tree = ast.parse(open(path).read(), filename=path)
    out: Set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out.update(alias.name for alias in node.names if alias.name in MODULES)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            if node.module in MODULES:
                out.add(node.module)
            out.update(f"{node.module}.{alias.name}" for alias in node.names if f"{node.module}.{alias.name}" in MODULES)
    return out


GRAPH = {name: _imports_of(path) - {name} for name, path in MODULES.items()}


def _cycles(graph: Dict[str, Set[str]]) -> List[List[str]]:
    """Strongly connected components of more than one module (Tarjan, iterative)."""
    index: Dict[str, int] = {}
    low: Dict[str, int] = {}
    stack: List[str] = []
    on_stack: Set[str] = set()
    found: List[List[str]] = []
    counter = 0
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = counter
                    counter += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph.get(child, ())))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def test_the_cycle_finder_finds_a_cycle():
    # The check below must be able to fail: a known circle and a clean chain.
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": set()}) == []


def test_the_graph_sees_function_local_and_package_imports():
    assert "alpa_job.errors" in GRAPH["alpa_job.cli"]
    assert any(name.startswith("alpa_job.engines") for name in GRAPH["alpa_job.train.loop"])
    assert "kit_testbed.hosts" in GRAPH["testbed"]


def test_no_import_circle_in_the_package_or_scripts():
    circles = _cycles(GRAPH)
    assert not circles, "import circles (each a group of modules that import each other): " + "; ".join(" <-> ".join(c) for c in circles)


def _under(module: str, *packages: str) -> bool:
    return any(module == p or module.startswith(p + ".") for p in packages)


LAYER_RULES = [
    # (who, must not import, why)
    (("alpa_job.train", "alpa_job.engines"), ("alpa_job.inspect",), "training writes the record; rendering it is the readers' job"),
    (
        ("alpa_job.record", "alpa_job.inspect"),
        ("alpa_job.engines", "alpa_job.train", "alpa_job.launch"),
        "the record and its readers work anywhere, with no engine installed",
    ),
    (
        ("alpa_job.cluster",),
        ("alpa_job.launch", "alpa_job.train", "alpa_job.engines.jax_engine", "alpa_job.engines.alpa_engine"),
        "node-side tools run on bare nodes, before any job exists",
    ),
]


@pytest.mark.parametrize("who,forbidden,why", LAYER_RULES, ids=[r[0][0] for r in LAYER_RULES])
def test_layer_rule(who, forbidden, why):
    broken = sorted(f"{m} imports {t}" for m, targets in GRAPH.items() if _under(m, *who) for t in targets if _under(t, *forbidden))
    assert not broken, f"{why}: " + "; ".join(broken)


def test_the_layer_rules_name_real_packages():
    for who, forbidden, _why in LAYER_RULES:
        for package in who + forbidden:
            assert package in MODULES, f"{package} is not a module of the package any more"


# ----------------------------------------------------------------------------- packages in ranks
# alpa_job's packages and top-level modules, lowest first. A unit imports only from ranks below its own:
# the job's settings know no model and no data (a model's settings are its declaration's), models know
# no settings catalogue, and the readers of a run (record/, inspect/) know no engine.
PACKAGE_RANKS = (
    ("errors", "choices", "units", "strict_json", "jax_compat", "cpu_devices", "shutdown", "progress", "losses", ""),
    ("setting",),
    ("api",),
    ("strategies", "versions"),
    ("settings", "models", "record", "cluster"),
    ("data", "hf", "inspect"),
    ("engines",),
    ("planner",),
    ("train",),
    ("launch", "hf_commands"),
    ("cli",),
    ("__main__",),
)
RANK = {unit: rank for rank, units in enumerate(PACKAGE_RANKS) for unit in units}


def _unit(module: str) -> str:
    """The package (or top-level module) a module of alpa_job belongs to; "" is alpa_job's own __init__."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else ""


def _package_edges(graph: Dict[str, Set[str]]) -> Dict[tuple, List[str]]:
    """(importing unit, imported unit) -> the module imports behind it."""
    edges: Dict[tuple, List[str]] = {}
    for module, targets in graph.items():
        if not module.startswith("alpa_job"):
            continue
        for target in targets:
            if target.startswith("alpa_job") and _unit(target) != _unit(module):
                edges.setdefault((_unit(module), _unit(target)), []).append(f"{module} -> {target}")
    return edges


def _upward(edges: Dict[tuple, List[str]]) -> List[str]:
    return sorted(
        f"{who} (rank {RANK[who]}) imports {what} (rank {RANK[what]}): {', '.join(sorted(why)[:3])}"
        for (who, what), why in edges.items()
        if RANK[what] >= RANK[who]
    )


def test_every_package_has_a_rank():
    units = {_unit(m) for m in MODULES if m.startswith("alpa_job")}
    assert units == set(RANK), f"rank these in PACKAGE_RANKS: {sorted(units - set(RANK))}; gone: {sorted(set(RANK) - units)}"


def test_packages_import_only_from_lower_ranks():
    problems = _upward(_package_edges(GRAPH))
    assert not problems, "upward or sideways imports between packages: " + "; ".join(problems)
    assert not _cycles({a: {b for (x, b) in _package_edges(GRAPH) if x == a} for a in RANK})


def test_the_rank_check_sees_a_package_circle_and_an_upward_import():
    # Two packages importing each other through modules that form no module circle, and one upward import.
    graph = {
        "alpa_job.settings.validate": {"alpa_job.models.builders"},
        "alpa_job.models.gpt": {"alpa_job.settings.catalog"},
        "alpa_job.api": {"alpa_job.models.losses"},
    }
    assert not _cycles(graph)
    found = _upward(_package_edges(graph))
    assert [line.split(" imports ")[0] for line in found] == ["api (rank 2)", "models (rank 4)", "settings (rank 4)"]
    assert _cycles({a: {b for (x, b) in _package_edges(graph) if x == a} for a in RANK}) == [["models", "settings"]]
