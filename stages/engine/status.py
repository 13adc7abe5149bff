"""status: `doit status` says of each recipe, in one line, whether it is up to date, stale (the
first stage that is, and why) or not built; `doit status:<recipe>` says it of each stage, in DVC's
manner: what changed among the inputs its key is made of (a recipe field, a data file, its
code, a library version, an upstream artifact, an optional upstream built or gone), against what
the recipe last built, or that a remote cache (MINDXTRAIN_REMOTE) has it. A stage
downstream of a stale one waits on it: it rebuilds only if the upstream's bytes change (early
cutoff), so status does not claim it will. It reads the store; it builds nothing.
"""
from __future__ import annotations

import json
import sys

from stages.engine import keys, remote
from stages.engine.declared import recipe_view
from stages.engine.errors import UserError
from stages.engine.inputs import key_inputs
from stages.engine.project import recipe, recipe_names, recipe_tasks, store
from stages.engine.stage import module


def differences(old, new, path: str = "") -> list[str]:
    """Dotted paths whose values differ between two JSON values, with the values where short."""
    if isinstance(old, dict) and isinstance(new, dict):
        return [d for k in sorted(set(old) | set(new)) for d in differences(old.get(k), new.get(k), f"{path}.{k}" if path else k)]
    if old == new:
        return []
    short = lambda v: json.dumps(v) if len(json.dumps(v)) <= 40 else "..."  # noqa: E731
    return [f"{path} ({short(old)} -> {short(new)})"]


def why(old: dict, new: dict) -> list[str]:
    """What changed between the inputs a key was built from and the current ones, in words."""
    found = []
    for p in differences(old.get("params", {}), new.get("params", {})):
        found.append(f"recipe {p}")
    for name in differences(old.get("extra", {}), new.get("extra", {})):
        found.append(f"{name.split(' ')[0]} changed")
    for name in sorted(set(old.get("code", {})) | set(new.get("code", {}))):
        if old.get("code", {}).get(name) != new.get("code", {}).get(name):
            found.append(f"{name} changed")
    for p in differences(old.get("env", {}), new.get("env", {})):
        found.append(f"version of {p}")
    for up in sorted(set(old.get("upstream", {})) | set(new.get("upstream", {}))):
        if old.get("upstream", {}).get(up) != new.get("upstream", {}).get(up):
            found.append(f"upstream {up} changed")
    for up in sorted(set(old.get("optional", {})) | set(new.get("optional", {}))):
        was, now = old.get("optional", {}).get(up), new.get("optional", {}).get(up)
        if was != now:  # an optional upstream: read where built for this build (inputs.built_for)
            found.append(f"{up} now built" if was is None else
                         f"{up} no longer built for this build" if now is None else f"{up} changed")
    return found or ["its inputs changed"]


def previous_inputs(st, recipe_name: str, stage: str) -> dict | None:
    """The inputs of what the recipe last built for this stage (None if never)."""
    ptr = st.pointer(recipe_name, stage)
    meta = ptr and st.sidecar(stage, ptr["key"])
    return meta and meta["inputs"]


def states(recipe_name: str, table: dict) -> list[tuple[str, str, str]]:
    """Each stage of the recipe, in build order, as (stage, state, what to say of it): state is
    "current" (up to date: in the store as the recipe is now, built for it or for another recipe
    or build, which a build takes as it is), "stale" (it will be built: why), "waits" (on a stale
    upstream: rebuilt only if that one's bytes change), "blocked" (an input is missing: the
    error says which), "remote" (missing here, a remote cache has it) or "on request" (a stage
    after the manifest, such as the report, that the recipe never built: doit manifest does not
    build it, so nothing is amiss). A stage's key is computed from the upstream artifacts found
    current before it, as a build would."""
    st, found, current, stale = store(), [], {}, []
    receipt = {"manifest", *table["manifest"].upstream}
    for name, stage in table.items():
        waits = [up for up in stage.upstream if up in stale]
        try:
            inputs = key_inputs(recipe_name, stage, table, at=current)
        except UserError as e:
            stale.append(name)
            found.append((name, "waits", f"waits on {', '.join(waits)}") if waits else (name, "blocked", str(e)))
            continue
        if waits:
            stale.append(name)
            before = previous_inputs(st, recipe_name, name)  # never built: nothing of its own changed
            own = [r for r in why(before, inputs) if not r.startswith("upstream ") and r != "its inputs changed"] if before else []
            upstream = f"waits on {', '.join(waits)}"
            found.append((name, "stale", f"{'; '.join(own)}; and {upstream}") if own else
                         (name, "waits", upstream) if before is None else
                         (name, "waits", f"{upstream}: rebuilt only if {'its' if len(waits) == 1 else 'their'} bytes change"))
            continue
        key = keys.key_of(inputs)
        ptr, before = st.pointer(recipe_name, name), previous_inputs(st, recipe_name, name)
        if not st.damage(name, key):
            current[name] = key
            found.append((name, "current", "" if ptr and ptr["key"] == key else
                          "an earlier build, or another recipe's, in the store: taken as it is"))
            continue
        stale.append(name)
        if where := remote.present(name, key):
            found.append((name, "remote", f"present in the remote {where}: a build fetches it"))
        elif before is None and name not in receipt:
            found.append((name, "on request", f"not built: doit {name}:{recipe_name}"))
        elif before is None:
            found.append((name, "stale", "never built"))
        elif ptr["key"] == key:
            found.append((name, "stale", f"its artifact in the store is damaged ({st.damage(name, key)[0]})"))
        else:
            found.append((name, "stale", "; ".join(why(before, inputs))))
    return found


