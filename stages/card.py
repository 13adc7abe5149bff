"""card: the model card of a build, README.md as the Hugging Face Hub reads one (front matter with
base_model, datasets, library_name, license, tags and the eval scores as a model-index; then what
was trained, from what, how it scored, the receipt's digest and its anchor where there is one;
stages/view/card.py). `doit publish:<recipe>` uploads it with the model."""
from __future__ import annotations

from pathlib import Path

from stages.engine import jsontext
from stages.view.card import render


def build(ctx, out: Path) -> None:
    up = ctx.upstream
    manifest = jsontext.read(up["manifest"] / "manifest.json")
    scores = jsontext.read(up["eval"] / "eval.json")
    anchor = jsontext.read(up["anchor"] / "anchor.json") if "anchor" in up else None
    text = render(manifest, ctx.artifacts["manifest"]["digest"], scores, anchor, ctx.recipe.publish.license)
    (out / "README.md").write_text(text)
    ctx.log.debug("README.md: the model card, %d bytes", len(text))


def summary(path: Path) -> list[str]:
    """What doit show prints under the card stage."""
    return [f"README.md: the model card ({(path / 'README.md').stat().st_size} bytes); doit publish uploads it"]
