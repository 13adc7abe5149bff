"""What a recipe serves, read from its manifest: the model's id, the artifacts the server will
load from (to be checked whole against the receipt before loading: a file added beside the
weights would be loaded too), and where the weights, the tokenizer and a LoRA adapter lie. The
trained model is full weights or the base plus its adapter; the quantized model is its own export."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from stages.engine.errors import UserError


@dataclass(frozen=True)
class Served:
    model_id: str
    stages: tuple[str, ...]  # the artifacts it loads from, in the order they are checked
    weights: Path  # the model directory (the base's, when an adapter goes on top)
    tokenizer: Path
    adapter: Path | None = None
    checkpoint: Path | None = None  # the trained model's checkpoint (None: the quantized export)


def model_id(recipe_name: str, manifest_digest: str, scheme: str | None = None) -> str:
    """The served name: the recipe and a short prefix of its manifest's digest (the receipt),
    plus the quantization scheme for the quantized model."""
    return f"{recipe_name}-{manifest_digest[:12]}" + (f"-{scheme}" if scheme else "")


def served(recipe_name: str, manifest: dict, manifest_digest: str, quantized: bool,
           path: Callable[[str], Path], scheme: str | None = None) -> Served:
    """The model a recipe's manifest serves; `path(stage)` is that stage's object in the store.
    The quantized model is the export of `scheme`, by default the first the recipe lists."""
    files = {stage: art["files"] for stage, art in manifest["artifacts"].items()}
    if quantized:
        asked = manifest["recipe"]["quantize"]["scheme"]
        exported = [s for s in ([asked] if isinstance(asked, str) else asked) if f"{s}/config.json" in files["quantized"]]
        if not exported:
            raise UserError(f"serve:{recipe_name}: recipes/{recipe_name}.yaml has quantize.scheme {asked}: "
                            f"no quantized model to serve; drop --quantized or set quantize.scheme")
        scheme = scheme or exported[0]
        if scheme not in exported:
            raise UserError(f"serve:{recipe_name}: no {scheme} export: recipes/{recipe_name}.yaml quantizes to "
                            f"{', '.join(exported)}; pick one of them with --scheme (or add {scheme} to quantize.scheme)")
        weights = path("quantized") / scheme
        return Served(model_id(recipe_name, manifest_digest, scheme), ("quantized",), weights, weights)
    if "adapter/adapter_config.json" in files["checkpoint"]:
        return Served(model_id(recipe_name, manifest_digest), ("checkpoint", "base"),
                      path("base"), path("base"), path("checkpoint") / "adapter", path("checkpoint"))
    return Served(model_id(recipe_name, manifest_digest), ("checkpoint", "base"),
                  path("checkpoint") / "model", path("base"), checkpoint=path("checkpoint"))
