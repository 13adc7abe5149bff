"""The project doit runs in: its directory, its recipes (recipes/*.yaml), its store
(artifacts/), and the per-recipe tasks every verb makes of them.

doit changes to dodo.py's directory before it loads dodo.py, so the project is the working
directory when first asked for; nothing here runs at import.
"""
from __future__ import annotations

import functools
from pathlib import Path

from doit.exceptions import InvalidDodoFile

from stages.engine.errors import RecipeError, UserError
from stages.engine.recipe import Recipe, check_name, load, where
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


def located(recipe_name: str, error: Exception) -> Exception:
    """A stage's RecipeError as the recipe file's path and the key's line, the key, and the problem
    (recipes/tiny.yaml:17: data.sources.0.path: ... not found; ...), as the schema's errors read;
    any other error as it is."""
    if not isinstance(error, RecipeError):
        return error
    return UserError(f"{where(Path('recipes') / f'{recipe_name}.yaml', error.key)}: {error.key}: {error.problem}")


@functools.lru_cache(maxsize=None)
def store() -> Store:
    """The project's store, artifacts/ (one per process: its stat cache stays open)."""
    return Store(root() / "artifacts")


def recipe_tasks(basename: str, doc: str, subtask):
    """doit tasks for a verb done per recipe: `doit <basename>` (described by doc) runs
    `<basename>:<recipe>` for every recipe, each made by subtask(recipe name) as a dict of its
    own fields. By default a subtask is an action: run every time, its output shown."""
    yield {"basename": basename, "name": None, "doc": doc}
    for name in recipe_names():
        yield {"basename": basename, "name": name, "uptodate": [False], "verbosity": 2, **subtask(name)}
