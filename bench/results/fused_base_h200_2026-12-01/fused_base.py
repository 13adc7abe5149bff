"""The frozen base matmuls of the projections that read one input (q/k/v, gate/up) as one
matmul each, beside LoRA's scale in B's weight (stages/train/lora_scale.py).

Each member's base weight becomes a row slice of one contiguous tensor (no copy kept: the
members' weights are views of it, so saving, merging or restoring them writes the same
memory). The first member called with an input computes the whole group's base product; the
others take their column slice while the input is the same tensor. In the backward the
members' output gradients are one tensor and the input's base gradient one matmul with the
summed inner dimension, instead of one matmul per member and a sum of their results. LoRA's
products stay per member."""
from __future__ import annotations

from contextlib import contextmanager
from types import MethodType

import torch

from stages.train.lora_scale import plain_lora

SHARED_INPUT = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))


@torch.library.custom_op("mindxtrain_bench::grouped_linear", mutates_args=())
def grouped_linear(x: torch.Tensor, weight: torch.Tensor, sizes: list[int]) -> list[torch.Tensor]:
    """The group's base product, its parts copied out: an op inductor does not look into, so its
    gradient is grouped_linear_input_grad's one concatenation, not a zero-filled tensor per part."""
    return [p.contiguous() for p in torch.nn.functional.linear(x, weight).split(sizes, dim=-1)]


@grouped_linear.register_fake
def _(x, weight, sizes):
    return [x.new_empty(*x.shape[:-1], n) for n in sizes]


@torch.library.custom_op("mindxtrain_bench::grouped_linear_input_grad", mutates_args=())
def grouped_linear_input_grad(grads: list[torch.Tensor], weight: torch.Tensor) -> torch.Tensor:
    return torch.cat(grads, dim=-1) @ weight


@grouped_linear_input_grad.register_fake
def _(grads, weight):
    return grads[0].new_empty(*grads[0].shape[:-1], weight.shape[1])


def _setup(ctx, inputs, output):
    ctx.save_for_backward(inputs[1])
    ctx.sizes = inputs[2]


def _backward(ctx, grads):
    (weight,) = ctx.saved_tensors
    shape = next(g for g in grads if g is not None).shape[:-1]
    grads = [g if g is not None else weight.new_zeros(*shape, n) for g, n in zip(grads, ctx.sizes)]
    return grouped_linear_input_grad(grads, weight), None, None


grouped_linear.register_autograd(_backward, setup_context=_setup)


class FusedBase:
    """One group's fused base weight and the product of the input it last saw."""

    def __init__(self, members: list, op: bool = False):
        self.members, self.op = members, op
        weights = [m.base_layer.weight for m in members]
        self.weight = torch.cat([w.detach() for w in weights])
        self.slices, start = [], 0
        for m, w in zip(members, weights):
            stop = start + w.shape[0]
            m.base_layer.weight = torch.nn.Parameter(self.weight[start:stop], requires_grad=False)
            self.slices.append((start, stop))
            start = stop
        self.sizes = [stop - start for start, stop in self.slices]
        self.x = self.parts = None
        self.taken = 0

    def base(self, i: int, x: torch.Tensor) -> torch.Tensor:
        """Member i's part of the group's base product. The parts come from one split, whose
        gradient is one concatenation of theirs; a slice per member (call 1) made each gradient a
        zero-filled full-width tensor, and inductor summed those (2.5 ms a layer)."""
        if self.x is not x:
            self.x, self.taken = x, 0
            self.parts = (grouped_linear(x, self.weight, self.sizes) if self.op else
                          torch.nn.functional.linear(x, self.weight).split(self.sizes, dim=-1))
        y = self.parts[i]
        self.taken += 1
        if self.taken == len(self.members):
            self.x = self.parts = None
        return y


def forward(module, x: torch.Tensor, *args, group: FusedBase | None = None, index: int = 0, **kwargs):
    name = plain_lora(module, x, args, kwargs)
    if name is None:
        return type(module).forward(module, x, *args, **kwargs)
    result = group.base(index, x) if group is not None else module.base_layer(x)
    b = module.lora_B[name].weight * module.scaling[name]
    return (result + torch.nn.functional.linear(module.lora_A[name](x), b)).to(result.dtype)


def member_forward(group: FusedBase, index: int):
    """Member index's forward as a plain Python function: dynamo traces a closure, while a
    functools.partial (calls 1-6) broke the layer's graph at every member (call 6's logs)."""
    def member(module, x, *args, **kwargs):
        return forward(module, x, *args, group=group, index=index, **kwargs)
    return member


def groups(model, modules: list, op: bool = False) -> dict:
    found = {}
    for parent in model.modules():
        for names in SHARED_INPUT:
            members = [getattr(parent, n, None) for n in names]
            if not all(m in modules for m in members):
                continue
            bases = [m.base_layer for m in members]
            if not all(type(b) is torch.nn.Linear and b.bias is None for b in bases):
                continue
            if len({(b.in_features, b.weight.dtype, b.weight.device) for b in bases}) != 1:
                continue
            group = FusedBase(members, op)
            for i, m in enumerate(members):
                found[m] = member_forward(group, i)
    return found


@contextmanager
def fused_base(model, fuse: bool = True, op: bool = False):
    """Inside: the PEFT LoRA Linears with LoRA's scale in B's weight and the groups' base products
    fused, through grouped_linear where `op` (not yet run on a GPU), else through autograd's split."""
    from peft.tuners.lora import Linear

    modules = [m for m in model.modules() if isinstance(m, Linear)]
    fused = groups(model, modules, op) if fuse else {}
    for m in modules:
        m.forward = MethodType(fused.get(m, forward), m)
    try:
        yield model
    finally:
        for m in modules:
            del m.forward
