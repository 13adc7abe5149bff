"""check: warnings before a wasted run, an action run before training (not an artifact).

After the shards are built and before the checkpoint trains, `doit check:<recipe>` reads the
shards' stats and the recipe's training shape and says, in one loud line each, what would
waste the run: most of the rows dropped (a max_length far too short drops them as too long),
or so few training sequences that the requested steps go over them many times. With
checks.as_errors the build stops there. Skipped when the checkpoint is already built.
"""
from __future__ import annotations

from doit.exceptions import TaskFailed

from stages.engine import jsontext, project
from stages.engine.build import is_built


def warnings(recipe, stats: dict, recipe_name: str) -> list[str]:
    c, t, data = recipe.checks, recipe.train, recipe.data
    found = []
    rows_in, dropped = stats["rows_in_total"], sum(stats["dropped"].values())
    if rows_in and dropped / rows_in > c.max_dropped_fraction:
        reasons = ", ".join(f"{r} {n}" for r, n in sorted(stats["dropped"].items(), key=lambda x: -x[1]))
        fix = (f"raise data.max_length ({data.max_length}) or set data.truncation: truncate"
               if stats["dropped"].get("too_long", 0) >= dropped / 2 else "see which rows and why")
        found.append(f"data: {dropped} of {rows_in} rows ({dropped / rows_in:.0%}) were dropped ({reasons}), over "
                     f"checks.max_dropped_fraction {c.max_dropped_fraction}: {fix} "
                     f"(artifacts/{recipe_name}/latest/shards/dropped.jsonl lists them)")
    sequences = stats.get("sequences", stats["kept"]["train"])
    epochs = t.max_steps * t.global_batch / max(sequences, 1)
    if epochs > c.max_epochs:
        found.append(f"train: {t.max_steps} steps of {t.global_batch} sequences go over the {sequences} training "
                     f"sequences {epochs:.0f} times, over checks.max_epochs {c.max_epochs:g}: add data, lower "
                     f"train.max_steps, or keep more rows (data.max_length, data.truncation)")
    return found


def run(recipe_name: str):
    st = project.store()
    ptr = st.pointer(recipe_name, "shards")
    stats = jsontext.read(st.path("shards", ptr["key"]) / "stats.json")
    r = project.recipe(recipe_name)
    found = warnings(r, stats, recipe_name)
    if found and r.checks.as_errors:
        return TaskFailed("\n".join(f"check: {line}; checks.as_errors is set" for line in found))
    for line in found:
        print(f"WARNING: {line}", flush=True)
    return None


def tasks(table: dict):
    return project.recipe_tasks("check", "warnings before a wasted training run", lambda name: {
        "actions": [(run, [name])], "task_dep": [f"shards:{name}", f"plan:{name}"],
        "uptodate": [(is_built, [name, table["checkpoint"], table])]})
