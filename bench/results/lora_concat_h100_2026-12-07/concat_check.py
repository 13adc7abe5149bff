"""Would LoRA's low-rank product ride inside the base matmul as 16 more columns of its inner dimension?

One Qwen3-8B layer's two shared-input groups (q/k/v, gate/up), 8,192 tokens, LoRA r16, bf16:
- current: stages.train.lora_scale's lora_accumulate and its backward (low-rank product written, base added
  by addmm_'s epilogue; the input's gradient dh a, then each member's base part added by addmm_);
- concat: x_ext = [x | x A^T] once, each member's output one matmul of x_ext's prefix by [W | 0 | B]
  (its weight extended by the slots of the members before it and its own B); the backward's one
  accumulated matmul per member gives [dx_base | dh] together, then dx = dx_base + dh A.
Forward and backward timed apart (CUDA events, median of 40 after 5 warm-ups), rounds alternating, and the
values checked against an fp32 reference."""
import json
import statistics
import sys

import torch

sys.path.insert(0, ".")
from stages.train.lora_scale import lora_accumulate, lora_accumulate_backward  # noqa: E402

M, K, R = 8192, 4096, 16
GROUPS = {"qkv": [4096, 1024, 1024], "gate_up": [12288, 12288]}
dev = torch.device("cuda")
torch.manual_seed(0)


def concat_forward(x, exts, a):
    h = x @ a.t()
    xe = torch.cat([x, h], 1)
    return [xe[:, :e.shape[1]] @ e.t() for e in exts], xe


def concat_backward(grads, xe, exts, a):
    order = sorted(range(len(exts)), key=lambda i: -exts[i].shape[1])
    first = order[0]
    dxe = grads[first] @ exts[first]
    for i in order[1:]:
        dxe[:, :exts[i].shape[1]].addmm_(grads[i], exts[i])
    dh = dxe[:, K:]
    dx = torch.addmm(dxe[:, :K], dh, a)
    da = dh.t() @ xe[:, :K]
    dbs = [grads[i].t() @ xe[:, K + R * i:K + R * (i + 1)] for i in range(len(exts))]
    return [dx, da] + dbs


def timed(fn, n=40, warm=5):
    for _ in range(warm):
        fn()
    times = []
    for _ in range(n):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record(); fn(); e.record(); torch.cuda.synchronize()
        times.append(s.elapsed_time(e))
    return statistics.median(times)


out = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "groups": {}}
for name, ns in GROUPS.items():
    x = torch.randn(M, K, device=dev, dtype=torch.bfloat16)
    ws = [torch.randn(n, K, device=dev, dtype=torch.bfloat16) / K ** 0.5 for n in ns]
    a = torch.randn(R * len(ns), K, device=dev, dtype=torch.bfloat16) / K ** 0.5
    bs = [torch.randn(n, R, device=dev, dtype=torch.bfloat16) for n in ns]
    grads = [torch.randn(M, n, device=dev, dtype=torch.bfloat16) for n in ns]
    exts = []
    for i, (w, b) in enumerate(zip(ws, bs)):
        e = torch.zeros(w.shape[0], K + R * (i + 1), device=dev, dtype=torch.bfloat16)
        e[:, :K] = w
        e[:, K + R * i:] = b
        exts.append(e)
    # values against fp32
    f = [t.float() for t in (x, a)]
    h32 = f[0] @ f[1].t()
    ref = [h32[:, R * i:R * (i + 1)] @ b.float().t() + f[0] @ w.float().t() for i, (w, b) in enumerate(zip(ws, bs))]
    cur = lora_accumulate(x, ws, a, bs)
    new, xe = concat_forward(x, exts, a)
    err = lambda got, want: ((got.float() - want).norm() / want.norm()).item()
    check = {"forward_current": max(err(c, r) for c, r in zip(cur[:-1], ref)),
             "forward_concat": max(err(c, r) for c, r in zip(new, ref))}
    gcur = lora_accumulate_backward(grads, x, cur[-1], ws, a, bs)
    gnew = concat_backward(grads, xe, exts, a)
    check["backward_concat_vs_current"] = max(err(n_, c.float()) for n_, c in zip(gnew, gcur))
    rounds = []
    for _ in range(3):
        rounds.append({
            "current_forward": timed(lambda: lora_accumulate(x, ws, a, bs)),
            "concat_forward": timed(lambda: concat_forward(x, exts, a)),
            "current_backward": timed(lambda: lora_accumulate_backward(grads, x, cur[-1], ws, a, bs)),
            "concat_backward": timed(lambda: concat_backward(grads, xe, exts, a)),
        })
    out["groups"][name] = {"check": check, "rounds": rounds}
    print(name, json.dumps(check), json.dumps(rounds), flush=True)
saved = []
for r in range(3):
    d = sum(out["groups"][g]["rounds"][r][f"current_{p}"] - out["groups"][g]["rounds"][r][f"concat_{p}"]
            for g in GROUPS for p in ("forward", "backward"))
    saved.append(d * 36)
out["ms_saved_a_36_layer_step_by_round"] = saved
print("ms saved a 36-layer step, by round:", [round(s, 2) for s in saved])
json.dump(out, open(sys.argv[1], "w"), indent=1)
