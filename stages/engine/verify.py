"""verify: re-hash every file of every artifact a manifest names and compare.

`doit verify` checks every recipe that has been built, `doit verify:tiny` one
(and fails if it has no manifest). By default the stat cache answers for files whose
(size, mtime, ctime, inode) are unchanged; `--full` (or MINDXTRAIN_VERIFY_FULL=1) re-reads
every byte. A stage after the manifest whose module has verify(recipe, artifact, digest) checks
the receipt against the world too (anchor: the digest recorded on chain must be this
manifest's, computed from its bytes), wherever the recipe has built it.
"""
from __future__ import annotations

import json
import os
import sys

from doit.exceptions import TaskFailed

from stages.engine import graph
from stages.engine.declared import recipe_view
from stages.engine.errors import UserError
from stages.engine.store import hash_file, list_files, merkle


def problems(recipe_name: str, full: bool) -> list[str]:
    """One line per difference between the store and the recipe's manifest ([] when intact)."""
    st = graph.store()
    ptr = st.pointer(recipe_name, "manifest")
    if ptr is None:
        return [f"{recipe_name}: no manifest; run doit manifest:{recipe_name}"]
    found = [f"{recipe_name}: manifest: {p}" for p in st.damage("manifest", ptr["key"], full=full)]
    if found:
        return found
    manifest = json.loads((st.path("manifest", ptr["key"]) / "manifest.json").read_text())
    for stage, art in manifest["artifacts"].items():
        found += [f"{recipe_name}: {stage}: {p}"
                  for p in st.damage(stage, art["key"], full=full, files=art["files"])]
    return found


def outside_checks(recipe_name: str, table: dict, full: bool) -> tuple[list[str], list[str]]:
    """(problems, notes) of the stages built after the manifest that check it against the world:
    each one's artifact re-hashed, then its module's verify(recipe, artifact, digest), given the
    manifest's digest computed from its bytes (not from the store's record of them)."""
    st, found, notes = graph.store(), [], []
    ptr = st.pointer(recipe_name, "manifest")
    obj = st.path("manifest", ptr["key"])
    try:
        covered = set(json.loads((obj / "manifest.json").read_text())["artifacts"]) | {"manifest"}
    except (OSError, ValueError, KeyError, TypeError):
        return [], []  # no manifest to check against the world (the store's checks say why)
    digest = merkle({rel: hash_file(obj / rel) for rel in list_files(obj)})
    for name, stage in table.items():
        own = st.pointer(recipe_name, name)
        check = own and name not in covered and getattr(graph.module(stage), "verify", None)
        if not check:
            continue
        damage = [f"{recipe_name}: {name}: {p}" for p in st.damage(name, own["key"], full=full)]
        if damage:
            found += damage
            continue
        try:
            view = recipe_view(graph.recipe(recipe_name), stage.params + stage.settings, name)
            bad, note = check(view, st.path(name, own["key"]), digest)
        except UserError as e:
            bad, note = [str(e)], None
        found += [f"{recipe_name}: {name}: {line}" for line in bad]
        notes += [f"{recipe_name}: {name}: {note}"] if note and not bad else []
    return found, notes


def run(recipe_name: str, required: bool, table: dict, full: bool):
    full = full or os.environ.get("MINDXTRAIN_VERIFY_FULL") == "1"
    if not required and graph.store().pointer(recipe_name, "manifest") is None:
        print(f"verify: {recipe_name}: never built, nothing to check")
        return None
    found = problems(recipe_name, full)
    outside, notes = outside_checks(recipe_name, table, full) if graph.store().pointer(recipe_name, "manifest") else ([], [])
    if found or outside:
        return TaskFailed("\n".join(f"verify: {line}" for line in found + outside))
    print(f"verify: {recipe_name}: intact ({'every byte re-read' if full else 'stat cache'})")
    for note in notes:
        print(f"verify: {note}")


def tasks(table: dict):
    # `doit verify` checks every recipe that has been built; naming one
    # (`doit verify:tiny_lora`) requires its manifest to exist.
    named = {arg.split(":", 1)[1] for arg in sys.argv[1:] if arg.startswith("verify:")}
    yield {"basename": "verify", "name": None, "doc": "re-hash every artifact against its manifest"}
    for name in graph.recipe_names():
        yield {
            "name": name,
            "actions": [(run, [name, name in named, table])],
            "params": [{"name": "full", "long": "full", "type": bool, "default": False,
                        "help": "re-read every byte instead of trusting the stat cache"}],
            "uptodate": [False],
            "verbosity": 2,
        }
