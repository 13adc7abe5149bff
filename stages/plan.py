"""plan: decide how to train on this hardware, ahead of time, and write the decisions down.

plan.json holds decisions only (hashed; they feed the checkpoint key and training
applies them verbatim). Timings that led to them are run-time measurements and
are kept beside the artifact (in its sidecar), never in the hashed tree.
On CPU the decisions follow from the device facts; on CUDA the SDPA backends are
timed on the run's real attention shapes.
"""
from __future__ import annotations

import json
import os
import platform
import time
from pathlib import Path

from stages.errors import UserError

GPU_PROFILES = {"h100", "h200", "mi300x", "gfx1100", "gfx1151"}


def device_facts(hardware) -> dict:
    """What the decisions depend on; part of the key, so new hardware means a new plan."""
    if hardware.profile == "cpu":
        return {"device": "cpu", "machine": platform.machine(), "cpus": os.cpu_count()}
    import torch

    if not torch.cuda.is_available():
        raise UserError(f"recipe hardware.profile: {hardware.profile} needs a GPU and none is visible; "
                        f"use profile: cpu on this machine")
    if torch.cuda.device_count() < hardware.gpus:
        raise UserError(f"recipe hardware.gpus: {hardware.gpus} asked, {torch.cuda.device_count()} visible")
    return {"device": "cuda", "name": torch.cuda.get_device_name(0),
            "capability": list(torch.cuda.get_device_capability(0)),
            "hip": torch.version.hip, "cuda": torch.version.cuda, "gpus": hardware.gpus}


def env_block(root: Path, profile: str) -> dict[str, str]:
    """The profile's environment block from ops/hardware.yaml."""
    import yaml

    return yaml.safe_load((root / "ops" / "hardware.yaml").read_text())[profile]["env"]


def extra_inputs(recipe, root: Path, store) -> dict:
    return {"facts": device_facts(recipe.hardware), "env": env_block(root, recipe.hardware.profile)}


def time_sdpa_backends(batch, heads, kv_heads, seq, head_dim, budget_s) -> dict[str, float]:
    """Milliseconds per forward+backward of causal SDPA for each backend that runs these shapes."""
    import torch
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    q = torch.randn(batch, heads, seq, head_dim, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    k = torch.randn(batch, kv_heads, seq, head_dim, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    v = torch.randn_like(k, requires_grad=True)
    results, deadline = {}, time.time() + budget_s
    for backend in (SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION,
                    SDPBackend.CUDNN_ATTENTION, SDPBackend.MATH):
        if time.time() > deadline:
            break
        try:
            with sdpa_kernel(backend):
                def step():
                    F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True).sum().backward()
                step()
                torch.cuda.synchronize()
                start, n = time.perf_counter(), 5
                for _ in range(n):
                    step()
                torch.cuda.synchronize()
            results[backend.name.lower()] = round((time.perf_counter() - start) * 1000 / n, 4)
        except RuntimeError:
            continue  # this backend does not support these shapes here
    return results


def build(ctx, out: Path) -> None:
    r = ctx.recipe
    facts = device_facts(r.hardware)
    decisions = {
        "device": facts["device"],
        "dtype": "float32",
        "attn_implementation": "sdpa",
        "sdpa_backend": None,
        "micro_batch_size": r.train.micro_batch_size,
        "sequence_length": r.data.max_length,
        "gradient_checkpointing": False,
        "env": env_block(ctx.root, r.hardware.profile),
    }
    if facts["device"] == "cuda" and r.autotune.enabled:
        config = json.loads((ctx.upstream["base"] / "config.json").read_text())
        timings = time_sdpa_backends(
            r.train.micro_batch_size, config["num_attention_heads"], config["num_key_value_heads"],
            r.data.max_length, config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"],
            r.autotune.budget_seconds)
        if not timings:
            raise UserError("plan: no SDPA backend ran on these shapes; check data.max_length and the GPU")
        decisions["dtype"] = "bfloat16"
        decisions["sdpa_backend"] = min(timings, key=timings.get)
        ctx.run["sdpa_ms"] = timings
        ctx.log.info("SDPA forward+backward ms: %s -> %s", timings, decisions["sdpa_backend"])
    ctx.run["facts"] = facts
    (out / "plan.json").write_text(json.dumps({"decisions": decisions, "facts": facts},
                                              indent=1, sort_keys=True) + "\n")
