"""show: what the current build of a recipe is, where its files are, and what they say.

`doit show:tiny` prints, per stage, the key and digest the recipe resolves to and the readable
path of the artifact (artifacts/<recipe>/latest/<stage>/), with the few lines a person looks
for that its stage module's summary(path) gives (eval scores, drops, the loss curve's ends).
It reads the pointers and the store only; it builds nothing.
"""
from __future__ import annotations

from stages.engine.project import recipe_tasks, store
from stages.engine.stage import module


def lines(recipe_name: str, table: dict) -> list[str]:
    st = store()
    out = [f"{recipe_name}: recipes/{recipe_name}.yaml"]
    for name, stage in table.items():
        ptr = st.pointer(recipe_name, name)
        if ptr is None or st.sidecar(name, ptr["key"]) is None:
            out.append(f"  {name:<10} not built: doit {name}:{recipe_name}")
            continue
        seconds = (st.sidecar(name, ptr["key"]).get("run") or {}).get("seconds")
        took = f", built in {seconds:.1f}s" if seconds is not None else ""
        out.append(f"  {name:<10} key {ptr['key'][:12]}  digest {ptr['digest'][:12]}  "
                   f"artifacts/{recipe_name}/latest/{name}/{took}")
        summary = getattr(module(stage), "summary", None)
        if summary is not None:
            out += [f"{'':13}{line}" for line in summary(st.path(name, ptr["key"]))]
    return out


def run(recipe_name: str, table: dict):
    print("\n".join(lines(recipe_name, table)))


def tasks(table: dict):
    return recipe_tasks("show", "where the current build of a recipe is and what it says",
                        lambda name: {"actions": [(run, [name, table])]})
