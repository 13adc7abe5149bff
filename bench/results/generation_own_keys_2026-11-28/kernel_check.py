"""On the GPU: stages/inference/varlen.py against the engine's masked grouped SDPA (the path it
replaces) on the 8B shape's heads, bf16, under CUDA graph capture; then tiny fp32 on CUDA: the
engine's greedy answers equal generate's one at a time. Run from the checkout's root on the lent GPU;
results under $OUT. Kept as the record of what ran."""
import json, os, statistics, sys
sys.path.insert(0, os.getcwd())
import torch
import torch.nn.functional as F
from stages.inference import varlen

dev, dt = "cuda", torch.bfloat16
KVH, G, D = 8, 4, 128
H = KVH * G
res = {"gpu": torch.cuda.get_device_name()}

def graphed(fn):
    s = torch.cuda.Stream(); s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(3): fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out = fn()
    return g, out

def timeit(g, n=100):
    ts = []
    for _ in range(n):
        a, b = torch.cuda.Event(True), torch.cuda.Event(True)
        a.record(); g.replay(); b.record(); torch.cuda.synchronize()
        ts.append(a.elapsed_time(b) * 1000)
    return statistics.median(ts)

def case(name, qlens, klens, pad_q=0, pad_seqs=0):
    torch.manual_seed(0)
    Q = sum(qlens) + pad_q
    Kp = -(-sum(klens) // 1024) * 1024
    q = torch.randn(1, Q, H, D, device=dev, dtype=dt).transpose(1, 2)
    k = torch.randn(Kp, KVH, D, device=dev, dtype=dt).transpose(0, 1).unsqueeze(0)
    v = torch.randn(Kp, KVH, D, device=dev, dtype=dt).transpose(0, 1).unsqueeze(0)
    mask = torch.full((1, 1, Q, Kp), torch.finfo(dt).min, device=dev, dtype=dt)
    qs = ks = 0
    for ql, kl in zip(qlens, klens):
        for t in range(ql):
            mask[0, 0, qs + t, ks:ks + kl - ql + t + 1] = 0
        qs, ks = qs + ql, ks + kl
    cu = lambda n: torch.tensor([0, *torch.tensor(n).cumsum(0).tolist()] + [sum(n)] * pad_seqs, dtype=torch.int32, device=dev)
    cu_q, cu_k = cu(qlens), cu(klens)
    def masked():  # stages/inference/attention.py's grouped path before this change
        qq = q.reshape(1, KVH, G * Q, D)
        out = F.scaled_dot_product_attention(qq, k, v, attn_mask=mask.repeat(1, 1, G, 1), scale=D ** -0.5)
        return out.reshape(1, H, Q, D).transpose(1, 2).contiguous()
    ref = F.scaled_dot_product_attention(q.float(), k.float(), v.float(), attn_mask=mask.float(), scale=D ** -0.5,
                                         enable_gqa=True).transpose(1, 2)
    real = sum(qlens)
    out = {"R": len(qlens), "tokens": Q, "keys_padded": Kp}
    for label, fn in (("masked", masked), ("own_keys", lambda: varlen.attention(q, k, v, cu_q, cu_k, D ** -0.5))):
        g, o = graphed(fn)
        g.replay(); torch.cuda.synchronize()
        out[label] = {"us": round(timeit(g), 1), "maxdiff_vs_fp32": float((o[:, :real].float() - ref[:, :real]).abs().max())}
    out["speedup"] = round(out["masked"]["us"] / out["own_keys"]["us"], 2)
    res[name] = out
    print(name, json.dumps(out), flush=True)

ctx = lambda R, c: [c + (i * 37) % 120 - 60 for i in range(R)]
for R in (1, 8, 32, 64, 128):
    case(f"decode_{R}", [1] * R, ctx(R, 190), pad_q=(-R) % 64, pad_seqs=(-R) % 64)
case("decode_32_ctx600", [1] * 32, ctx(32, 600), pad_q=32, pad_seqs=32)
case("decode_128_ctx600", [1] * 128, ctx(128, 600))
case("mixed_20_and_chunk", [1] * 20 + [300], ctx(20, 190) + [700], pad_q=(-320) % 64)
case("mixed_20_and_chunk_padded", [1] * 20 + [300], ctx(20, 190) + [700], pad_q=(-320) % 64, pad_seqs=299)
case("chunk_2048", [2048], [2300])
case("chunk_2048_padded", [2048], [2300], pad_seqs=1023)
case("chunk_2048_first", [2048], [2048])
case("decode_1_ctx8k", [1], [8192], pad_q=63, pad_seqs=63)
case("decode_1_ctx32k", [1], [32768], pad_q=63, pad_seqs=63)

# tiny in fp32 on CUDA through the engine: answers equal generate's
from transformers import AutoModelForCausalLM, Qwen3Config
from stages.inference.batching import Engine, Sampling
from stages.model.tiny import char_tokenizer
tok = char_tokenizer()
torch.manual_seed(0)
config = Qwen3Config(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                     num_key_value_heads=2, head_dim=16, max_position_embeddings=512, eos_token_id=tok.eos_token_id,
                     pad_token_id=tok.pad_token_id)
model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).to(dev).eval()
texts = ["What is 12 + 30?", "Name a colour.", "Say hello " * 5, "x"] * 4
prompts = [tok(p)["input_ids"] for p in texts]
calls = []
own = varlen.attention
varlen.attention = lambda *a, **k: calls.append(1) or own(*a, **k)
engine = Engine(model, tok, {tok.eos_token_id}, kv_tokens=4096)
batched = [a.ids for a in engine.generate(prompts, Sampling(24))]
engine.close()
varlen.attention = own
alone = []
for ids in prompts:
    x = torch.tensor([ids], device=dev)
    o = model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=24, do_sample=False,
                       pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id)
    alone.append(o[0, x.shape[1]:].tolist())
res["tiny_fp32_cuda"] = {"equal": batched == alone, "prompts": len(prompts), "kernel_calls": len(calls),
                         "equal_prompts": sum(a == b for a, b in zip(batched, alone))}
print("tiny", json.dumps(res["tiny_fp32_cuda"]), flush=True)
json.dump(res, open(os.path.join(os.environ.get("OUT", "/tmp"), "varlen_check.json"), "w"), indent=1)
