"""Kernel breakdown of jagged SDPA for the batch's decode step. Kept as the record of what ran."""
import os, sys, json
sys.argv = [sys.argv[0]]
src = open(os.path.join(os.path.dirname(__file__), "njt_bench.py")).read().split("ctx = lambda")[0]
exec(src)
from torch.profiler import profile, ProfilerActivity

def njt_flat(q, k, v, cu_q, cu_k, max_q, max_k, causal):
    qv = q[0].transpose(0, 1)  # [Q, H, D] (a copy here; contiguous in the model)
    kf = k[0].transpose(0, 1).unsqueeze(2).expand(-1, KVH, G, D).reshape(-1, H, D)
    vf = v[0].transpose(0, 1).unsqueeze(2).expand(-1, KVH, G, D).reshape(-1, H, D)
    nq = torch.nested.nested_tensor_from_jagged(qv, cu_q, min_seqlen=1, max_seqlen=max_q)
    nk = torch.nested.nested_tensor_from_jagged(kf, cu_k, min_seqlen=1, max_seqlen=max_k)
    nv = torch.nested.nested_tensor_from_jagged(vf, cu_k, min_seqlen=1, max_seqlen=max_k)
    o = F.scaled_dot_product_attention(nq.transpose(1, 2), nk.transpose(1, 2), nv.transpose(1, 2), is_causal=causal, scale=D ** -0.5)
    return o.transpose(1, 2).values()

ctx = lambda R, c: [c + (i * 37) % 120 - 60 for i in range(R)]
out = {}
for R in (8, 32, 128):
    qlens, klens = [1] * R, ctx(R, 190)
    q, k, v, mask, cu_q, cu_k = setup(qlens, klens)
    # the model's layout: k, v as transposed views of [Kp, KVH, D], q of [Q, H, D]
    k = k[0].transpose(0, 1).contiguous().transpose(0, 1).unsqueeze(0)
    v = v[0].transpose(0, 1).contiguous().transpose(0, 1).unsqueeze(0)
    q = q[0].transpose(0, 1).contiguous().transpose(0, 1).unsqueeze(0)
    ref = masked(q, k, v, mask)[0].transpose(0, 1)
    for name, fn in (("repeat_interleave", lambda: njt(q, k, v, cu_q, cu_k, 1, k.shape[2], True)),
                     ("expand_reshape", lambda: njt_flat(q, k, v, cu_q, cu_k, 1, k.shape[2], True)),
                     ("expand_reshape_maxq_static", lambda: njt_flat(q, k, v, cu_q, cu_k, q.shape[2], k.shape[2], True)),
                     ("grouped", lambda: njt_grouped(q, k, v, cu_q, cu_k, 1, k.shape[2]))):
        o = fn()
        d = float((o.float() - ref.float()).abs().max())
        for _ in range(3): fn()
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as p:
            for _ in range(10): fn()
            torch.cuda.synchronize()
        kern = sorted(((e.key[:70], round(e.self_device_time_total / 10, 1)) for e in p.key_averages() if e.self_device_time_total > 0), key=lambda x: -x[1])
        out[f"{name}_{R}"] = {"maxdiff": d, "gpu_us": round(sum(x[1] for x in kern), 1), "kernels": kern[:6]}
        print(name, R, json.dumps(out[f"{name}_{R}"]), flush=True)
json.dump(out, open(os.path.join(os.environ.get("OUT", "/tmp"), "njt2.json"), "w"), indent=1)
