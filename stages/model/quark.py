"""AMD Quark quantization of a trained model and its Hugging Face-format export, one scheme at
a time, through Quark's public LLM template API (the scheme names are Quark's own: `fp8` is
FP8 E4M3 per tensor, weights and activations, activation scales calibrated statically; `mxfp4`
is OCP MXFP4, FP4 E2M1 values in blocks of 32 with a shared E8M0 scale, for weights packed
two to a byte and for activations quantized on the fly). The export reloads with plain
transformers (its Quark integration), and vLLM reads it through `quant_method: "quark"`.
"""
from __future__ import annotations

import logging
import os
from pathlib import Path

# Quark reads this as it is imported, wherever that is (the preload server imports this module
# before quark.torch: stages/table.py): the same bytes, and no C++/inductor build at run time
os.environ.setdefault("QUARK_DISABLE_COMPILE", "1")


def export(model, scheme: str, calibration: list, dest: Path, log: logging.Logger) -> None:
    """Quantize `model` in place with Quark's `scheme` (calibrated on the batches of token ids in
    `calibration`) and write it to `dest` as safetensors with real quantized weights; `log` gets
    a line as each part ends, so the stage's log says where its time went."""
    from quark.torch import LLMTemplate, ModelQuantizer, export_safetensors

    log.debug("Quark imported (its first import on a machine builds its C++ kernels)")
    config = LLMTemplate.get(model.config.model_type).get_config(scheme=scheme)
    model = ModelQuantizer(config).quantize_model(model, [ids.to(model.device) for ids in calibration])
    log.debug("calibrated")
    model = ModelQuantizer.freeze(model)
    log.debug("frozen")
    export_safetensors(model, dest, custom_mode="quark", weight_format="real_quantized")


FORMAT_FIELDS = ("dtype", "qscheme", "group_size", "scale_format", "is_dynamic")


def described(quantization_config: dict) -> dict:
    """What an export's config.json says it is, in a few words per tensor kind (the receipt's
    record of the scheme as exported, not as asked)."""
    spec = quantization_config["global_quant_config"]
    return {"quant_method": quantization_config["quant_method"],
            "excluded": quantization_config["exclude"],
            **{kind: {f: spec[key][f] for f in FORMAT_FIELDS} if spec[key] else None
               for kind, key in (("weights", "weight"), ("activations", "input_tensors"))}}
