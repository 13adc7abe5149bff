"""The vLLM command line for a served model, for GPU machines where vLLM is installed in its own
environment (its wheel pins an older transformers than ours): the checked store directories are
passed as they are, a Quark export loads by the quant_method in its config.json, and a LoRA
adapter is served unmerged on top of the base (--enable-lora --lora-modules)."""
from __future__ import annotations

import json
import os
import shutil

from stages.inference.served import Served


def executable() -> str | None:
    """vLLM's `vllm` command: $MINDXTRAIN_VLLM (the one in vLLM's own environment), else on PATH."""
    return os.environ.get("MINDXTRAIN_VLLM") or shutil.which("vllm")


def command(vllm: str, s: Served, host: str, port: int) -> list[str]:
    argv = [vllm, "serve", str(s.weights), "--host", host, "--port", str(port), "--tokenizer", str(s.tokenizer)]
    if s.adapter is None:
        return argv + ["--served-model-name", s.model_id]
    rank = json.loads((s.adapter / "adapter_config.json").read_text())["r"]
    return argv + ["--served-model-name", f"{s.model_id}-base", "--enable-lora",
                   "--lora-modules", f"{s.model_id}={s.adapter}", "--max-lora-rank", str(rank)]
