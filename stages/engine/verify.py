"""verify: re-hash every file of every artifact a manifest names and compare.

`doit verify` checks every recipe that has been built, `doit verify:tiny` one
(and fails if it has no manifest). By default the stat cache answers for files whose
(size, mtime, ctime, inode) are unchanged; `--full` (or MINDXTRAIN_VERIFY_FULL=1) re-reads
every byte.
"""
from __future__ import annotations

import json
import os
import sys

from doit.exceptions import TaskFailed

from stages.engine import graph


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


def run(recipe_name: str, required: bool, full: bool):
    full = full or os.environ.get("MINDXTRAIN_VERIFY_FULL") == "1"
    if not required and graph.store().pointer(recipe_name, "manifest") is None:
        print(f"verify: {recipe_name}: never built, nothing to check")
        return None
    found = problems(recipe_name, full)
    if found:
        return TaskFailed("\n".join(f"verify: {line}" for line in found))
    print(f"verify: {recipe_name}: intact ({'every byte re-read' if full else 'stat cache'})")


def tasks():
    # `doit verify` checks every recipe that has been built; naming one
    # (`doit verify:tiny_lora`) requires its manifest to exist.
    named = {arg.split(":", 1)[1] for arg in sys.argv[1:] if arg.startswith("verify:")}
    yield {"basename": "verify", "name": None, "doc": "re-hash every artifact against its manifest"}
    for name in graph.recipe_names():
        yield {
            "name": name,
            "actions": [(run, [name, name in named])],
            "params": [{"name": "full", "long": "full", "type": bool, "default": False,
                        "help": "re-read every byte instead of trusting the stat cache"}],
            "uptodate": [False],
            "verbosity": 2,
        }
