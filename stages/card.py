"""card: the model card of a build, README.md as the Hugging Face Hub reads one (front matter with
base_model, datasets, library_name, license, tags and the eval scores as a model-index; then what
was trained, from what, how it scored, the receipt's digest and its anchor where there is one;
stages/view/card.py). `doit publish:<recipe>` uploads it with the model."""
from __future__ import annotations

import json
from pathlib import Path

from stages.view.card import render


def build(ctx, out: Path) -> None:
    up = ctx.upstream
    manifest = json.loads((up["manifest"] / "manifest.json").read_text())
    scores = json.loads((up["eval"] / "eval.json").read_text())
    anchor = json.loads((up["anchor"] / "anchor.json").read_text()) if "anchor" in up else None
    text = render(manifest, ctx.artifacts["manifest"]["digest"], scores, anchor, ctx.recipe.publish.license)
    (out / "README.md").write_text(text)
    ctx.log.debug("README.md: the model card, %d bytes", len(text))


def summary(path: Path) -> list[str]:
    """What doit show prints under the card stage."""
    return [f"README.md: the model card ({(path / 'README.md').stat().st_size} bytes); doit publish uploads it"]
