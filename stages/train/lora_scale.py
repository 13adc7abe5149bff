"""LoRA's scale applied to B's weight instead of to B's output, A's product shared by the
projections that read one input, and the frozen base product added into LoRA's by cuBLAS.

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

With accumulate (training's default, settings.step_context), each group's outputs come from
one op, lora_accumulate: the low-rank product first, then the frozen base product added into
it by cuBLAS's epilogue, and in the backward the base's input gradients added into the
low-rank one the same way. The sum is then no pass of its own over the output, nor over the
input's gradient. Through the checkpoint stage's trainer, 36 Qwen3-8B layers on an H200, two
pairs of fresh processes on synthetic packed batches: 7.5 and 15 ms less a step of about 500 ms; 8 layers, kernel time
1.56 ms less a step (bench/results/lora_accumulate_h200_2026-12-02). Each base product's bf16
result is rounded once more than PEFT's sum (gradients within about 1.5% in norm). A base that
is not a plain bias-free nn.Linear in the input's dtype (QLoRA's quantized one, a biased q/k/v)
keeps the sum (accumulable).

PEFT's modules, parameters and saved adapter are untouched: inside scale_in_weight each PEFT
LoRA Linear runs forward() below, which falls back to PEFT's own wherever the case is not plain
LoRA (dropout, DoRA or another variant, a LoRA bias, adapters disabled or merged, several active,
extra arguments, an input PEFT would cast). Each patched forward is a plain function or closure,
which torch.compile traces into the layer's graph (a functools.partial broke it at every
projection under torch 2.11).
"""
from __future__ import annotations

from contextlib import contextmanager
import itertools
from types import MethodType

import torch
from torch import Tensor


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


@torch.library.custom_op("mindxtrain::lora_accumulate", mutates_args=())
def lora_accumulate(x: Tensor, weights: list[Tensor], a: Tensor, bs: list[Tensor]) -> list[Tensor]:
    """The outputs of LoRA projections that read one input x (tokens x in): each member's
    low-rank product h_i B_i^T first, then its frozen base product added into it by cuBLAS's
    epilogue (addmm_, beta = 1), so that no pass over the output adds the two. a: the members'
    A weights stacked (sum of ranks x in); bs: their B weights with the scale in them. The last
    output is h = x a^T, kept for the backward. An opaque op: inside a compiled graph inductor
    would split an addmm whose users are pointwise back into a matmul and an add."""
    h = x @ a.t()
    outs, start = [], 0
    for w, b in zip(weights, bs):
        out = h[:, start:start + b.shape[1]] @ b.t()
        outs.append(out.addmm_(x, w.t()))
        start += b.shape[1]
    return outs + [h]


@lora_accumulate.register_fake
def _(x, weights, a, bs):
    return [x.new_empty(x.shape[0], w.shape[0]) for w in weights] + [x.new_empty(x.shape[0], a.shape[0])]


@torch.library.custom_op("mindxtrain::lora_accumulate_backward", mutates_args=())
def lora_accumulate_backward(grads: list[Tensor], x: Tensor, h: Tensor, weights: list[Tensor], a: Tensor,
                             bs: list[Tensor]) -> list[Tensor]:
    """lora_accumulate's gradients [dx, da, db_1, ...]: the input's gradient is the low-rank
    part dh a first, then each member's base part added into it by addmm_ (no sum pass over
    the members' gradients)."""
    dh = torch.cat([g @ b for g, b in zip(grads, bs)], dim=1)
    dbs, start = [], 0
    for g, b in zip(grads, bs):
        dbs.append(g.t() @ h[:, start:start + b.shape[1]])
        start += b.shape[1]
    dx = dh @ a
    for g, w in zip(grads, weights):
        dx.addmm_(g, w)
    return [dx, dh.t() @ x] + dbs


@lora_accumulate_backward.register_fake
def _(grads, x, h, weights, a, bs):
    return [torch.empty_like(x), torch.empty_like(a)] + [torch.empty_like(b) for b in bs]


def _setup(ctx, inputs, output):
    x, weights, a, bs = inputs
    ctx.save_for_backward(x, output[-1], a, *weights, *bs)
    ctx.members = len(weights)


def _backward(ctx, grads):
    x, h, a, *rest = ctx.saved_tensors
    weights, bs = rest[:ctx.members], rest[ctx.members:]
    grads = [torch.zeros(x.shape[0], w.shape[0], dtype=x.dtype, device=x.device) if g is None else g
             for g, w in zip(grads[:ctx.members], weights)]
    dx, da, *dbs = lora_accumulate_backward(grads, x, h, list(weights), a, list(bs))
    return dx, [None] * ctx.members, da, dbs


lora_accumulate.register_autograd(_backward, setup_context=_setup)


# Projections of one decoder layer that read the same input, by the names Llama-like models use.
SHARED_INPUT = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))


def accumulable(module, name: str, x: Tensor) -> bool:
    """Whether lora_accumulate computes this plain LoRA projection as PEFT would: a frozen
    nn.Linear base without bias, in x's dtype (a quantized base, QLoRA's, is another module)."""
    base = module.base_layer
    return (type(base) is torch.nn.Linear and base.bias is None and not base.weight.requires_grad
            and base.weight.dtype == x.dtype and x.dtype in (torch.bfloat16, torch.float16, torch.float32))


