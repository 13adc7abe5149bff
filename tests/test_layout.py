"""The layout shows the architecture: the engine imports no stage and no internals, internals
import no stage module, nothing imports in a circle, every row of the stage table names a
module with a build(ctx, out), the engine's parts are layered (a key is computed without the
build, the build without doit's tasks), and importing the engine does nothing."""
from __future__ import annotations

import ast
import importlib
import os
import subprocess
import sys
from pathlib import Path

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


# The engine's parts, each importing only those before it: what a key is made of is read without
# building anything, a build runs without doit's tasks or console, and dodo.py alone takes those.
ENGINE_LAYERS = ["stages.engine.stage", "stages.engine.project", "stages.engine.inputs", "stages.engine.build",
                 "stages.engine.console", "stages.engine.tasks"]


def test_the_engine_parts_import_only_the_parts_before_them():
    graph = imports()
    for i, module in enumerate(ENGINE_LAYERS):
        assert not graph[module] & set(ENGINE_LAYERS[i:]), (module, graph[module] & set(ENGINE_LAYERS[i:]))
    for module, deps in graph.items():  # doit's tasks and console are dodo.py's
        assert module in ENGINE_LAYERS or not deps & {"stages.engine.tasks", "stages.engine.console"}, module


ENGINE_MODULES = sorted(f"stages.engine.{p.stem}" for p in (REPO / "stages" / "engine").glob("*.py"))
IMPORT_ALL = "import importlib, sys; [importlib.import_module(m) for m in sys.argv[1:]]"


def import_engine(cwd: Path, first: str = "") -> subprocess.CompletedProcess:
    """Every engine module imported in a fresh interpreter working in cwd, after running `first`."""
    return subprocess.run([sys.executable, "-c", f"{first}; {IMPORT_ALL}" if first else IMPORT_ALL, *ENGINE_MODULES],
                          cwd=cwd, env={**os.environ, "PYTHONPATH": str(REPO)}, capture_output=True, text=True)


def test_importing_the_engine_writes_nothing(tmp_path):
    """Whatever imports the engine (a test, a benchmark, a notebook) leaves the directory it runs
    in as it was: artifacts/, where doit keeps its DB, is made by dodo.py asking for DOIT_CONFIG."""
    run = import_engine(tmp_path)
    assert run.returncode == 0, run.stderr
    assert not list(tmp_path.iterdir())


def test_importing_the_engine_reads_no_working_directory(tmp_path):
    """The project is the directory doit runs in when a task asks for it, not the one some
    earlier import ran in: with the working directory gone, every engine module still imports."""
    run = import_engine(tmp_path, first="import os; os.rmdir(os.getcwd())")
    assert run.returncode == 0, run.stderr
