"""manifest: the receipt. BLAKE3 of every file of every artifact, the recipe, the plan
decisions, package versions and hardware facts, in one canonical JSON file.

Built only from deterministic content, so two clean builds give the same manifest.
"""
from __future__ import annotations

import json
import platform
from pathlib import Path

from stages.store import read_json

PACKAGES = ("torch", "transformers", "tokenizers", "peft", "trl", "accelerate", "datasets",
            "lm-eval", "amd-quark", "safetensors", "blake3", "doit", "pydantic")


def build(ctx, out: Path) -> None:
    from stages.graph import versions

    artifacts = {}
    for stage, obj in ctx.upstream.items():
        meta = read_json(obj.with_suffix(".json"))
        artifacts[stage] = {"key": obj.name, "digest": meta["digest"], "files": meta["files"]}
    plan = json.loads((ctx.upstream["plan"] / "plan.json").read_text())
    manifest = {
        "recipe_name": ctx.recipe_name,
        "recipe": ctx.recipe.model_dump(mode="json"),
        "artifacts": artifacts,
        "plan": plan["decisions"],
        "hardware": plan["facts"],
        "versions": {"python": platform.python_version(), **versions(PACKAGES)},
    }
    (out / "manifest.json").write_text(json.dumps(manifest, indent=1, sort_keys=True) + "\n")
    ctx.log.info("manifest of %d artifacts", len(artifacts))
