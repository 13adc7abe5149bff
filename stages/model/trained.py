"""The trained model as a plain transformers model, for every stage downstream of training
(quantized, eval): full weights as saved, or the base with the PEFT adapter merged in, placed
where those stages run it (placement); and what a model's weights take on disk."""
from __future__ import annotations

from pathlib import Path


def placement() -> dict:
    """from_pretrained arguments for inference-side stages: on a CUDA GPU the model in bf16 on
    the GPU (an 8B model in fp32 on the CPU would take hours to calibrate and score); on the
    CPU fp32, as before, so CPU builds keep their bytes."""
    import torch

    if on_cuda():
        return {"dtype": torch.bfloat16, "device_map": "cuda"}
    return {"dtype": torch.float32}


def on_cuda() -> bool:
    """Whether placement() puts models on a CUDA GPU (where eval decodes in the generation engine)."""
    import torch

    return torch.cuda.is_available()


def device() -> str:
    """Where placement() puts the model: part of the key of every stage that uses it, since a
    GPU in bf16 and the CPU in fp32 write different bytes from the same inputs. A CPU build of
    torch says so in its version, which spares every up-to-date check importing torch."""
    from importlib.metadata import version

    if version("torch").endswith("+cpu"):
        return "cpu"
    import torch

    return f"cuda: {torch.cuda.get_device_name(0)}" if torch.cuda.is_available() else "cpu"


def dequantized(base: Path) -> dict:
    """from_pretrained arguments that load a base saved with MXFP4 weights (gpt-oss) as bf16:
    training and merging an adapter need real weights, not MXFP4 kernels' packed blocks."""
    import json

    quant = json.loads((base / "config.json").read_text()).get("quantization_config") or {}
    if quant.get("quant_method") != "mxfp4":
        return {}
    from transformers import Mxfp4Config

    return {"quantization_config": Mxfp4Config(dequantize=True)}


def load_trained(checkpoint: Path, base: Path):
    from transformers import AutoModelForCausalLM

    if (checkpoint / "adapter").is_dir():
        from peft import PeftModel

        model = AutoModelForCausalLM.from_pretrained(base, **placement(), **dequantized(base))
        return PeftModel.from_pretrained(model, checkpoint / "adapter").merge_and_unload()
    return AutoModelForCausalLM.from_pretrained(checkpoint / "model", **placement())


def size_on_disk(*directories: Path) -> int:
    """Bytes of the weight files (*.safetensors) a model loads from these directories: what a
    scheme saves on disk and in memory, apart from the config and tokenizer every model shares."""
    return sum(p.stat().st_size for d in directories for p in sorted(d.glob("*.safetensors")))


def trained_size_on_disk(checkpoint: Path, base: Path) -> int:
    """size_on_disk of the trained model as load_trained loads it: full weights, or base + adapter."""
    if (checkpoint / "adapter").is_dir():
        return size_on_disk(base, checkpoint / "adapter")
    return size_on_disk(checkpoint / "model")
