"""quantized: AMD Quark exports in Hugging Face format, one per scheme the recipe asks for
(`quantize.scheme`: fp8, mxfp4, or a list of them to compare), LoRA merged first.

Each scheme's export is the directory `<scheme>/` (config.json with Quark's
quantization_config, safetensors, tokenizer), quantized from the trained model afresh, so one
scheme's bytes never depend on which others are listed; calibration sequences come from the
training shards (stages/model/quark.py says what each scheme does). score.json is a quick
check of each export, not an evaluation: the training loss (assistant tokens, as training
computes it) of the trained model before and after quantization on the packed training
sequences that follow the calibration ones, and how far the logits moved. Held-out scores and
sizes on disk of the base, trained and quantized models side by side are in eval.json.
"""
from __future__ import annotations

import json
from pathlib import Path

from stages.data import packed
from stages.model import quark
from stages.model.numerics import as_planned
from stages.model.trained import device, load_trained, placement
from stages.engine.errors import UserError


FIRST_SHARD = "shard-00000.safetensors"
CHECKED = 8  # sequences the export is checked on
# tokens a calibration forward takes (whole sequences): 32 forwards of one 2048-token sequence took
# 7 s for the 8B shape on an H100, 4 of 8 took 3 s. A per-tensor min-max observer's scale is the
# maximum over all of them however they are grouped (on a GPU in bf16 the grouping may move an
# activation in its last bits: the 8B shape's export was the same bytes on three H100s at 16k)
CALIBRATION_TOKENS = 16384


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
    schemes = ctx.recipe.quantize.schemes
    if not schemes:
        (out / "score.json").write_text('{"schemes": {}}\n')
        return
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    as_planned(ctx.upstream["plan"])
    n = ctx.recipe.quantize.calibration_sequences
    calibration = torch.cat([ids for ids, _, _ in sequences(ctx.upstream["shards"], 0, n)])
    calib = list(calibration.split(max(1, CALIBRATION_TOKENS // calibration.shape[1])))
    checked = sequences(ctx.upstream["shards"], n, CHECKED)

    def trained():
        model = load_trained(ctx.upstream["checkpoint"], ctx.upstream["base"]).eval()
        model.config.use_cache = False
        return model

    @torch.no_grad()
    def measure(m, reference=None):
        """The mean loss over the checked sequences, and their logits as computed, on the model's
        device (in fp32 on the CPU, 8 x 2048 positions x a 152k vocabulary took longer to copy and
        compare than the forwards did); with `reference` (those logits of the unquantized model),
        how far these moved from them instead, |q - r| / |r| over every logit."""
        losses, logits, moved, norm = [], [], 0.0, 0.0
        for (ids, pos, labels), ref in zip(checked, reference or [None] * len(checked)):
            o = m(input_ids=ids.to(m.device), position_ids=pos.to(m.device), labels=labels.to(m.device),
                  use_cache=False)
            losses.append(o.loss.item())
            if ref is None:
                logits.append(o.logits)
            else:
                ref = ref.float()
                moved += (o.logits.float() - ref).square().sum().item()
                norm += ref.square().sum().item()
        return sum(losses) / len(losses), logits if reference is None else (moved / norm) ** 0.5

    model = trained()
    ctx.log.debug("trained model loaded")
    loss_ref, logits_ref = measure(model)
    ctx.log.debug("unquantized loss measured on %d sequences", len(checked))
    score = {
        "checked_on": {"shard": f"train/{FIRST_SHARD}", "first_sequence": n, "sequences": len(checked),
                       "what": "packed training sequences after the calibration ones; loss on assistant "
                               "tokens, as training computes it (held-out scores: eval.json)"},
        "train_loss_unquantized": round(loss_ref, 6),
        "schemes": {},
    }
    for i, scheme in enumerate(schemes):
        # Quark quantizes in place: the first scheme takes the model measured above (an 8B load and
        # merge spared), each later one a fresh load, so no scheme's bytes depend on the others
        model = model if i == 0 else trained()
        ctx.log.debug("quantizing to %s with %d calibration sequences in %d forwards", scheme, n, len(calib))
        torch.manual_seed(0)
        quark.export(model, scheme, calib, out / scheme, ctx.log)
        del model
        AutoTokenizer.from_pretrained(ctx.upstream["base"]).save_pretrained(out / scheme)
        ctx.log.debug("%s exported", scheme)
        loss_q, moved = measure(AutoModelForCausalLM.from_pretrained(out / scheme, **placement()).eval(), logits_ref)
        score["schemes"][scheme] = {"train_loss_quantized": round(loss_q, 6), "logits_relative_error": round(moved, 6)}
        ctx.log.info("%s: quantized loss %.4f vs %.4f unquantized", scheme, loss_q, loss_ref)
    (out / "score.json").write_text(json.dumps(score, indent=1, sort_keys=True) + "\n")
