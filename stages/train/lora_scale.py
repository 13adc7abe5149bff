"""LoRA's scale applied to B's weight instead of to B's output.

PEFT computes a LoRA projection as base(x) + lora_B(lora_A(x)) * scaling. The product by the
scale is a pass over the projection's whole output (N tokens x out features), and in the
backward autograd scales the output's gradient the same way before the two small products
read it: a full-size tensor written and read again per projection, which compiled kernels can
fuse only in part. base(x) + lora_A(x) (scaling * B)^T is the same sum; the scale then
multiplies B (out x r, kilobytes) and B's gradient. Qwen3-8B's shape on an H200, 8 compiled
layers, three fresh pairs of runs: 0.95-1.48 ms less a step of about 138 ms, every pair
(bench/results/fused_lora_h200_2026-11-28). Eager, with a power-of-two scale (alpha = 2r, the
default), the values are PEFT's to the bit; compiled, inductor rounds in another order (loss
within 4e-5 there, bf16 gradients within 2% in norm).

PEFT's modules, parameters and saved adapter are untouched: inside scale_in_weight each PEFT
LoRA Linear runs forward() below, which falls back to PEFT's own wherever the case is not plain
LoRA (dropout, DoRA or another variant, a LoRA bias, adapters disabled or merged, several active,
extra arguments, an input PEFT would cast).
"""
from __future__ import annotations

from contextlib import contextmanager
from types import MethodType

import torch


def plain_lora(module, x: torch.Tensor, args: tuple, kwargs: dict) -> str | None:
    """The one active adapter's name when this PEFT LoRA Linear's forward is plain LoRA whose
    input needs no cast (autocast, or the adapter in the input's dtype), else None."""
    if args or kwargs or module.disable_adapters or module.merged or len(module.active_adapters) != 1:
        return None
    name = module.active_adapters[0]
    if (name not in module.lora_A or name in module.lora_variant or module.lora_B[name].bias is not None
            or not isinstance(module.lora_dropout[name], torch.nn.Identity)):
        return None
    device = x.device.type
    casts = torch.is_autocast_enabled(device) and torch.get_autocast_dtype(device) == x.dtype
    return name if casts or module.lora_A[name].weight.dtype == x.dtype else None


def forward(module, x: torch.Tensor, *args, **kwargs) -> torch.Tensor:
    """A PEFT LoRA Linear's forward with the scale in B's weight (PEFT's own where plain_lora says no)."""
    name = plain_lora(module, x, args, kwargs)
    if name is None:
        return type(module).forward(module, x, *args, **kwargs)
    result = module.base_layer(x)
    b = module.lora_B[name].weight * module.scaling[name]
    return (result + torch.nn.functional.linear(module.lora_A[name](x), b)).to(result.dtype)


@contextmanager
def scale_in_weight(model):
    """Inside: every PEFT LoRA Linear of `model` runs forward() above; on exit PEFT's forward again."""
    from peft.tuners.lora import Linear

    modules = [m for m in model.modules() if isinstance(m, Linear)]
    for m in modules:
        m.forward = MethodType(forward, m)
    try:
        yield model
    finally:
        for m in modules:
            del m.forward
