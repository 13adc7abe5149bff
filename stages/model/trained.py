"""The trained model as a plain transformers model, for every stage downstream of training
(quantized, eval): full weights as saved, or the base with the PEFT adapter merged in."""
from __future__ import annotations

from pathlib import Path


def load_trained(checkpoint: Path, base: Path, dtype="float32"):
    import torch
    from transformers import AutoModelForCausalLM

    if (checkpoint / "adapter").is_dir():
        from peft import PeftModel

        model = AutoModelForCausalLM.from_pretrained(base, dtype=getattr(torch, dtype))
        return PeftModel.from_pretrained(model, checkpoint / "adapter").merge_and_unload()
    return AutoModelForCausalLM.from_pretrained(checkpoint / "model", dtype=getattr(torch, dtype))
