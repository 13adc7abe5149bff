"""Where the time goes: one step of `current` or `accumulate` (layers.py's harness) under
torch.profiler after the warm-ups, CUDA kernels summed by name.

    python step_kernels.py VARIANT    one process; its kernel table as the last line (JSON)"""
import json, os, sys
import torch
from torch.profiler import ProfilerActivity, profile
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import layers as L  # noqa: E402

variant = sys.argv[1]
m, b = L.build(), L.batch()
opt = torch.optim.AdamW([p for p in m.parameters() if p.requires_grad], lr=1e-4, fused=True)
with L.context(m, variant == "accumulate"):
    for _ in range(5):
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
