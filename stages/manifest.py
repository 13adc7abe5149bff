"""manifest: the receipt. BLAKE3 of every file of every artifact, the recipe, the plan
decisions, package versions and hardware facts, each quantized export's scheme as its
config.json states it, and the eval stage's scores (each method's own metrics among them), in
one canonical JSON file.

Built only from deterministic content, so two clean builds give the same manifest. It is
self-consistent: each artifact's entry holds the inputs its key is the hash of, and the
manifest's own inputs are its fields `recipe` (every section but serve, anchor and publish: where
the model is served, the receipt anchored or the build published is no part of what it proves, and
an RPC URL never lands in it), `code`, `upstream` and
`versions` (the stage table's RECEIPT_PACKAGES), so `doit verify` recomputes every key from the
receipt itself (stages/engine/receipt.py).
"""
from __future__ import annotations

import json
from pathlib import Path

from stages.engine import jsontext
from stages.model.quark import described


def build(ctx, out: Path) -> None:
    artifacts = {stage: {"key": a["key"], "digest": a["digest"], "files": a["files"], "inputs": a["inputs"]}
                 for stage, a in ctx.artifacts.items()}
    plan = jsontext.read(ctx.upstream["plan"] / "plan.json")
    scores = jsontext.read(ctx.upstream["eval"] / "eval.json")
    manifest = {
        "eval": {m: scores[m] for m in ("base", "trained", "quantized", "gain") if m in scores},
        "recipe_name": ctx.recipe_name,
        "recipe": ctx.inputs["params"],
        "code": ctx.inputs["code"],
        "upstream": ctx.inputs["upstream"],
        "versions": ctx.inputs["env"],
        "artifacts": artifacts,
        "plan": plan["decisions"],
        "hardware": plan["facts"],
        "quantized": {d.name: described(jsontext.read(d / "config.json")["quantization_config"])
                      for d in sorted(ctx.upstream["quantized"].iterdir()) if d.is_dir()},
    }
    (out / "manifest.json").write_text(json.dumps(manifest, indent=1, sort_keys=True) + "\n")
    ctx.log.debug("manifest of %d artifacts", len(artifacts))
