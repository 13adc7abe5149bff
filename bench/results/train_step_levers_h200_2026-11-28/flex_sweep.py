"""Issue 39: flex attention's kernel options on the training step's packed batch (1 layer)."""
import json, os, statistics, sys, time, traceback
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
# transformers' layout: (B, S, H, D) projections viewed and transposed to (B, H, S, D)
q = torch.randn(B, S, H, D, device="cuda", dtype=torch.bfloat16).transpose(1, 2).requires_grad_()
k = torch.randn(B, S, KV, D, device="cuda", dtype=torch.bfloat16).transpose(1, 2).requires_grad_()
v = torch.randn(B, S, KV, D, device="cuda", dtype=torch.bfloat16).transpose(1, 2).requires_grad_()
go = torch.randn(B, H, S, D, device="cuda", dtype=torch.bfloat16)

def doc_causal(b, h, qi, ki):
    return (doc[b, qi] == doc[b, ki]) & (qi >= ki)
def causal(b, h, qi, ki):
    return qi >= ki

flex = torch.compile(flex_attention)
def timed(bm, opts, n=40):
    ts = []
    for i in range(n + 3):
        for t in (q, k, v): t.grad = None
        torch.cuda.synchronize(); s = time.perf_counter()
        o = flex(q, k, v, block_mask=bm, enable_gqa=True, kernel_options=opts); o.backward(go)
        torch.cuda.synchronize(); ts.append(time.perf_counter() - s)
    f = []
    with torch.no_grad():
        for i in range(n + 3):
            torch.cuda.synchronize(); s = time.perf_counter()
            flex(q, k, v, block_mask=bm, enable_gqa=True, kernel_options=opts)
            torch.cuda.synchronize(); f.append(time.perf_counter() - s)
    return round(statistics.median(ts[3:]) * 1e3, 4), round(statistics.median(f[3:]) * 1e3, 4), o.detach(), [t.grad.clone() for t in (q, k, v)]

masks = {bs: create_block_mask(doc_causal, B, None, S, S, device="cuda", BLOCK_SIZE=bs) for bs in (128, 64)}
res = {}; ref = None
VARIANTS = [
    ("default", 128, None),
    ("dense_causal_ref", "causal", None),
    ("rows_safe_contig", 128, {"ROWS_GUARANTEED_SAFE": True, "BLOCKS_ARE_CONTIGUOUS": True}),
    ("prescale", 128, {"PRESCALE_QK": True}),
    ("tma", 128, {"USE_TMA": True}),
    ("fwd128x128_w8_s3", 128, {"fwd_BLOCK_M": 128, "fwd_BLOCK_N": 128, "fwd_num_warps": 8, "fwd_num_stages": 3}),
    ("fwd128x64_w4_s3", 128, {"fwd_BLOCK_M": 128, "fwd_BLOCK_N": 64, "fwd_num_warps": 4, "fwd_num_stages": 3}),
    ("fwd64x64_w4_s3", 128, {"fwd_BLOCK_M": 64, "fwd_BLOCK_N": 64, "fwd_num_warps": 4, "fwd_num_stages": 3}),
    ("bwd64_128_128_64_w8_s3", 128, {"bwd_BLOCK_M1": 64, "bwd_BLOCK_N1": 128, "bwd_BLOCK_M2": 128, "bwd_BLOCK_N2": 64, "bwd_num_warps": 8, "bwd_num_stages": 3}),
    ("bwd64_128_128_64_w8_s2", 128, {"bwd_BLOCK_M1": 64, "bwd_BLOCK_N1": 128, "bwd_BLOCK_M2": 128, "bwd_BLOCK_N2": 64, "bwd_num_warps": 8, "bwd_num_stages": 2}),
    ("bwd32_128_128_32_w4_s3", 128, {"bwd_BLOCK_M1": 32, "bwd_BLOCK_N1": 128, "bwd_BLOCK_M2": 128, "bwd_BLOCK_N2": 32, "bwd_num_warps": 4, "bwd_num_stages": 3}),
    ("bwd64_64_64_64_w4_s3", 128, {"bwd_BLOCK_M1": 64, "bwd_BLOCK_N1": 64, "bwd_BLOCK_M2": 64, "bwd_BLOCK_N2": 64, "bwd_num_warps": 4, "bwd_num_stages": 3}),
    ("block64_default", 64, None),
    ("block64_64x64", 64, {"BLOCK_M": 64, "BLOCK_N": 64, "bwd_BLOCK_M1": 32, "bwd_BLOCK_N1": 64, "bwd_BLOCK_M2": 64, "bwd_BLOCK_N2": 32}),
    ("block64_64x64_b64", 64, {"BLOCK_M": 64, "BLOCK_N": 64, "bwd_BLOCK_M1": 64, "bwd_BLOCK_N1": 64, "bwd_BLOCK_M2": 64, "bwd_BLOCK_N2": 64}),
]
causal_mask = create_block_mask(causal, B, None, S, S, device="cuda")
for name, bs, opts in VARIANTS:
    try:
        bm = causal_mask if bs == "causal" else masks[bs]
        t, f, o, gr = timed(bm, opts)
        res[name] = {"fwd_bwd_ms": t, "fwd_ms": f, "opts": opts, "block": bs}
        if name == "default": ref = (o, gr)
        elif bs != "causal":
            res[name]["max_diff"] = max([(o.float() - ref[0].float()).abs().max().item()] + [(a.float() - b.float()).abs().max().item() for a, b in zip(gr, ref[1])])
    except Exception as e:
        res[name] = {"error": repr(e)[:400]}
    print(name, res[name], flush=True)
# max-autotune over flex's own configs
try:
    torch._dynamo.reset()
    flex = torch.compile(flex_attention, mode="max-autotune-no-cudagraphs")
    s = time.perf_counter(); t, f, o, gr = timed(masks[128], None, n=5); c = time.perf_counter() - s
    t, f, o, gr = timed(masks[128], None)
    res["max_autotune"] = {"fwd_bwd_ms": t, "fwd_ms": f, "first_calls_s": round(c, 1)}
except Exception as e:
    res["max_autotune"] = {"error": traceback.format_exc()[-600:]}
print("max_autotune", res["max_autotune"], flush=True)
ok = {k: v for k, v in res.items() if "fwd_bwd_ms" in v and v.get("block") == 128 and v.get("opts")}
if ok:
    best = min(ok, key=lambda k: ok[k]["fwd_bwd_ms"]); out["best"] = best
    open(os.environ.get("OUT", ".") + "/best_opts.json", "w").write(json.dumps(ok[best]["opts"]))
fl = sum(n * (n + 1) / 2 for n in lengths) * 4 * H * D
out.update(res); out["docs"] = len(lengths); out["fwd_useful_gflop"] = fl / 1e9
json.dump(out, open(os.environ.get("OUT", ".") + "/flex_sweep.json", "w"), indent=1)
