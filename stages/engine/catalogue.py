"""recipes: the catalogue, each recipe with its whole description (its file's leading comment
lines), so a user picks a target without opening every YAML file. `doit recipes`."""
from __future__ import annotations

import textwrap

from stages.engine.project import recipe_names, root

READ = 1 << 16  # the description is the file's first lines: never read a whole (hostile) file for it


def description(name: str) -> str:
    """The recipe file's leading comment lines, joined into one paragraph."""
    with open(root() / "recipes" / f"{name}.yaml", encoding="utf-8-sig", errors="replace") as f:
        head = f.read(READ).splitlines()
    lines = []
    for line in head:
        if not line.startswith("#"):
            break
        lines.append(line.lstrip("#").strip())
    return " ".join(filter(None, lines)) or "(no description)"


def run():
    names = recipe_names()
    width = max(map(len, names), default=0)
    for name in names:
        text = textwrap.wrap(description(name), width=max(40, 100 - width - 2))
        print("\n".join([f"{name:<{width}}  {text[0]}"] + [f"{'':<{width}}  {more}" for more in text[1:]]))


def task():
    return {"actions": [run], "uptodate": [False], "verbosity": 2,
            "doc": "the recipe catalogue: each recipe and what it builds, in full"}
