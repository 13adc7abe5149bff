"""Where LoRA's side work goes on the GPU: LAYERS Qwen3-8B decoder layers + LM head, 4 x 2048 packed, compiled
as the trainer runs them, with PEFT's LoRA r16 (all-linear) and without LoRA (gradients through every layer);
torch.profiler's CUDA kernel times over 5 steps after 4 warm-up steps, per kernel name and by kind."""
import json, os, sys, collections
import torch
from torch.profiler import profile, ProfilerActivity
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from fused_lora_layers import build, step  # noqa: E402
from peft.helpers import disable_input_dtype_casting  # noqa: E402

STEPS = 5


def kind(name):
    n = name.lower()
    if "nvjet" in n or "gemm" in n or "cutlass" in n or "xmma" in n: return "cublas_gemm"
    if "flex" in n or "attention" in n: return "attention"
    if n.startswith("triton"): return "triton_fused"
    if "elementwise" in n or "vectorized" in n or "reduce" in n: return "aten_elementwise"
    return "other"


def run(lora):
    m = build(lora)
    if not lora:
        m.model.embed_tokens.weight.requires_grad_(True)
        for n_, p in m.named_parameters():
            if "embed" not in n_: p.requires_grad_(False)
    with disable_input_dtype_casting(m, active=True):
        for _ in range(4): step(m)
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(STEPS): step(m)
            torch.cuda.synchronize()
    names = collections.Counter(); counts = collections.Counter()
    for e in prof.key_averages():
        if e.device_type == torch.autograd.DeviceType.CUDA and e.self_device_time_total > 0:
            names[e.key] += e.self_device_time_total / STEPS / 1e3; counts[e.key] += e.count / STEPS
    by_kind = collections.Counter()
    for k, v in names.items(): by_kind[kind(k)] += v
    del m; torch.cuda.empty_cache()
    return {"total_ms": round(sum(names.values()), 2), "by_kind_ms": {k: round(v, 2) for k, v in by_kind.most_common()},
            "kernels_ms": {k[:140]: [round(v, 3), counts[k]] for k, v in names.most_common(60)}}


out = {"gpu": torch.cuda.get_device_name(), "layers": int(os.environ.get("LAYERS", "8"))}
out["peft"] = run(True); torch._dynamo.reset()
out["no_lora"] = run(False)
diff = collections.Counter({k: out["peft"]["kernels_ms"].get(k, [0])[0] - out["no_lora"]["kernels_ms"].get(k, [0])[0]
                            for k in set(out["peft"]["kernels_ms"]) | set(out["no_lora"]["kernels_ms"])})
out["peft_minus_no_lora_ms"] = {k: round(v, 3) for k, v in diff.most_common(25)}
print(json.dumps({k: out[k] for k in ("gpu",)}), json.dumps(out["peft"]["by_kind_ms"]), out["peft"]["total_ms"],
      json.dumps(out["no_lora"]["by_kind_ms"]), out["no_lora"]["total_ms"])
for k, v in out["peft_minus_no_lora_ms"].items(): print(f"{v:8.3f}  {k}")
json.dump(out, open(os.environ.get("OUT", ".") + "/kernel_profile.json", "w"), indent=1)
