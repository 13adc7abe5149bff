"""Pure key computation: no I/O beyond what the caller passes in.

A key is BLAKE3 of a canonical JSON of exactly what a stage reads. Canonical means
sorted keys, no whitespace, and values as Pydantic dumps them, so YAML comments,
key order and quoting never change a key.
"""
from __future__ import annotations

import json

import blake3

from stages.engine.recipe import Recipe


def canonical(obj) -> str:
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=False)


def key_of(inputs: dict) -> str:
    return blake3.blake3(canonical(inputs).encode()).hexdigest()[:32]


def recipe_slice(recipe: Recipe, dotted: str):
    """The JSON value at a dotted path of the recipe ('' is the whole recipe)."""
    value = recipe.model_dump(mode="json")
    for part in filter(None, dotted.split(".")):
        value = value[part]
    return value
