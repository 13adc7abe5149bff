"""verify: re-hash every file of every artifact a manifest names and compare.

Then the receipt must be self-consistent: every key it names the hash of the inputs it records,
those its own recipe and upstream digests, and manifest.json what the manifest stage makes of
them (stages/engine/receipt.py), so an edit with the store's record of the bytes recomputed fails.

`doit verify` checks every recipe that has been built, goes on past one that fails, and fails at
the end with a count of them; `doit verify:tiny` checks one (and fails if it has no manifest).
By default the stat cache answers for files whose (size, mtime, ctime, inode) are unchanged;
`--full` (or MINDXTRAIN_VERIFY_FULL=1) re-reads every byte. A stage after the manifest whose
module has verify() checks the receipt against the world too (anchor: a recipe that pins a
registry must have this manifest's digest, computed from its bytes, anchored there by a trusted
account). With no node to ask, that check says the chain was not checked; `--require-anchor`
(or MINDXTRAIN_VERIFY_REQUIRE_ANCHOR=1) makes it a failure.
"""
from __future__ import annotations

import os
import sys

from doit.exceptions import TaskFailed

from stages.engine import jsontext, receipt
from stages.engine.declared import recipe_view
from stages.engine.errors import UserError
from stages.engine.project import recipe, recipe_names, recipe_tasks, root, store
from stages.engine.stage import module
from stages.engine.store import hash_file, list_files, merkle


def problems(recipe_name: str, full: bool, table: dict) -> list[str]:
    """One line per difference between the store and the recipe's manifest ([] when intact)."""
    st = store()
    ptr = st.pointer(recipe_name, "manifest")
    if ptr is None:
        return [f"{recipe_name}: no manifest; run doit manifest:{recipe_name}"]
    found = [f"{recipe_name}: manifest: {p}" for p in st.damage("manifest", ptr["key"], full=full)]
    if found:
        return found
    try:
        manifest = jsontext.read(st.path("manifest", ptr["key"]) / "manifest.json")
    except ValueError:  # not JSON, or nested deeper than jsontext lets the parser go
        return [f"{recipe_name}: manifest: manifest.json is not JSON; rebuild it (doit manifest:{recipe_name})"]
    shape = receipt.shape_problem(manifest, table)
    if shape:
        return [f"{recipe_name}: manifest: {shape}"]
    for stage, art in manifest["artifacts"].items():
        found += [f"{recipe_name}: {stage}: {p}"
                  for p in st.damage(stage, art["key"], full=full, files=art["files"])]
    return found


def self_consistent(recipe_name: str, table: dict) -> tuple[list[str], list[str]]:
    """(problems, notes) of the receipt itself: every key it names is what its recorded inputs
    hash to, and those are its recipe and upstream digests (stages/engine/receipt.py)."""
    key = store().pointer(recipe_name, "manifest")["key"]
    text = (store().path("manifest", key) / "manifest.json").read_text()
    found, notes = receipt.problems(recipe_name, key, text, table)
    return [f"{recipe_name}: {line}" for line in found], [f"{recipe_name}: {line}" for line in notes]


