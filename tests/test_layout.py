"""The layout shows the architecture: the engine imports no stage and no internals, internals
import no stage module, nothing imports in a circle, every row of the stage table names a
module with a build(ctx, out), the engine's parts are layered (a key is computed without the
build, the build without doit's tasks), importing the engine does nothing, every row of the method
table names a method module and a data kind with their parts, and the keys of the stages that read
the method table stay narrow."""
from __future__ import annotations

import ast
import importlib
import os
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import REPO
from stages.engine.inputs import code_files
from stages.table import STAGES
from stages.train.methods import METHODS

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
        if module.split(".")[1:2] in (["data"], ["train"], ["model"], ["inference"], ["view"], ["chain"], ["scoring"]):
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


def test_a_package_init_holds_only_its_docstring():
    """No stage's key covers a package's __init__.py (a key covers modules), so code there would
    shape artifacts unseen."""
    for path in (REPO / "stages").rglob("__init__.py"):
        body = ast.parse(path.read_text()).body
        assert len(body) == 1 and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant), path


KIND_PARTS = ("SIDES", "PACKED", "LEARNS", "BESIDE", "convert", "lines", "tokenize", "heldout_docs", "tasks", "scores")


@pytest.mark.parametrize("method", METHODS)
def test_every_method_row_names_its_module_and_its_data_kind(method):
    row = METHODS[method]
    module = importlib.import_module(row.module)
    assert callable(module.dataset) and callable(module.make_trainer), row.module
    kind = importlib.import_module(row.kind_module)
    assert all(hasattr(kind, part) for part in KIND_PARTS), (row.kind_module, [p for p in KIND_PARTS if not hasattr(kind, p)])
    assert row.head in ("causal_lm", "score") and row.metrics


TOKENIZING = {f"stages/data/{m}.py" for m in ("template", "skeleton", "word_cache", "tiktoken_encoder", "sources",
                                               "cleaning", "shard_writer")}


@pytest.mark.parametrize("method", METHODS)
def test_the_method_table_keeps_each_stage_key_to_the_code_it_runs(method):
    """The plan reads the method table for its step shape, but covers no data code: editing a data
    reader never re-plans. Training covers its method's module and no data kind: a kind's edit
    re-shards, and early cutoff keeps the checkpoint. Eval covers its kind (its held-out scoring)
    but none of the tokenizing code the kind is handed."""
    row = METHODS[method]
    plan = code_files(["stages.plan"])
    assert "stages/train/methods.py" in plan and not [f for f in plan if f.startswith("stages/data/")], plan
    checkpoint = code_files(["stages.checkpoint", row.module])
    assert not [f for f in checkpoint if f.startswith("stages/data/kinds/")], checkpoint
    evaluation = code_files(["stages.eval", row.kind_module])
    assert not TOKENIZING & set(evaluation), TOKENIZING & set(evaluation)
