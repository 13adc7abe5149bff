"""The project doit runs in: its directory, its recipes (recipes/*.yaml) and its store
(artifacts/).

doit changes to dodo.py's directory before it loads dodo.py, so the project is the working
directory when first asked for; nothing here runs at import.
"""
from __future__ import annotations

import functools
from pathlib import Path

from doit.exceptions import InvalidDodoFile

from stages.engine.errors import UserError
from stages.engine.recipe import Recipe, check_name, load
from stages.engine.store import Store


def root() -> Path:
    """The project's directory: where recipes/ and artifacts/ are."""
    return Path.cwd()


def recipe_names() -> list[str]:
    """The recipes of recipes/*.yaml; a file whose name cannot be a recipe name stops doit with
    one line before any task runs."""
    try:
        return sorted(check_name(p.relative_to(root())) for p in (root() / "recipes").glob("*.yaml"))
    except UserError as e:
        raise InvalidDodoFile(str(e)) from None


@functools.lru_cache(maxsize=None)
def recipe(name: str) -> Recipe:
    """recipes/<name>.yaml, loaded once per process: the recipe cannot drift while doit runs."""
    return load(Path("recipes") / f"{name}.yaml")


@functools.lru_cache(maxsize=None)
def store() -> Store:
    """The project's store, artifacts/ (one per process: its stat cache stays open)."""
    return Store(root() / "artifacts")

