"""quantized: AMD Quark FP8 (E4M3) export in Hugging Face format, LoRA merged first.

Weights and activations are quantized per tensor, activations statically from
calibration sequences taken from the training shards. The export reloads with
plain transformers (its Quark integration). score.json is a quick check of the export, not
an evaluation: the training loss (assistant tokens, as training computes it) of the trained
model before and after quantization on the packed training sequences that follow the
calibration ones, and how far the logits moved. The quantized model's held-out scores beside
the base and trained models' are in eval.json.
"""
from __future__ import annotations

import json
import os
from pathlib import Path

from stages.data import packed
from stages.model.trained import device, load_trained, placement
from stages.engine.errors import UserError


FIRST_SHARD = "shard-00000.safetensors"
CHECKED = 8  # sequences the export is checked on


def extra_inputs(recipe, root: Path, store) -> dict:
    return {"device": device()}


def sequences(shards: Path, first: int, count: int):
    import torch

    rows = packed.read(shards / "train" / FIRST_SHARD, first, count)
    if not len(rows["input_ids"]):
        raise UserError(f"quantize.calibration_sequences: {first} leaves none of the first shard's "
                        f"sequences to score the quantized model on; lower it")
    ids, pos, labels = (torch.from_numpy(rows[k]).long() for k in ("input_ids", "position_ids", "labels"))
    return [(ids[i: i + 1], pos[i: i + 1], labels[i: i + 1]) for i in range(len(ids))]


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
    checked = sequences(ctx.upstream["shards"], n, CHECKED)
    model = load_trained(ctx.upstream["checkpoint"], ctx.upstream["base"]).eval()
    model.config.use_cache = False

    @torch.no_grad()
    def measure(m):
        losses, logits = [], []
        for ids, pos, labels in checked:
            o = m(input_ids=ids.to(m.device), position_ids=pos.to(m.device), labels=labels.to(m.device),
                  use_cache=False)
            losses.append(o.loss.item())
            logits.append(o.logits.float().cpu())
        return sum(losses) / len(losses), torch.cat(logits)

    loss_ref, logits_ref = measure(model)
    ctx.log.info("quantizing to %s with %d calibration sequences", ctx.recipe.quantize.scheme, len(calib))
    config = LLMTemplate.get(model.config.model_type).get_config(scheme=ctx.recipe.quantize.scheme)
    model = ModelQuantizer(config).quantize_model(model, [ids.to(model.device) for ids, _, _ in calib])
    model = ModelQuantizer.freeze(model)
    export_safetensors(model, out / "model", custom_mode="quark", weight_format="real_quantized")
    AutoTokenizer.from_pretrained(ctx.upstream["base"]).save_pretrained(out / "model")

    reloaded = AutoModelForCausalLM.from_pretrained(out / "model", **placement()).eval()
    loss_q, logits_q = measure(reloaded)
    score = {
        "scheme": ctx.recipe.quantize.scheme,
        "checked_on": {"shard": f"train/{FIRST_SHARD}", "first_sequence": n, "sequences": len(checked),
                       "what": "packed training sequences after the calibration ones; loss on assistant "
                               "tokens, as training computes it (held-out scores: eval.json)"},
        "train_loss_unquantized": round(loss_ref, 6),
        "train_loss_quantized": round(loss_q, 6),
        "logits_relative_error": round(((logits_q - logits_ref).norm() / logits_ref.norm()).item(), 6),
    }
    (out / "score.json").write_text(json.dumps(score, indent=1, sort_keys=True) + "\n")
    ctx.log.info("quantized loss %.4f vs %.4f unquantized", loss_q, loss_ref)
