"""Quick check: torch's varlen_attn (FA2) vs flex attention for packed training batches."""
import inspect, json, os, statistics, sys, time
import torch
import torch.nn.attention.varlen as V
from torch.nn.attention.flex_attention import flex_attention, create_block_mask

out = {"torch": torch.__version__, "signature": str(inspect.signature(V.varlen_attn)), "gpu": torch.cuda.get_device_name()}
print(out, flush=True)
torch.manual_seed(0)
B, S, H, KV, D = 4, 2048, 32, 8, 128
g = torch.Generator().manual_seed(0)
pos = torch.empty(B, S, dtype=torch.long)
lengths = []
for r in range(B):
    at = 0
    while at < S:
        n = int(torch.empty(1).log_normal_(0, 0.8, generator=g).item() * 376)
        n = min(max(n, 32), S - at); pos[r, at:at+n] = torch.arange(n); lengths.append(n); at += n
pos = pos.cuda()
doc = (pos == 0).cumsum(1)
q = torch.randn(B, S, H, D, device="cuda", dtype=torch.bfloat16, requires_grad=True)
k = torch.randn(B, S, KV, D, device="cuda", dtype=torch.bfloat16, requires_grad=True)
v = torch.randn(B, S, KV, D, device="cuda", dtype=torch.bfloat16, requires_grad=True)
go = torch.randn(B, S, H, D, device="cuda", dtype=torch.bfloat16)

def mask_mod(b, h, qi, ki):
    return (doc[b, qi] == doc[b, ki]) & (qi >= ki)

flex = torch.compile(flex_attention)
BM = create_block_mask(mask_mod, B, None, S, S, device="cuda")
def run_flex():
    bm = BM
    o = flex(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), block_mask=bm, enable_gqa=True)
    return o.transpose(1, 2)

cu = torch.zeros(len(lengths) + 1, dtype=torch.int32)
cu[1:] = torch.tensor(lengths).cumsum(0)
cu = cu.cuda(); mx = max(lengths)
params = inspect.signature(V.varlen_attn).parameters
extra = {"window_size": (-1, 0)} if "window_size" in params else {"is_causal": True}
def run_varlen(gqa=True):
    kk, vv = k.reshape(B * S, KV, D), v.reshape(B * S, KV, D)
    kw = dict(extra)
    if "enable_gqa" in params: kw["enable_gqa"] = True
    if not gqa:
        kk, vv = kk.repeat_interleave(H // KV, 1), vv.repeat_interleave(H // KV, 1)
    o = V.varlen_attn(q.reshape(B * S, H, D), kk, vv, cu, cu, mx, mx, **kw)
    return o.reshape(B, S, H, D)

def timed(fn, n=50):
    ts = []
    for i in range(n + 3):
        for t in (q, k, v): t.grad = None
        torch.cuda.synchronize(); s = time.perf_counter()
        o = fn(); o.backward(go)
        torch.cuda.synchronize(); ts.append(time.perf_counter() - s)
    return statistics.median(ts[3:]) * 1e3, o.detach(), [t.grad.clone() for t in (q, k, v)]

def fwd_only(fn, n=50):
    ts = []
    with torch.no_grad():
        for i in range(n + 3):
            torch.cuda.synchronize(); s = time.perf_counter(); fn(); torch.cuda.synchronize(); ts.append(time.perf_counter() - s)
    return statistics.median(ts[3:]) * 1e3

res = {}
tf, of, gf = timed(run_flex); res["flex_fwd_bwd_ms_incl_mask"] = tf; res["flex_fwd_ms"] = fwd_only(run_flex)
for name, gqa in (("varlen_gqa", True), ("varlen_repeat", False)):
    try:
        tv, ov, gv = timed(lambda: run_varlen(gqa)); res[name + "_fwd_bwd_ms"] = tv
        res[name + "_fwd_ms"] = fwd_only(lambda: run_varlen(gqa))
        res[name + "_max_diff_out"] = (ov.float() - of.float()).abs().max().item()
        res[name + "_max_diff_grads"] = [(a.float() - b.float()).abs().max().item() for a, b in zip(gv, gf)]
    except Exception as e:
        res[name + "_error"] = repr(e)[:500]
# inside compile
try:
    c = torch.compile(lambda: run_varlen(True), fullgraph=True)
    tc, oc, _ = timed(c); res["varlen_compiled_fwd_bwd_ms"] = tc
except Exception as e:
    res["varlen_compiled_error"] = repr(e)[:800]
res["docs"] = len(lengths); res["max_doc"] = mx
# attention flops (causal within docs), fwd
fl = sum(n * (n + 1) / 2 for n in lengths) * 4 * H * D
res["fwd_tflops_flex"] = fl / (res["flex_fwd_ms"] / 1e3) / 1e12
if "varlen_gqa_fwd_ms" in res: res["fwd_tflops_varlen"] = fl / (res["varlen_gqa_fwd_ms"] / 1e3) / 1e12
out.update(res)
print(json.dumps(out, indent=1))
json.dump(out, open(os.environ.get("OUT", ".") + "/varlen_check.json", "w"), indent=1)
