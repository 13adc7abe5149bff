"""Where one eager training step's time goes, by part of the model: attention, MLP, the LoRA side
matmuls, norms and RoPE, the loss head, the optimizer, and the rest (embedding, residual adds).

Forward hooks open a profiler range (torch.profiler.record_function) for each module of a part
while it runs; the loss and the optimizer's step get ranges of their own. Under torch.profiler,
each operation's own time (its kernels' on a GPU, its CPU time on the CPU) goes to the innermost
part range around it. An operation of the backward pass runs in autograd's engine, outside
every range: it goes to the part of the forward operation that made its autograd node (the
profiler gives both the same sequence number). What a part does outside its modules is not its
own: RoPE's rotation is applied inside the attention module, so it counts as attention (only
the cos/sin table, rotary_emb, counts as RoPE). Compiled layers fuse across parts, so the step
is broken down eager: the compiled step's total beside it says what compiling saves."""
from __future__ import annotations

TAG = "part:"
PARTS = ("attention", "mlp", "lora", "norms_rope", "loss_head", "optimizer", "other")
BACKWARD = "autograd::engine::evaluate_function"


def part_of(name: str, module) -> str | None:
    """The part a module's own operations count to; None: its parent's."""
    dotted = f".{name}."
    if ".lora_A." in dotted or ".lora_B." in dotted:
        return "lora" if not list(module.children()) else None
    if type(module).__name__.endswith("RMSNorm") or name.endswith("rotary_emb"):
        return "norms_rope"
    leaf = name.rsplit(".", 1)[-1]
    return {"self_attn": "attention", "mlp": "mlp", "lm_head": "loss_head"}.get(leaf)


def tag_modules(model) -> list:
    """Hooks that open a part's range around each of its modules; returns their handles."""
    from torch.profiler import record_function

    handles, open_ranges = [], []

    def enter(part):
        def hook(module, args):
            open_ranges.append(record_function(TAG + part).__enter__())
        return hook

    def leave(module, args, output):
        open_ranges.pop().__exit__(None, None, None)

    for name, module in model.named_modules():
        part = part_of(name, module)
        if part:
            handles += [module.register_forward_pre_hook(enter(part)), module.register_forward_hook(leave)]
    return handles


def attribute(events, on_gpu: bool) -> dict[str, float]:
    """Seconds per part of the profiled operations (CPU-side events of torch.profiler's events())."""
    import torch

    cpu = [e for e in events if e.device_type == torch.autograd.DeviceType.CPU]

    def enclosing(e):
        """The innermost part range around e, or the backward node e runs in."""
        while e is not None:
            if e.name.startswith(TAG):
                return ("part", e.name[len(TAG):])
            if e.name.startswith(BACKWARD):
                return ("node", e.sequence_nr)
            e = e.cpu_parent
        return None

    made_by = {}  # autograd sequence number -> the part of the forward operation that made the node
    for e in cpu:
        where = enclosing(e)
        if e.sequence_nr >= 0 and where and where[0] == "part":
            made_by.setdefault(e.sequence_nr, where[1])
    seconds = dict.fromkeys(PARTS, 0.0)
    for e in cpu:
        own = (e.self_device_time_total if on_gpu else e.self_cpu_time_total) / 1e6
        if own <= 0 or e.name.startswith(TAG):
            continue
        where = enclosing(e)
        part = "other" if where is None else where[1] if where[0] == "part" else made_by.get(where[1], "other")
        seconds[part] += own
    return seconds


def breakdown(model, step, batch_tokens: int, on_gpu: bool) -> dict:
    """Profile `step` (forward as `loss_fn(model)`, then backward and the optimizer's step, each
    under its part range where it has one) once on the tagged model; seconds and shares by part."""
    from torch.profiler import ProfilerActivity, profile

    handles = tag_modules(model)
    try:
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if on_gpu else [])
        with profile(activities=activities) as prof:
            step()
    finally:
        for h in handles:
            h.remove()
    seconds = attribute(prof.events(), on_gpu)
    total = sum(seconds.values())
    return {"seconds": {p: round(s, 4) for p, s in seconds.items()},
            "share": {p: round(s / total, 3) for p, s in seconds.items()},
            "total_seconds": round(total, 4), "tokens": batch_tokens}
