"""Issue 39: flash-attn-4 (CuTe DSL) varlen beside flex attention, one layer's attention, packed batch (as flex_sweep)."""
import json, os, statistics, time, traceback
import torch
from torch.nn.attention.flex_attention import flex_attention, create_block_mask

out = {"torch": torch.__version__, "gpu": torch.cuda.get_device_name()}
B, S, H, KV, D = 4, 2048, 32, 8, 128
g = torch.Generator().manual_seed(0)
pos = torch.empty(B, S, dtype=torch.long); lengths = []
for r in range(B):
    at = 0
    while at < S:
        n = int(torch.empty(1).log_normal_(0, 0.8, generator=g).item() * 376)
        n = min(max(n, 32), S - at); pos[r, at:at + n] = torch.arange(n); lengths.append(n); at += n
pos = pos.cuda(); doc = (pos == 0).cumsum(1)
qs = torch.randn(B, S, H, D, device="cuda", dtype=torch.bfloat16)
ks = torch.randn(B, S, KV, D, device="cuda", dtype=torch.bfloat16)
vs = torch.randn(B, S, KV, D, device="cuda", dtype=torch.bfloat16)
go = torch.randn(B, S, H, D, device="cuda", dtype=torch.bfloat16)
leaves = [t.clone().requires_grad_() for t in (qs, ks, vs)]

def doc_causal(b, h, qi, ki):
    return (doc[b, qi] == doc[b, ki]) & (qi >= ki)
bm = create_block_mask(doc_causal, B, None, S, S, device="cuda")

def timed(fn, n=40):
    ts = []
    for i in range(n + 3):
        for t in leaves: t.grad = None
        torch.cuda.synchronize(); s = time.perf_counter()
        o = fn(); o.backward(go)
        torch.cuda.synchronize(); ts.append(time.perf_counter() - s)
    f = []
    with torch.no_grad():
        for i in range(n + 3):
            torch.cuda.synchronize(); s = time.perf_counter(); fn(); torch.cuda.synchronize(); f.append(time.perf_counter() - s)
    return {"fwd_bwd_ms": round(statistics.median(ts[3:]) * 1e3, 4), "fwd_ms": round(statistics.median(f[3:]) * 1e3, 4)}, o.detach(), [t.grad.clone() for t in leaves]

def flex_fn(opts):
    flex = torch.compile(flex_attention)
    def run():
        q, k, v = (t.transpose(1, 2) for t in leaves)
        return flex(q, k, v, block_mask=bm, enable_gqa=True, kernel_options=opts).transpose(1, 2)
    return run

cu = torch.zeros(len(lengths) + 1, dtype=torch.int32); cu[1:] = torch.tensor(lengths).cumsum(0); cu = cu.cuda(); mx = max(lengths)
def fa4_fn(**kw):
    from flash_attn.cute import flash_attn_varlen_func
    def run():
        q, k, v = (t.reshape(B * S, t.shape[2], D) for t in leaves)
        o = flash_attn_varlen_func(q, k, v, cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=mx, max_seqlen_k=mx, causal=True, **kw)
        o = o[0] if isinstance(o, tuple) else o
        return o.reshape(B, S, H, D)
    return run

ref = None
for name, make in [("flex_default", lambda: flex_fn(None)),
                   ("flex_rows_safe", lambda: flex_fn({"ROWS_GUARANTEED_SAFE": True})),
                   ("flex_contiguous", lambda: flex_fn({"BLOCKS_ARE_CONTIGUOUS": True})),
                   ("fa4_varlen", lambda: fa4_fn()),
                   ("fa4_varlen_deterministic", lambda: fa4_fn(deterministic=True)),
                   ("flex_default_again", lambda: flex_fn(None))]:
    try:
        torch._dynamo.reset()
        s0 = time.perf_counter(); fn = make(); fn(); first = time.perf_counter() - s0
        r, o, gr = timed(fn); r["first_call_s"] = round(first, 1)
        if ref is None: ref = (o, gr)
        else:
            r["max_diff_out"] = (o.float() - ref[0].float()).abs().max().item()
            r["max_diff_grads"] = [(a.float() - b.float()).abs().max().item() for a, b in zip(gr, ref[1])]
    except Exception:
        r = {"error": traceback.format_exc()[-1500:]}
    out[name] = r; print(name, r, flush=True)
out["docs"] = len(lengths); out["max_doc"] = mx
json.dump(out, open(os.environ.get("OUT", ".") + "/fa4_attn.json", "w"), indent=1)
