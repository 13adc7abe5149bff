"""Does cuBLASLt (torch.backends.cuda.preferred_blas_library) run the LoRA layer's matmuls faster than
cuBLAS, torch's default for plain bf16 products?

One Qwen3-8B layer's four LoRA groups (q/k/v, o, gate/up, down), 8,192 tokens, r16, bf16, through
stages.train.lora_scale's lora_accumulate and its backward (what training runs), and the 8192^3
product train_speed measures its peak with. The backends side by side for each op on the same tensors, six rounds (call 1: each backend
through all ops in turn, three rounds);
CUDA events, median of 30 after 5 warm-ups. Outputs of the two backends compared."""
import json
import statistics
import sys

import torch

sys.path.insert(0, ".")
from stages.train.lora_scale import lora_accumulate, lora_accumulate_backward  # noqa: E402

M, R = 8192, 16
GROUPS = {"qkv": (4096, [4096, 1024, 1024]), "o": (4096, [4096]), "gate_up": (4096, [12288, 12288]),
          "down": (12288, [4096])}
BACKENDS = ("cublas", "cublaslt")
ROUNDS = 6
dev = torch.device("cuda")
torch.manual_seed(0)


def timed(fn, n=30, warm=5):
    for _ in range(warm):
        fn()
    times = []
    for _ in range(n):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record(); fn(); e.record(); torch.cuda.synchronize()
        times.append(s.elapsed_time(e))
    return statistics.median(times)


tensors = {}
for name, (k, ns) in GROUPS.items():
    x = torch.randn(M, k, device=dev, dtype=torch.bfloat16)
    ws = [torch.randn(n, k, device=dev, dtype=torch.bfloat16) / k ** 0.5 for n in ns]
    a = torch.randn(R * len(ns), k, device=dev, dtype=torch.bfloat16) / k ** 0.5
    bs = [torch.randn(n, R, device=dev, dtype=torch.bfloat16) for n in ns]
    grads = [torch.randn(M, n, device=dev, dtype=torch.bfloat16) for n in ns]
    tensors[name] = (x, ws, a, bs, grads)
sq = [torch.randn(8192, 8192, device=dev, dtype=torch.bfloat16) for _ in range(2)]

out = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "rounds": [], "check": {}}
for backend in BACKENDS:
    torch.backends.cuda.preferred_blas_library(backend)
    for name, (x, ws, a, bs, grads) in tensors.items():
        outs = lora_accumulate(x, ws, a, bs)
        out["check"].setdefault(name, []).append([o.float().norm().item() for o in outs[:-1]])
for _ in range(ROUNDS):
    row = {}
    for name, (x, ws, a, bs, grads) in tensors.items():  # the backends side by side for each op: clocks drift
        for backend in BACKENDS:
            torch.backends.cuda.preferred_blas_library(backend)
            h = lora_accumulate(x, ws, a, bs)[-1]
            row[f"{backend}_{name}_forward"] = timed(lambda: lora_accumulate(x, ws, a, bs))
            row[f"{backend}_{name}_backward"] = timed(lambda: lora_accumulate_backward(grads, x, h, ws, a, bs))
    for backend in BACKENDS:
        torch.backends.cuda.preferred_blas_library(backend)
        row[f"{backend}_peak_tflops"] = 2 * 8192 ** 3 / timed(lambda: sq[0] @ sq[1]) / 1e9
        row[f"{backend}_layer_ms"] = sum(v for key, v in row.items() if key.startswith(backend + "_") and key.endswith("ward"))
    out["rounds"].append(row)
    print(json.dumps({k: round(v, 3) for k, v in row.items()}), flush=True)
saved = [36 * (r["cublas_layer_ms"] - r["cublaslt_layer_ms"]) for r in out["rounds"]]
out["ms_saved_a_36_layer_step_by_round"] = saved
print("cuBLASLt saves, ms a 36-layer step, by round:", [round(s, 2) for s in saved])
json.dump(out, open(sys.argv[1], "w"), indent=1)
