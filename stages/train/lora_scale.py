"""LoRA's scale applied to B's weight instead of to B's output, and A's product shared by the
projections that read one input.

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

The projections that read one input (q, k and v; gate and up) also share their lora_A product:
one matmul over their A weights concatenated, each taking its slice (SharedInput). 8 compiled
layers on an H200, three rounds of fresh processes: 0.5-2.1 ms less a step of about 140 ms; the
checkpoint stage's trainer at 36 layers, two pairs: 0.9-1.2% more tokens/s, same peak memory
(bench/results/lora_shared_input_h200_2026-11-29, calls 2 and 3). The input's gradient is then
one sum over the members' ranks, in another order than PEFT's: values within rounding of
PEFT's, not to the bit (share_inputs=False gives the bit-exact path).

PEFT's modules, parameters and saved adapter are untouched: inside scale_in_weight each PEFT
LoRA Linear runs forward() below, which falls back to PEFT's own wherever the case is not plain
LoRA (dropout, DoRA or another variant, a LoRA bias, adapters disabled or merged, several active,
extra arguments, an input PEFT would cast). Each patched forward is a plain function or closure,
which torch.compile traces into the layer's graph (a functools.partial broke it at every
projection under torch 2.11).
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


# Projections of one decoder layer that read the same input, by the names Llama-like models use.
SHARED_INPUT = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))


class SharedInput:
    """PEFT LoRA Linears of one layer that read the same input. The first of them called with an
    input computes every member's lora_A product in one matmul (the input read once; in the
    backward one input gradient and one pass over the input for A's gradients instead of one per
    member); the others take their slice while the input is the same tensor. After the last
    member the group lets go of the input, so a compiled layer starts each call with nothing
    held. A member called with another input (a model whose projections read different inputs)
    computes the product again: slower, never wrong."""

    def __init__(self, members: list):
        self.members = members
        self.x = self.h = None
        self.taken = 0

    def lora_a(self, module, name: str, x: torch.Tensor, start: int, stop: int) -> torch.Tensor:
        if self.x is not x:
            if any(plain_lora(m, x, (), {}) != name for m in self.members):
                return module.lora_A[name](x)
            a = torch.cat([m.lora_A[name].weight for m in self.members])
            self.x, self.h, self.taken = x, torch.nn.functional.linear(x, a), 0
        h = self.h[..., start:stop]
        self.taken += 1
        if self.taken == len(self.members):
            self.x = self.h = None
        return h


def forward(module, x: torch.Tensor, *args, group: SharedInput | None = None, start: int = 0, stop: int = 0,
            **kwargs) -> torch.Tensor:
    """A PEFT LoRA Linear's forward with the scale in B's weight and, in a group, A's product
    shared (PEFT's own where plain_lora says no)."""
    name = plain_lora(module, x, args, kwargs)
    if name is None:
        return type(module).forward(module, x, *args, **kwargs)
    result = module.base_layer(x)
    h = group.lora_a(module, name, x, start, stop) if group is not None else module.lora_A[name](x)
    b = module.lora_B[name].weight * module.scaling[name]
    return (result + torch.nn.functional.linear(h, b)).to(result.dtype)


def member_forward(group: SharedInput, start: int, stop: int):
    """A group member's forward, as a closure."""
    def member(module, x: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        return forward(module, x, *args, group=group, start=start, stop=stop, **kwargs)
    return member


def groups(model, modules: list) -> dict:
    """Each LoRA Linear of a SharedInput group -> its forward: siblings named in SHARED_INPUT,
    all LoRA Linears with one adapter, of one name."""
    found = {}
    for parent in model.modules():
        for names in SHARED_INPUT:
            members = [getattr(parent, n, None) for n in names]
            if not all(m in modules for m in members):
                continue
            adapters = {tuple(m.lora_A) for m in members}
            if len(adapters) != 1 or len(next(iter(adapters))) != 1:
                continue
            name, group, start = next(iter(adapters))[0], SharedInput(members), 0
            for m in members:
                stop = start + m.lora_A[name].out_features
                found[m] = member_forward(group, start, stop)
                start = stop
    return found


@contextmanager
def scale_in_weight(model, share_inputs: bool = True):
    """Inside: every PEFT LoRA Linear of `model` runs forward() above (sharing A's product within
    its SharedInput group unless share_inputs is False); on exit PEFT's forward again."""
    from peft.tuners.lora import Linear

    modules = [m for m in model.modules() if isinstance(m, Linear)]
    shared = groups(model, modules) if share_inputs else {}
    for m in modules:
        m.forward = MethodType(shared.get(m, forward), m)
    try:
        yield model
    finally:
        for m in modules:
            del m.forward
