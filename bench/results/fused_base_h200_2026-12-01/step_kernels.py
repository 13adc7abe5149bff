"""Where the fused variant's extra time goes: one step of `current` and of `fused` or `fused_op`
(layers.py's 8-layer harness) under torch.profiler after the warm-ups, CUDA kernels summed by name; prints
each variant's kernel total and the kernels whose time differs most between the two.

    python step_kernels.py VARIANT    one process; its kernel table as the last line (JSON)"""
import json, os, sys
import torch
from torch.profiler import ProfilerActivity, profile
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import layers as L  # noqa: E402

variant = sys.argv[1]
m, b = L.build(False), L.batch()
opt = torch.optim.AdamW([p for p in m.parameters() if p.requires_grad], lr=1e-4, fused=True)
with L.context(m, {"fused": True, "fused_op": "op"}.get(variant, False)):
    for _ in range(6):
        L.step(m, b, opt)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(3):
            L.step(m, b, opt)
        torch.cuda.synchronize()
kernels = {}
for e in prof.key_averages():
    if e.device_type == torch.autograd.DeviceType.CUDA and e.self_device_time_total > 0:
        kernels[e.key[:90]] = (round(e.self_device_time_total / 3e3, 3), e.count // 3)  # ms a step, calls a step
print(json.dumps({"variant": variant, "total_ms": round(sum(t for t, _ in kernels.values()), 2), "kernels": kernels}))
