"""base: the base model + tokenizer as an artifact.

Three sources: a hub id pinned to a revision (downloaded once through
huggingface_hub, then copied), a local HF directory (copied byte for byte), or a
config (tiny: stages/model/tiny.py, so the default needs no download).
"""
from __future__ import annotations

import shutil
from pathlib import Path

from stages.engine.errors import RecipeError, UserError
from stages.model.tiny import build_from_config
from stages.model.trained import device

MODEL_FILE_PATTERNS = ("*.json", "*.safetensors", "*.jinja", "*.txt", "*.model", "*.tiktoken")


def copy_model_dir(src: Path, out: Path) -> None:
    """Copy the files a causal LM needs, refusing a directory that lacks them."""
    if not (src / "config.json").is_file():
        raise UserError(f"{src}: not a Hugging Face model directory (no config.json); "
                        f"point model.path at a directory saved with save_pretrained")
    if not any(src.glob("*.safetensors")):
        raise UserError(f"{src}: no *.safetensors weights; re-save the model with safe_serialization")
    for p in sorted(src.iterdir()):
        if p.is_file() and any(p.match(pat) for pat in MODEL_FILE_PATTERNS):
            shutil.copyfile(p, out / p.name)


def extra_inputs(recipe, root: Path, store) -> dict:
    """A local model dir, or the tokenizer dir a config names, is an input: its content, not
    its path, goes into the key; a config-built model's bytes also depend on the device whose
    random numbers made them: a GPU profile's on the GPU where one is visible (stages/model/tiny.py)."""
    m = recipe.model
    made_on = {"device": device() if recipe.hardware.profile != "cpu" else "cpu"} if m.config is not None else {}
    name, path = (("model.path", m.path) if m.path is not None else
                  ("model.config.tokenizer", m.config.tokenizer if m.config else None))
    if path is None:
        return made_on
    src = root / path
    if not src.is_dir():
        raise RecipeError(name, f"{path} is not a directory; correct the path (relative to the project) or put the "
                                f"model there")
    return {**made_on, **{p.name: store.stat.digest(p) for p in sorted(src.iterdir())
                          if p.is_file() and any(p.match(pat) for pat in MODEL_FILE_PATTERNS)}}


def build(ctx, out: Path) -> None:
    m = ctx.recipe.model
    if m.config is not None:
        ctx.log.debug("building a Qwen3 model from config (seed %d)", m.config.seed)
        build_from_config(m.config, out, ctx.root, on_gpu=ctx.recipe.hardware.profile != "cpu")
    elif m.path is not None:
        ctx.log.info("copying local model %s", m.path)
        copy_model_dir(ctx.root / m.path, out)
    else:
        from huggingface_hub import snapshot_download

        ctx.log.info("fetching %s@%s", m.hub, m.revision)
        try:
            src = snapshot_download(m.hub, revision=m.revision, allow_patterns=list(MODEL_FILE_PATTERNS))
        except Exception as e:  # offline, unknown id or revision, no access: the hub client raises many types
            first = str(e).strip().splitlines()[0][:200] if str(e).strip() else type(e).__name__
            raise UserError(f"recipes/{ctx.recipe_name}.yaml: model.hub {m.hub}@{m.revision} cannot be fetched "
                            f"({type(e).__name__}: {first}); connect to the hub (and log in if the model is gated), "
                            f"or download it once and point model.path at that directory") from None
        copy_model_dir(Path(src), out)