class SharedInput:
    """PEFT LoRA Linears of one layer that read the same input. The first of them called with an
    input computes every member's lora_A product in one matmul (the input read once; in the
    backward one input gradient and one pass over the input for A's gradients instead of one per
    member); the others take their slice while the input is the same tensor. With accumulate,
    the first computes every member's whole output through lora_accumulate instead (a group
    may then be a single projection). After the last member the group lets go of the input, so
    a compiled layer starts each call with nothing held. A member called with another input (a
    model whose projections read different inputs) computes the product again: slower, never
    wrong."""

    def __init__(self, members: list, name: str, accumulate: bool = False):
        self.members, self.accumulate = members, accumulate
        ends = list(itertools.accumulate(m.lora_A[name].out_features for m in members))
        self.ranks = list(zip([0] + ends[:-1], ends))  # each member's slice of the stacked A product
        self.x = self.h = None
        self.taken = 0

    def take(self, found):
        self.taken += 1
        if self.taken == len(self.members):
            self.x = self.h = None
        return found

    def lora_a(self, module, name: str, x: Tensor, index: int) -> Tensor:
        if self.x is not x:
            if any(plain_lora(m, x, (), {}) != name for m in self.members):
                return module.lora_A[name](x)
            a = torch.cat([m.lora_A[name].weight for m in self.members])
            self.x, self.h, self.taken = x, torch.nn.functional.linear(x, a), 0
        start, stop = self.ranks[index]
        return self.take(self.h[..., start:stop])

    def output(self, name: str, x: Tensor, index: int) -> Tensor | None:
        """Member index's output through lora_accumulate, or None where that is not PEFT's."""
        if self.x is not x:
            if any(plain_lora(m, x, (), {}) != name or not accumulable(m, name, x) for m in self.members):
                return None
            flat = x.reshape(-1, x.shape[-1])
            a = torch.cat([m.lora_A[name].weight for m in self.members]).to(x.dtype)
            bs = [(m.lora_B[name].weight * m.scaling[name]).to(x.dtype) for m in self.members]
            outs = lora_accumulate(flat, [m.base_layer.weight for m in self.members], a, bs)
            self.x, self.h, self.taken = x, outs[:-1], 0
        return self.take(self.h[index].view(*x.shape[:-1], -1))


def forward(module, x: Tensor, *args, group: SharedInput | None = None, index: int = 0, **kwargs) -> Tensor:
    """A PEFT LoRA Linear's forward with the scale in B's weight and, in a group, A's product
    shared or the whole output accumulated (PEFT's own where plain_lora says no)."""
    name = plain_lora(module, x, args, kwargs)
    if name is None:
        return type(module).forward(module, x, *args, **kwargs)
    if group is not None and group.accumulate:
        out = group.output(name, x, index)
        if out is not None:
            return out
        group = None
    result = module.base_layer(x)
    h = group.lora_a(module, name, x, index) if group is not None else module.lora_A[name](x)
    b = module.lora_B[name].weight * module.scaling[name]
    return (result + torch.nn.functional.linear(h, b)).to(result.dtype)


def member_forward(group: SharedInput, index: int):
    """A group member's forward, as a closure."""
    def member(module, x: Tensor, *args, **kwargs) -> Tensor:
        return forward(module, x, *args, group=group, index=index, **kwargs)
    return member


def groups(model, modules: list, accumulate: bool = False) -> dict:
    """Each LoRA Linear of a SharedInput group -> its forward: siblings named in SHARED_INPUT,
    all LoRA Linears with one adapter, of one name; with accumulate, every other LoRA Linear
    with one adapter a group of its own."""
    found = {}
    for parent in model.modules():
        for names in SHARED_INPUT:
            members = [getattr(parent, n, None) for n in names]
            if not all(m in modules for m in members):
                continue
            adapters = {tuple(m.lora_A) for m in members}
            if len(adapters) != 1 or len(next(iter(adapters))) != 1:
                continue
            found.update(group_forwards(members, next(iter(adapters))[0], accumulate))
    if accumulate:
        for m in modules:
            if m not in found and len(m.lora_A) == 1:
                found.update(group_forwards([m], next(iter(m.lora_A)), True))
    return found


def group_forwards(members: list, name: str, accumulate: bool) -> dict:
    """Each member of one SharedInput -> its forward."""
    group = SharedInput(members, name, accumulate)
    return {m: member_forward(group, index) for index, m in enumerate(members)}


@contextmanager
def scale_in_weight(model, share_inputs: bool = True, accumulate: bool = False):
    """Inside: every PEFT LoRA Linear of `model` runs forward() above: sharing A's product within
    its SharedInput group and, with accumulate, its whole output through lora_accumulate, unless
    share_inputs is False (then one A product per projection, PEFT's values to the bit with a
    power-of-two scale); on exit PEFT's forward again."""
    from peft.tuners.lora import Linear

    modules = [m for m in model.modules() if isinstance(m, Linear)]
    shared = groups(model, modules, accumulate) if share_inputs else {}
    for m in modules:
        m.forward = MethodType(shared.get(m, forward), m)
    try:
        yield model
    finally:
        for m in modules:
            del m.forward
