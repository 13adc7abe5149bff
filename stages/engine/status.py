"""status: for each recipe, each stage up to date or stale, and for a stale one why, in DVC's
manner: what changed among the inputs its key is made of (a recipe field, a data file, its
code, a library version, an upstream artifact, an optional upstream built or gone), against what
the recipe last built, or that a remote cache (MINDXTRAIN_REMOTE) has it. A stage
downstream of a stale one waits on it: it rebuilds only if the upstream's bytes change (early
cutoff), so status does not claim it will. It reads the store; it builds nothing.
"""
from __future__ import annotations

import json

from stages.engine import keys, remote
from stages.engine.errors import UserError
from stages.engine.inputs import key_inputs
from stages.engine.project import recipe, recipe_tasks, store


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


def lines(recipe_name: str, table: dict) -> list[str]:
    try:
        recipe(recipe_name)
    except UserError as e:  # one line for a recipe that does not load, not one per stage
        return [f"{recipe_name}: cannot build: {e}"]
    st, out, stale = store(), [f"{recipe_name}:"], []
    for name, stage in table.items():
        waits = [up for up in stage.upstream if up in stale]
        try:
            inputs = key_inputs(recipe_name, stage, table)
        except UserError as e:
            stale.append(name)
            out.append(f"  {name:<10} " + (f"waits on {', '.join(waits)}" if waits else f"cannot build yet: {e}"))
            continue
        if waits:
            stale.append(name)
            own = [r for r in why(previous_inputs(st, recipe_name, name) or {}, inputs) if not r.startswith("upstream ")
                   and r != "its inputs changed"]
            upstream = f"waits on {', '.join(waits)}"
            out.append(f"  {name:<10} stale: {'; '.join(own)}; and {upstream}" if own else
                       f"  {name:<10} {upstream}: rebuilt only if {'its' if len(waits) == 1 else 'their'} bytes change")
            continue
        key = keys.key_of(inputs)
        if not st.damage(name, key):
            ptr = st.pointer(recipe_name, name)
            again = "" if ptr and ptr["key"] == key else " (an earlier build, in the store: reused as it is)"
            out.append(f"  {name:<10} up to date{again}")
            continue
        stale.append(name)
        ptr, before = st.pointer(recipe_name, name), previous_inputs(st, recipe_name, name)
        if where := remote.present(name, key):
            out.append(f"  {name:<10} missing from the store, present in the remote {where}: "
                       f"a build fetches it")
        elif before is None:
            out.append(f"  {name:<10} stale: never built")
        elif ptr["key"] == key:
            out.append(f"  {name:<10} stale: its artifact in the store is damaged ({st.damage(name, key)[0]})")
        else:
            out.append(f"  {name:<10} stale: {'; '.join(why(before, inputs))}")
    return out


def run(recipe_name: str, table: dict):
    print("\n".join(lines(recipe_name, table)))


def tasks(table: dict):
    return recipe_tasks("status", "each stage up to date or stale, and why",
                        lambda name: {"actions": [(run, [name, table])]})
