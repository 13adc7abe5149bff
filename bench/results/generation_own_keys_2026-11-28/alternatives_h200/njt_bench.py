"""Varlen attention through SDPA on nested (jagged) tensors: each request's queries over its own
keys alone. Checks against the batch's masked SDPA (block-diagonal, causal at the bottom right),
times it, and tries it under CUDA graph capture. Kept as the record of what ran."""
import json, os, statistics, traceback
import torch
import torch.nn.functional as F

torch.manual_seed(0)
dev = os.environ.get("DEV", "cuda"); dt = torch.bfloat16 if dev == "cuda" else torch.float32
KVH, G, D = 8, 4, 128
H = KVH * G
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


def setup(qlens, klens, pad_q=0, pad_k=1024):
    Q, K = sum(qlens), sum(klens)
    Qp = Q + pad_q
    Kp = -(-K // pad_k) * pad_k
    q = torch.randn(1, H, Qp, D, device=dev, dtype=dt)
    k = torch.randn(1, KVH, Kp, D, device=dev, dtype=dt)
    v = torch.randn(1, KVH, Kp, D, device=dev, dtype=dt)
    mask = torch.full((1, 1, Qp, Kp), torch.finfo(dt).min, device=dev, dtype=dt)
    qs = ks = 0
    for ql, kl in zip(qlens, klens):
        for t in range(ql):
            mask[0, 0, qs + t, ks:ks + kl - ql + t + 1] = 0
        qs, ks = qs + ql, ks + kl
    cu_q = torch.tensor([0] + list(torch.tensor(qlens).cumsum(0)), device=dev, dtype=torch.int64)
    cu_k = torch.tensor([0] + list(torch.tensor(klens).cumsum(0)), device=dev, dtype=torch.int64)
    return q, k, v, mask, cu_q, cu_k


def masked(q, k, v, mask):
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=D ** -0.5, enable_gqa=True)


def njt(q, k, v, cu_q, cu_k, max_q, max_k, causal):
    # values [tokens, heads, D]; key/value heads repeated for their query heads (jagged SDPA wants equal heads)
    qv = q[0].transpose(0, 1)
    kv_ = k[0].repeat_interleave(G, dim=0).transpose(0, 1)
    vv = v[0].repeat_interleave(G, dim=0).transpose(0, 1)
    nq = torch.nested.nested_tensor_from_jagged(qv, cu_q, min_seqlen=1, max_seqlen=max_q)
    nk = torch.nested.nested_tensor_from_jagged(kv_, cu_k, min_seqlen=1, max_seqlen=max_k)
    nv = torch.nested.nested_tensor_from_jagged(vv, cu_k, min_seqlen=1, max_seqlen=max_k)
    o = F.scaled_dot_product_attention(nq.transpose(1, 2), nk.transpose(1, 2), nv.transpose(1, 2),
                                       is_causal=causal, scale=D ** -0.5)
    return o.transpose(1, 2).values()  # [tokens, H, D]


def njt_grouped(q, k, v, cu_q, cu_k, max_q, max_k):
    """decode only: a request's G query heads per kv head as G query rows of that kv head."""
    R = cu_q.numel() - 1
    rows = q[0, :, :R].reshape(KVH, G, R, D).permute(2, 1, 0, 3).reshape(R * G, KVH, D)  # [R*G, KVH, D]
    cu_g = cu_q * G
    nq = torch.nested.nested_tensor_from_jagged(rows, cu_g, min_seqlen=1, max_seqlen=max_q * G)
    nk = torch.nested.nested_tensor_from_jagged(k[0].transpose(0, 1), cu_k, min_seqlen=1, max_seqlen=max_k)
    nv = torch.nested.nested_tensor_from_jagged(v[0].transpose(0, 1), cu_k, min_seqlen=1, max_seqlen=max_k)
    o = F.scaled_dot_product_attention(nq.transpose(1, 2), nk.transpose(1, 2), nv.transpose(1, 2), scale=D ** -0.5)
    o = o.transpose(1, 2).values()  # [R*G, KVH, D]
    return o.reshape(R, G, KVH, D).permute(0, 2, 1, 3).reshape(R, H, D)


def check(name, qlens, klens, causal=True, pad_q=0, pad_seqs=0):
    out = {"R": len(qlens)}
    try:
        q, k, v, mask, cu_q, cu_k = setup(qlens, klens, pad_q=pad_q)
        if name.endswith("int32"):
            cu_q, cu_k = cu_q.int(), cu_k.int()
        if pad_seqs:
            cu_q = torch.cat([cu_q, cu_q[-1:].repeat(pad_seqs)])
            cu_k = torch.cat([cu_k, cu_k[-1:].repeat(pad_seqs)])
        Q = sum(qlens)
        ref = masked(q, k, v, mask)[0].transpose(0, 1)[:Q]  # [Q, H, D]
        out["masked_us"] = round(timeit(lambda: masked(q, k, v, mask)), 1)
        o = njt(q, k, v, cu_q, cu_k, max(qlens), max(klens), causal)
        out["njt_maxdiff"] = float((o[:Q].float() - ref.float()).abs().max())
        out["njt_us"] = round(timeit(lambda: njt(q, k, v, cu_q, cu_k, max(qlens), max(klens), causal)), 1)
        # static bounds (as a CUDA graph would have): max_q = padded Q, max_k = padded K
        o2 = njt(q, k, v, cu_q, cu_k, q.shape[2], k.shape[2], causal)
        out["njt_static_maxdiff"] = float((o2[:Q].float() - ref.float()).abs().max())
        out["njt_static_us"] = round(timeit(lambda: njt(q, k, v, cu_q, cu_k, q.shape[2], k.shape[2], causal)), 1)
        if max(qlens) == 1:
            o3 = njt_grouped(q, k, v, cu_q, cu_k, 1, k.shape[2])
            out["grouped_maxdiff"] = float((o3.float() - ref.float()).abs().max())
            out["grouped_us"] = round(timeit(lambda: njt_grouped(q, k, v, cu_q, cu_k, 1, k.shape[2])), 1)
        # CUDA graph capture of the static version
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            for _ in range(3):
                njt(q, k, v, cu_q, cu_k, q.shape[2], k.shape[2], causal)
        torch.cuda.current_stream().wait_stream(s)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            og = njt(q, k, v, cu_q, cu_k, q.shape[2], k.shape[2], causal)
        g.replay()
        torch.cuda.synchronize()
        out["graph_maxdiff"] = float((og[:Q].float() - ref.float()).abs().max())
        out["graph_us"] = round(timeit(g.replay), 1)
    except Exception:
        out["error"] = traceback.format_exc()[-1500:]
    res[name] = out
    print(name, json.dumps(out), flush=True)


ctx = lambda R, c: [c + (i * 37) % 120 - 60 for i in range(R)]
for R in (1, 8, 32, 128):
    check(f"decode_{R}", [1] * R, ctx(R, 190))
check("decode_32_ctx600", [1] * 32, ctx(32, 600))
check("decode_32_padq", [1] * 32, ctx(32, 190), pad_q=32, pad_seqs=32)
check("decode_32_int32", [1] * 32, ctx(32, 190))
check("mixed", [1] * 20 + [300], ctx(20, 190) + [700])  # decodes beside a chunk with history (bottom-right causal)
check("chunk_2048", [2048], [2300])
check("chunk_2048_nohistory", [2048], [2048])
torch.save({}, "/dev/null") if False else None
json.dump(res, open(os.path.join(os.environ.get("OUT", "/tmp"), "njt_bench.json"), "w"), indent=1)
