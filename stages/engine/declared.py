"""Declared inputs are the only inputs: what a stage's build sees of the recipe and of its
upstream artifacts is exactly what its row of the stage table declares, as Bazel's sandbox
shows an action only its declared inputs. A read of anything else fails at once, naming the
stage and the field, instead of producing an artifact whose key does not cover what made it.
"""
from __future__ import annotations

import os
from pathlib import Path


class UndeclaredInput(Exception):
    """A stage read a recipe field its row of the stage table does not declare (a bug in the
    stage or its row, not bad input): the build stops before anything is stored."""


def covers(declared: tuple[str, ...], path: str) -> bool:
    """Whether a dotted recipe path lies under a declared one ('' declares the whole recipe)."""
    return any(d == "" or path == d or path.startswith(d + ".") for d in declared)


def recipe_view(recipe, declared: tuple[str, ...], stage: str):
    """The recipe as a stage may read it: itself where the whole recipe is declared, else a view."""
    return recipe if covers(declared, "") else RecipeView(recipe, declared, stage, "")


class RecipeView:
    """A recipe section seen through a stage's declared paths. A field under a declared path is
    the recipe's own (frozen) value; a field on the way to one is a view of its section; any
    other field raises UndeclaredInput. A property of the section (train.global_batch) is
    computed through the view, so the fields it reads are checked too."""

    __slots__ = ("_section", "_declared", "_stage", "_path")

    def __init__(self, section, declared: tuple[str, ...], stage: str, path: str):
        self._section, self._declared, self._stage, self._path = section, declared, stage, path

    def __getattr__(self, name: str):
        cls = type(self._section)
        path = f"{self._path}.{name}" if self._path else name
        if name in cls.model_fields:
            value = getattr(self._section, name)
            if covers(self._declared, path):
                return value
            if any(d.startswith(path + ".") for d in self._declared):
                return RecipeView(value, self._declared, self._stage, path)
        elif isinstance(getattr(cls, name, None), property):
            return getattr(cls, name).fget(self)
        raise UndeclaredInput(
            f"stage {self._stage} read recipe field {path}, which its row of the stage table "
            f"(stages/table.py) does not declare: declare it there, or do not read it")

    def __repr__(self) -> str:
        return f"<recipe {self._path or '(top)'} as stage {self._stage} declares it>"


def upstream_view(dest: Path, objects: dict[str, tuple[Path, dict]]) -> dict[str, Path]:
    """For each upstream artifact (its store path, and the files of it the stage declares), a
    directory under `dest` holding links to those files only, so a stage cannot open a file of
    its upstream that its key does not cover (an optional upstream's too, where it is present).
    Returns the directories by upstream stage."""
    views = {}
    for up, (obj, files) in objects.items():
        views[up] = dest / up
        views[up].mkdir(parents=True)
        for rel in files:
            link = views[up] / rel
            link.parent.mkdir(parents=True, exist_ok=True)
            os.symlink(obj / rel, link)
    return views
