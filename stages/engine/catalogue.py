"""recipes: the catalogue, one line per recipe (its name and its file's first comment line), so
a user picks a target without opening every YAML file. `doit recipes`."""
from __future__ import annotations

from stages.engine.project import recipe_names, root


def describe(name: str) -> str:
    first = (root() / "recipes" / f"{name}.yaml").read_text().splitlines()[:1]
    return first[0].lstrip("# ").strip() if first and first[0].startswith("#") else "(no description)"


def run():
    names = recipe_names()
    width = max(map(len, names), default=0)
    print("\n".join(f"{n:<{width}}  {describe(n)}" for n in names))


def task():
    return {"actions": [run], "uptodate": [False], "verbosity": 2,
            "doc": "the recipe catalogue: each recipe and what it builds, one line each"}
