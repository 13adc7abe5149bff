"""What a stage's key is made of: the recipe fields it declares, the digests of the upstream
files it declares, its code, the versions of its libraries, and what its module's extra_inputs
adds. Nothing here builds, stores or sets a pointer: these functions read the recipe, the store
and the source files (the store's stat cache remembers what it hashed), and
stages/engine/keys.py hashes what they return.
"""
from __future__ import annotations

import ast
import functools
import importlib.metadata
import platform
from pathlib import Path

from stages.engine import keys
from stages.engine.declared import recipe_view
from stages.engine.errors import RecipeError, UserError
from stages.engine.project import located, recipe, root, store
from stages.engine.recipe import Recipe
from stages.engine.stage import Stage, module
from stages.engine.store import hash_file, merkle, select

CODE_ROOT = Path(__file__).resolve().parents[2]  # the directory that holds the stages package


def source_file(module_name: str) -> Path | None:
    """The file of a stages module (None for a package or a name that is not a module)."""
    path = CODE_ROOT.joinpath(*module_name.split(".")).with_suffix(".py")
    return path if path.is_file() else None


@functools.lru_cache(maxsize=None)
def imported(module_name: str) -> tuple[str, ...]:
    """The stages modules one module imports (anywhere in it: imports inside functions count)."""
    found = set()
    for node in ast.walk(ast.parse(source_file(module_name).read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "stages":
            for name in [node.module] + [f"{node.module}.{a.name}" for a in node.names]:
                if source_file(name):  # `from stages.data import packed` names a module too
                    found.add(name)
    return tuple(sorted(found))


def code_files(module_names) -> dict[str, str]:
    """The code a stage runs: its module, the modules a recipe makes it run (a training
    method's), and every stages module these import, transitively; path -> BLAKE3. A module it
    does not import never changes its key."""
    found, todo = set(), list(module_names)
    while todo:
        name = todo.pop()
        if name not in found:
            found.add(name)
            todo += imported(name)
    return {source_file(m).relative_to(CODE_ROOT).as_posix(): hash_file(source_file(m)) for m in sorted(found)}


def versions(packages) -> dict[str, str]:
    """Installed versions ("python" is the interpreter's)."""
    return {p: platform.python_version() if p == "python" else importlib.metadata.version(p) for p in packages}


def resolved(recipe_name: str, stage: Stage, up: str, at: dict[str, str] | None, what: str = "upstream ") -> tuple[str, dict]:
    """The key and sidecar of the `up` artifact `stage` reads for the recipe: the key `at` names
    for it, else the recipe's pointer's. Raises UserError where it is not built."""
    st = store()
    key = (at or {}).get(up) or (st.pointer(recipe_name, up) or {}).get("key")
    meta = key and st.sidecar(up, key)
    if not meta:
        raise UserError(f"{stage.name}:{recipe_name}: {what}{up} is not built; run doit {up}:{recipe_name}")
    return key, meta


def upstream_artifacts(recipe_name: str, stage: Stage, table: dict[str, Stage],
                       at: dict[str, str] | None = None) -> dict[str, dict]:
    """Each upstream artifact the recipe resolves to: key, digest, and the files the stage
    declares it reads. A required upstream not built raises UserError; an optional one is
    there only where it is built for this build (built_for). `at` names keys to take for some
    upstream stages instead of the recipe's pointers: those status found current in the store,
    which a build would take (and point the recipe at) without building them."""
    found = {}
    for up, patterns in stage.upstream.items():
        key, meta = resolved(recipe_name, stage, up, at)
        found[up] = {"key": key, "digest": meta["digest"], "files": select(meta["files"], patterns),
                     "inputs": meta["inputs"]}
    for up, patterns in stage.optional.items():
        built = built_for(recipe_name, table[up], table)
        if built is not None:
            found[up] = dict(built, files=select(built["files"], patterns))
    return found


def upstream_digests(stage: Stage, artifacts: dict[str, dict]) -> dict:
    """What a key holds of the upstream artifacts: the digest of the declared files of each, and
    for each optional upstream that digest or None (absent), so that its appearing changes the key."""
    found = {"upstream": {up: merkle(artifacts[up]["files"]) for up in stage.upstream}}
    if stage.optional:
        found["optional"] = {up: merkle(artifacts[up]["files"]) if up in artifacts else None for up in stage.optional}
    return found


def built_for(recipe_name: str, stage: Stage, table: dict[str, Stage]) -> dict | None:
    """The stage's artifact the recipe points at (key, digest, files) if it is intact and was
    built from the upstream artifacts the recipe resolves to now, else None: an anchor of an
    earlier manifest is not this build's. It reads the store only, never the stage's
    extra_inputs (the anchor's ask a chain), so a downstream key needs no network."""
    st = store()
    ptr = st.pointer(recipe_name, stage.name)
    meta = ptr and st.sidecar(stage.name, ptr["key"])
    if meta is None or st.damage(stage.name, ptr["key"]):
        return None
    try:
        now = upstream_digests(stage, upstream_artifacts(recipe_name, stage, table))
    except UserError:
        return None
    if any(meta["inputs"].get(part) != digests for part, digests in now.items()):
        return None
    return {"key": ptr["key"], "digest": meta["digest"], "files": meta["files"], "inputs": meta["inputs"]}


def key_inputs(recipe_name: str, stage: Stage, table: dict[str, Stage], full: Recipe | None = None,
               artifacts: dict[str, dict] | None = None, at: dict[str, str] | None = None) -> dict:
    """Everything a stage's output depends on, which is all its build may read: the recipe
    fields it declares, the digests of the upstream files it declares (and which optional
    upstreams are absent), its code, the versions of its libraries, and what its module's
    extra_inputs adds (data files' content, device facts). `full` is the recipe (by default
    recipes/<recipe_name>.yaml); `artifacts` the upstream artifacts (by default as
    upstream_artifacts finds them, taking the keys in `at` where given: a build passes those it
    will read). Raises UserError if an input is missing."""
    full = full or recipe(recipe_name)
    r, mod = recipe_view(full, stage.params, stage.name), module(stage)
    artifacts = artifacts if artifacts is not None else upstream_artifacts(recipe_name, stage, table, at)
    inputs = {
        "stage": stage.name,
        "code": code_files([stage.module, *(mod.code_modules(r) if hasattr(mod, "code_modules") else [])]),
        "params": {p: keys.recipe_slice(full, p) for p in stage.params},
        **upstream_digests(stage, artifacts),
        "env": versions(stage.packages),
    }
    if stage.records_keys:
        inputs["upstream_keys"] = {up: artifacts[up]["key"] for up in stage.upstream}
    if hasattr(mod, "extra_inputs"):  # e.g. data files, device facts
        try:
            inputs["extra"] = mod.extra_inputs(r, root(), store())
        except RecipeError as e:
            raise located(recipe_name, e) from None
    if stage.runs:  # measurements are not content, but a stage that shows them depends on them
        inputs["runs"] = {up: resolved(recipe_name, stage, up, at, what="")[1]["run"] for up in stage.runs}
    return inputs
