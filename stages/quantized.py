"""quantized: AMD Quark FP8 (E4M3) export in Hugging Face format, LoRA merged first.

Weights and activations are quantized per tensor, activations statically from
calibration sequences taken from the training shards. The export reloads with
plain transformers (its Quark integration). score.json records how far the
quantized model is from the one it came from, on sequences not used to calibrate.
"""
from __future__ import annotations

import json
import os
from pathlib import Path

from stages.data import packed
from stages.model.trained import load_trained
from stages.engine.errors import UserError


def sequences(shards: Path, first: int, count: int):
    import torch

    rows = packed.read(shards / "train" / "shard-00000.safetensors", first, count)
    if not len(rows["input_ids"]):
        raise UserError(f"quantize.calibration_sequences: {first} leaves none of the first shard's "
                        f"sequences to score the quantized model on; lower it")
    ids, pos = torch.from_numpy(rows["input_ids"]).long(), torch.from_numpy(rows["position_ids"]).long()
    return [(ids[i: i + 1], pos[i: i + 1]) for i in range(len(ids))]


def build(ctx, out: Path) -> None:
    if ctx.recipe.quantize.scheme == "none":
        (out / "score.json").write_text('{"scheme": "none"}\n')
        return
    os.environ.setdefault("QUARK_DISABLE_COMPILE", "1")  # same bytes, no C++/inductor build at run time
    import torch
    from quark.torch import LLMTemplate, ModelQuantizer, export_safetensors
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.manual_seed(0)
    n = ctx.recipe.quantize.calibration_sequences
    calib = sequences(ctx.upstream["shards"], 0, n)
    held = sequences(ctx.upstream["shards"], n, 8)
    model = load_trained(ctx.upstream["checkpoint"], ctx.upstream["base"]).eval()
    model.config.use_cache = False

    @torch.no_grad()
    def measure(m):
        losses, logits = [], []
        for ids, pos in held:
            o = m(input_ids=ids, position_ids=pos, labels=ids, use_cache=False)
            losses.append(o.loss.item())
            logits.append(o.logits)
        return sum(losses) / len(losses), torch.cat(logits)

    loss_ref, logits_ref = measure(model)
    ctx.log.info("quantizing to %s with %d calibration sequences", ctx.recipe.quantize.scheme, len(calib))
    config = LLMTemplate.get(model.config.model_type).get_config(scheme=ctx.recipe.quantize.scheme)
    model = ModelQuantizer(config).quantize_model(model, [ids for ids, _ in calib])
    model = ModelQuantizer.freeze(model)
    export_safetensors(model, out / "model", custom_mode="quark", weight_format="real_quantized")
    AutoTokenizer.from_pretrained(ctx.upstream["base"]).save_pretrained(out / "model")

    reloaded = AutoModelForCausalLM.from_pretrained(out / "model").eval()
    loss_q, logits_q = measure(reloaded)
    score = {
        "scheme": ctx.recipe.quantize.scheme,
        "heldout_sequences": len(held),
        "loss_unquantized": round(loss_ref, 6),
        "loss_quantized": round(loss_q, 6),
        "logits_relative_error": round(((logits_q - logits_ref).norm() / logits_ref.norm()).item(), 6),
    }
    (out / "score.json").write_text(json.dumps(score, indent=1, sort_keys=True) + "\n")
    ctx.log.info("quantized loss %.4f vs %.4f unquantized", loss_q, loss_ref)
