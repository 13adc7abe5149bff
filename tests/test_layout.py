"""The layout shows the architecture: the engine imports no stage and no internals, internals
import no stage module, nothing imports in a circle, and every row of the stage table names a
module with a build(ctx, out)."""
from __future__ import annotations

import ast
import importlib

from conftest import REPO
from stages.table import STAGES

STAGE_MODULES = {row.module for row in STAGES.values()}


def imports() -> dict[str, set[str]]:
    """Every stages module -> the stages modules it imports (anywhere in it)."""
    found = {}
    for path in (REPO / "stages").rglob("*.py"):
        name = ".".join(path.relative_to(REPO).with_suffix("").parts).removesuffix(".__init__")
        deps = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("stages"):
                deps |= {node.module} | {f"{node.module}.{a.name}" for a in node.names}
        found[name] = deps
    return {m: {d for d in deps if d in found and d != m} for m, deps in found.items()}


def test_imports_go_one_way():
    graph = imports()
    for module, deps in graph.items():
        if module.startswith("stages.engine"):
            assert all(d.startswith("stages.engine") for d in deps), (module, deps)
        if module.split(".")[1:2] in (["data"], ["train"], ["model"], ["serving"], ["view"], ["chain"], ["scoring"]):
            assert not deps & STAGE_MODULES and "stages.table" not in deps, (module, deps)
    for module in STAGE_MODULES:
        assert not graph[module] & STAGE_MODULES, module  # a stage uses internals, not another stage


def test_no_import_circles():
    graph = imports()
    state: dict[str, str] = {}

    def visit(m, trail):
        state[m] = "open"
        for d in graph[m]:
            assert state.get(d) != "open", " -> ".join(trail + [m, d])
            if d not in state:
                visit(d, trail + [m])
        state[m] = "done"

    for m in graph:
        if m not in state:
            visit(m, [])


def test_every_stage_row_names_a_module_with_a_build_and_reads_rows_above_it():
    above = set()
    for row in STAGES.values():
        assert callable(importlib.import_module(row.module).build), row.module
        # the table is in build order, so nothing reads in a circle: not even through an optional
        # upstream, which doit never sees (it is no task_dep)
        assert set(row.upstream) | set(row.optional) <= above, row
        above.add(row.name)
