"""Issue 39's lever measured on 2026-11-28 and not landed: LoRA's projections as cuBLAS calls
with the adapter's scale folded in, instead of PEFT's lora_B(lora_A(x)) * scaling added to the
base's output (which torch.compile turns into two small products and fused elementwise passes).

The idea: PEFT's side work is memory passes over each projection's output and input gradient
(N = 8,192 tokens x up to 12,288 features), about 1.4 ms a Qwen3-8B layer on an H200; cuBLAS can
accumulate the low-rank product into the base's output in place (beta = 1), or take it in the
same product over an inner dimension extended by r (a wide projection's forward, a narrow one's
input gradient). Both are custom ops (torch.library), so torch.compile keeps them as written.

What it gave (README.md here): the same step time as PEFT's compiled forward in 8-layer runs,
within 1%. cuBLAS's in-place accumulation with K = 16 moves the output at 1.4-1.7 TB/s, about a
third of the H200's 4.8, and the product over [x | xA^T] took 1.28 ms where the base's over x
took 1.08 (gate's shape, the activation's copy included), so each gains back no more than it costs. The values and the adapter are
PEFT's (parity in README.md); kept here as the record of what was measured
(fused_lora_layers.py imports it).
"""
from __future__ import annotations

from contextlib import contextmanager
from types import MethodType

import torch
from torch import Tensor


@torch.library.custom_op("mindxtrain::lora_linear", mutates_args=())
def lora_linear(x: Tensor, weight: Tensor, bias: Tensor | None, a: Tensor, b: Tensor,
                scaling: float) -> tuple[Tensor, Tensor]:
    """x W^T (+ bias) + scaling * (x A^T) B^T, and x A^T (kept for the backward)."""
    flat = x.reshape(-1, x.shape[-1])
    low = flat @ a.to(flat.dtype).t()
    b = b.to(flat.dtype) * scaling
    if weight.shape[1] < weight.shape[0]:  # a wide projection: [x | xA^T] [W | sB]^T in one product
        out = torch.cat([flat, low], 1) @ torch.cat([weight, b], 1).t()
        if bias is not None:
            out += bias
    else:  # the low-rank product accumulated into the base's output
        out = flat @ weight.t() if bias is None else torch.addmm(bias, flat, weight.t())
        out.addmm_(low, b.t())
    return out.view(*x.shape[:-1], weight.shape[0]), low


@lora_linear.register_fake
def _lora_linear_shapes(x, weight, bias, a, b, scaling):
    rows = x.numel() // x.shape[-1]
    return x.new_empty(*x.shape[:-1], weight.shape[0]), x.new_empty(rows, a.shape[0])


@torch.library.custom_op("mindxtrain::lora_linear_backward", mutates_args=())
def lora_linear_backward(grad: Tensor, x: Tensor, weight: Tensor, a: Tensor, b: Tensor, low: Tensor,
                         scaling: float, input_grad: bool) -> tuple[Tensor, Tensor, Tensor]:
    """The gradients of x (empty where not needed), A and B. The base's gradient is not
    computed: only a frozen base comes here."""
    g = grad.reshape(-1, grad.shape[-1])
    flat = x.reshape(-1, x.shape[-1])
    g_low = g @ (b.to(g.dtype) * scaling)                     # (N, r)
    grad_b = (g.t() @ low).mul_(scaling).to(b.dtype)          # (out, r)
    grad_a = (g_low.t() @ flat).to(a.dtype)                   # (r, in)
    if not input_grad:
        return x.new_empty(0), grad_a, grad_b
    a = a.to(g.dtype)
    if weight.shape[0] < weight.shape[1]:  # a narrow projection: [g | g_low] [W ; A] in one product
        grad_x = torch.cat([g, g_low], 1) @ torch.cat([weight, a], 0)
    else:
        grad_x = g @ weight
        grad_x.addmm_(g_low, a)
    return grad_x.view(x.shape), grad_a, grad_b


@lora_linear_backward.register_fake
def _lora_linear_backward_shapes(grad, x, weight, a, b, low, scaling, input_grad):
    return x.new_empty(x.shape if input_grad else (0,)), torch.empty_like(a), torch.empty_like(b)


def _save(ctx, inputs, output):
    x, weight, _bias, a, b, scaling = inputs
    ctx.save_for_backward(x, weight, a, b, output[1])
    ctx.scaling = scaling


def _backward(ctx, grad, _grad_low):
    x, weight, a, b, low = ctx.saved_tensors
    input_grad = ctx.needs_input_grad[0]
    grad_x, grad_a, grad_b = lora_linear_backward(grad, x, weight, a, b, low, ctx.scaling, input_grad)
    return grad_x if input_grad else None, None, None, grad_a, grad_b, None


lora_linear.register_autograd(_backward, setup_context=_save)


def plain_lora(module, x: Tensor, args: tuple, kwargs: dict) -> str | None:
    """The one active adapter's name when this PEFT LoRA Linear's forward is plain LoRA on a frozen
    nn.Linear (the case lora_linear computes), else None."""
    if args or kwargs or module.disable_adapters or module.merged or len(module.active_adapters) != 1:
        return None
    name = module.active_adapters[0]
    base = module.base_layer
    if (name not in module.lora_A or name in module.lora_variant or module.lora_B[name].bias is not None
            or not isinstance(module.lora_dropout[name], torch.nn.Identity)
            or type(base) is not torch.nn.Linear or base.weight.requires_grad
            or (base.bias is not None and base.bias.requires_grad) or x.dtype != base.weight.dtype):
        return None
    device = x.device.type
    if torch.is_autocast_enabled(device) and torch.get_autocast_dtype(device) != x.dtype:
        return None
    return name


def fused_forward(module, x: Tensor, *args, **kwargs) -> Tensor:
    """A PEFT LoRA Linear's forward: lora_linear where plain_lora says it applies, PEFT's own else."""
    name = plain_lora(module, x, args, kwargs)
    if name is None:
        return type(module).forward(module, x, *args, **kwargs)
    base = module.base_layer
    out, _low = lora_linear(x, base.weight, base.bias, module.lora_A[name].weight, module.lora_B[name].weight,
                            float(module.scaling[name]))
    return out


@contextmanager
def fused_lora(model):
    """Inside: every PEFT LoRA Linear of `model` runs fused_forward (PEFT's modules, parameters and
    state dict untouched); on exit PEFT's forward again."""
    from peft.tuners.lora import Linear

    modules = [m for m in model.modules() if isinstance(m, Linear)]
    for m in modules:
        m.forward = MethodType(fused_forward, m)
    try:
        yield model
    finally:
        for m in modules:
            del m.forward
