"""tiny in fp32 on CUDA through the engine (greedy = top_p 0, no top-k processor): greedy answers
equal generate's one at a time, also beside sampled requests; two tied tokens: the same pick every time."""
import asyncio, copy, json, os, sys
import torch
sys.path.insert(0, os.getcwd())
from transformers import AutoModelForCausalLM, Qwen3Config
from stages.inference.batching import Engine, Sampling
from stages.model.tiny import char_tokenizer

dev = "cuda"
tok = char_tokenizer()
torch.manual_seed(0)
config = Qwen3Config(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                     num_key_value_heads=2, head_dim=16, max_position_embeddings=512, eos_token_id=tok.eos_token_id,
                     pad_token_id=tok.pad_token_id)
model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).to(dev).eval()
texts = ["What is 12 + 30?", "Name a colour.", "Say hello " * 5, "x"] * 4
prompts = [tok(p)["input_ids"] for p in texts]

def alone(ids, n=24):
    x = torch.tensor([ids], device=dev)
    o = model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=n, do_sample=False,
                       pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id)
    return o[0, x.shape[1]:].tolist()

res = {"gpu": torch.cuda.get_device_name()}
engine = Engine(model, tok, {tok.eos_token_id}, kv_tokens=4096)
batched = [a.ids for a in engine.generate(prompts, Sampling(24))]
ref = [alone(p) for p in prompts]
res["greedy_equal_prompts"] = [sum(a == b for a, b in zip(batched, ref)), len(prompts)]

async def mixed():
    async def one(ids, s):
        async for piece in engine.stream(ids, s, texts=False):
            return piece
    return await asyncio.gather(*[one(p, s) for p in prompts for s in (Sampling(24), Sampling(24, temperature=1.0, top_p=0.9))])
out = asyncio.run(mixed())
res["greedy_beside_sampled_equal"] = [sum(a.ids == b for a, b in zip(out[::2], ref)), len(prompts)]
engine.close()

tied = copy.deepcopy(model)
first = ref[3][0]
other = next(t for t in range(128) if t != first and t not in (tok.eos_token_id, tok.pad_token_id))
with torch.no_grad():
    head = tied.get_output_embeddings().weight
    head[other] = head[first]
e = Engine(tied, tok, {tok.eos_token_id}, kv_tokens=4096)
runs = [[a.ids for a in e.generate([prompts[3]] * 8, Sampling(6))] for _ in range(2)]
e.close()
flat = [a for r in runs for a in r]
res["tie"] = {"first_tokens": sorted({a[0] for a in flat}), "tied": [first, other], "all_same": all(a == flat[0] for a in flat)}
print(json.dumps(res), flush=True)
json.dump(res, open(os.path.join(os.environ.get("OUT", "/tmp"), "sampler_cuda.json"), "w"), indent=1)
