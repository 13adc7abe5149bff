"""The batch's decode attention, alone: each backend on the shapes a served step has (8B shape's
heads, R requests of ~190 tokens of context, keys padded to 1024s, block-diagonal mask), time per
call (CUDA events, median of 50) and max abs difference from an fp32 reference. Kept as the record of what ran."""
import json, os, statistics, sys
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

torch.manual_seed(0)
dev, dt = "cuda", torch.bfloat16
KVH, G, D = 8, 4, 128
res = {}


def timeit(fn, n=50):
    for _ in range(5):
        fn()
    ts = []
    for _ in range(n):
        a, b = torch.cuda.Event(True), torch.cuda.Event(True)
        a.record(); fn(); b.record(); torch.cuda.synchronize()
        ts.append(a.elapsed_time(b) * 1000)
    return statistics.median(ts)


def case(R, ctx, qlen=1):
    lens = [ctx + (i * 37) % 120 - 60 for i in range(R)]  # contexts around ctx
    rows = R * qlen
    L = -(-(sum(lens)) // 1024) * 1024
    q = torch.randn(1, KVH * G, rows, D, device=dev, dtype=dt)
    k = torch.randn(1, KVH, L, D, device=dev, dtype=dt)
    v = torch.randn(1, KVH, L, D, device=dev, dtype=dt)
    mask = torch.full((1, 1, rows, L), torch.finfo(dt).min, device=dev, dtype=dt)
    start = 0
    for i, n in enumerate(lens):
        for j in range(qlen):
            mask[0, 0, i * qlen + j, start:start + n - qlen + j + 1] = 0
        start += n
    scale = D ** -0.5
    grouped_q = q.reshape(1, KVH, G * rows, D)
    gmask = mask.repeat(1, 1, G, 1)
    ref = F.scaled_dot_product_attention(grouped_q.float(), k.float(), v.float(), attn_mask=gmask.float(), scale=scale)
    out = {"R": R, "qlen": qlen, "L": L}

    def run(name, fn):
        try:
            o = fn()
            out[name] = {"us": round(timeit(fn), 1), "maxdiff": float((o.float() - ref).abs().max())}
        except Exception as e:
            out[name] = repr(e)[:200]

    def grouped(backend):
        def f():
            with sdpa_kernel(backend):
                return F.scaled_dot_product_attention(grouped_q, k, v, attn_mask=gmask, scale=scale)
        return f
    run("default", lambda: F.scaled_dot_product_attention(grouped_q, k, v, attn_mask=gmask, scale=scale))
    run("cudnn", grouped(SDPBackend.CUDNN_ATTENTION))
    run("efficient", grouped(SDPBackend.EFFICIENT_ATTENTION))
    run("math", grouped(SDPBackend.MATH))

    def manual():
        s = torch.matmul(grouped_q, k.transpose(-1, -2)) * scale + gmask
        return torch.matmul(torch.softmax(s, dim=-1, dtype=torch.float32).to(dt), v)
    run("manual_bf16", manual)

    def manual32():
        s = torch.matmul(grouped_q, k.transpose(-1, -2)).float() * scale + gmask
        return torch.matmul(torch.softmax(s, dim=-1).to(dt), v)
    run("manual_fp32_scores", manual32)
    if qlen == 1:
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention
        doc_k = torch.full((L,), -1, device=dev, dtype=torch.int32)
        st = 0
        for i, n in enumerate(lens):
            doc_k[st:st + n] = i
            st += n
        doc_q = torch.arange(R, device=dev, dtype=torch.int32)
        flex = torch.compile(flex_attention, dynamic=False)

        def mm(b, h, qi, ki):
            return doc_q[qi] == doc_k[ki]

        def flexrun():
            bm = create_block_mask(mm, None, None, R, L, device=dev)
            return flex(q, k, v, block_mask=bm, scale=scale, enable_gqa=True)
        try:
            o = flexrun()
            o = o.reshape(1, KVH, G, R, D).reshape(1, KVH, G * R, D)
            out["flex"] = {"us": round(timeit(flexrun), 1), "maxdiff": float((o.float() - ref).abs().max())}
            bm = create_block_mask(mm, None, None, R, L, device=dev)
            out["flex_no_mask_build"] = {"us": round(timeit(lambda: flex(q, k, v, block_mask=bm, scale=scale, enable_gqa=True)), 1)}
        except Exception as e:
            out["flex"] = repr(e)[:300]
    print(json.dumps(out), flush=True)
    return out


for R in (1, 8, 32, 64, 128):
    res[f"decode_{R}"] = case(R, 190)
res["decode_32_ctx600"] = case(32, 600)
res["chunk_2048"] = case(1, 2200, qlen=2048)
res["mixed_8x16"] = case(8, 300, qlen=16)
json.dump(res, open(os.path.join(os.environ.get("OUT", "/tmp"), "attn_bench.json"), "w"), indent=1)