def lines(recipe_name: str, table: dict) -> list[str]:
    """`doit status:<recipe>`: each stage, up to date or not, and why."""
    try:
        recipe(recipe_name)
    except UserError as e:  # one line for a recipe that does not load, not one per stage
        return [f"{recipe_name}: cannot build: {e}"]
    words = {"current": "up to date", "stale": "stale: ", "waits": "", "blocked": "cannot build yet: ",
             "remote": "missing from the store, ", "on request": ""}
    return [f"{recipe_name}:"] + [
        f"  {name:<10} {words[state]}{f' ({text})' if state == 'current' and text else text}"
        for name, state, text in states(recipe_name, table)]


def blocked_here(recipe_name: str, table: dict) -> list[str]:
    """What this machine lacks to build the recipe at all, from the stages whose module says
    (blocked_here(recipe): a GPU profile where no GPU is visible), asked of a recipe not built:
    its stages wait on the base, so their own inputs are not computed yet."""
    full, built = recipe(recipe_name), ("manifest", *table["manifest"].upstream)  # what doit manifest builds
    return [why for name in built if hasattr(module(table[name]), "blocked_here")
            and (why := module(table[name]).blocked_here(recipe_view(full, table[name].params, name)))]


def line(recipe_name: str, table: dict) -> str:
    """`doit status`: the recipe in one line. Up to date where every stage `doit manifest` builds
    is (and every stage built on request before, such as the report); not built where the recipe
    has built nothing yet; else stale, with the first stage that is not and why (status:<recipe>
    has the rest)."""
    try:
        recipe(recipe_name)
    except UserError as e:
        return f"{recipe_name}: cannot build: {e}"
    st = store()
    built = {name for name in table if st.pointer(recipe_name, name)}
    wanted = {"manifest", *table["manifest"].upstream} | built  # and what was built on request
    first = next(((name, state, text) for name, state, text in states(recipe_name, table)
                  if name in wanted and state != "current"), None)
    if first is None:
        return f"{recipe_name}: up to date"
    name, state, text = first
    if state == "blocked":
        return f"{recipe_name}: cannot build: {text}"
    if not built:
        return f"{recipe_name}: not built" + "".join(f"; cannot build here: {why}" for why in blocked_here(recipe_name, table)[:1])
    if state == "remote":
        return f"{recipe_name}: stale: {name} is in the remote cache, not here: a build fetches it"
    return f"{recipe_name}: stale: {name}: {text.split('; ')[0]}"


def run(recipe_name: str, table: dict):
    print("\n".join(lines(recipe_name, table)))


def overview(table: dict):
    for name in recipe_names():
        print(line(name, table))
    print("doit status:<recipe> shows each of its stages, and why one is not up to date")


def tasks(table: dict):
    """`doit status` prints one line per recipe (the task status:+all, which no recipe can be
    named); `doit status:<recipe>` each stage of one. Unless named on the command line, a
    recipe's task does nothing, so that plain `doit status` prints only the overview."""
    named = {arg.split(":", 1)[1] for arg in sys.argv[1:] if arg.startswith("status:")}
    yield from recipe_tasks("status", "each recipe up to date, stale (and why) or not built; status:<recipe> "
                                      "for each of its stages",
                            lambda name: {"actions": [(run, [name, table])] if name in named else []})
    yield {"basename": "status", "name": "+all", "actions": [(overview, [table])], "uptodate": [False],
           "verbosity": 2}