def outside_checks(recipe_name: str, table: dict, full: bool, require_anchor: bool) -> tuple[list[str], list[str]]:
    """(problems, notes) of the stages after the manifest that check it against the world: each
    one's artifact re-hashed where the recipe has one, then its module's verify(), given the
    artifact (None where there is none: whether that is a problem is the module's to say) and
    the manifest's digest computed from its bytes (not from the store's record of them)."""
    st, found, notes = store(), [], []
    ptr = st.pointer(recipe_name, "manifest")
    obj = st.path("manifest", ptr["key"])
    try:
        covered = set(jsontext.read(obj / "manifest.json")["artifacts"]) | {"manifest"}
    except (OSError, ValueError, KeyError, TypeError):
        return [], []  # no manifest to check against the world (the store's checks say why)
    digest = merkle({rel: hash_file(obj / rel) for rel in list_files(obj)})
    for name, stage in table.items():
        check = name not in covered and getattr(module(stage), "verify", None)
        if not check:
            continue
        own = st.pointer(recipe_name, name)
        damage = [f"{recipe_name}: {name}: {p}" for p in st.damage(name, own["key"], full=full)] if own else []
        if damage:
            found += damage
            continue
        try:
            view = recipe_view(recipe(recipe_name), stage.params + stage.settings, name)
            artifact = own and st.path(name, own["key"])
            bad, note = check(view, recipe_name=recipe_name, root=root(), artifact=artifact, digest=digest,
                              require_anchor=require_anchor)
        except UserError as e:
            bad, note = [str(e)], None
        found += [f"{recipe_name}: {name}: {line}" for line in bad]
        notes += [f"{recipe_name}: {name}: {note}"] if note and not bad else []
    return found, notes


def run(recipe_name: str, named: bool, table: dict, full: bool, require_anchor: bool):
    """verify:<recipe>'s action. Named on the command line, it fails on a problem (and on a
    recipe never built); under plain `doit verify` it prints the problems and records the
    outcome instead, so that every recipe is checked and the last task fails with the count."""
    full = full or os.environ.get("MINDXTRAIN_VERIFY_FULL") == "1"
    require_anchor = require_anchor or os.environ.get("MINDXTRAIN_VERIFY_REQUIRE_ANCHOR") == "1"
    if not named and store().pointer(recipe_name, "manifest") is None:
        print(f"verify: {recipe_name}: never built, nothing to check")
        return {"outcome": "never built"}
    found, notes = problems(recipe_name, full, table), []
    if not found:  # the receipt's bytes are intact: is it self-consistent, and anchored where it should be
        found, notes = self_consistent(recipe_name, table)
    outside = []
    if not found:
        outside, more = outside_checks(recipe_name, table, full, require_anchor)
        notes += more
    if found or outside:
        lines = "\n".join(f"verify: {line}" for line in found + outside)
        if named:
            return TaskFailed(lines)
        print(lines)
        return {"outcome": "failed"}
    print(f"verify: {recipe_name}: intact ({'every byte re-read' if full else 'stat cache'})")
    for note in notes:
        print(f"verify: {note}")
    return {"outcome": "intact"}


def count(**outcomes):
    """The last task of plain `doit verify`: one line, failing if any recipe failed."""
    failed = sorted(name for name, outcome in outcomes.items() if outcome == "failed")
    built = sum(outcome != "never built" for outcome in outcomes.values())
    recipes = f"{built} built recipe{'s' if built != 1 else ''}"
    if failed:
        return TaskFailed(f"verify: {len(failed)} of {recipes} failed ({', '.join(failed)}); their lines are above")
    print(f"verify: {recipes} intact" if built else "verify: no recipe is built yet")


def tasks(table: dict):
    # `doit verify` checks every recipe that has been built, then counts the failures
    # (verify:+all, a name no recipe can have); naming one (`doit verify:tiny_lora`) requires its
    # manifest to exist and fails at once.
    named = {arg.split(":", 1)[1] for arg in sys.argv[1:] if arg.startswith("verify:")}
    yield from recipe_tasks("verify", "re-hash every artifact against its manifest", lambda name: {
        "actions": [(run, [name, name in named, table])],
        "params": [{"name": "full", "long": "full", "type": bool, "default": False,
                    "help": "re-read every byte instead of trusting the stat cache"},
                   {"name": "require_anchor", "long": "require-anchor", "type": bool, "default": False,
                    "help": "fail, instead of saying so, where an anchored recipe's chain cannot be read"}],
    })
    yield {
        "basename": "verify",
        "name": "+all",
        "actions": [count],
        "getargs": {name: (f"verify:{name}", "outcome") for name in recipe_names()},
        "uptodate": [False],
        "verbosity": 2,
    }
