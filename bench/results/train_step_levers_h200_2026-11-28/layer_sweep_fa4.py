"""Issue 39: a few Qwen3-8B decoder layers with LoRA r16 (all-linear), 4 x 2048 packed, forward+backward
under bf16 autocast as the trainer runs them: our settings, beside max-autotune and flex kernel options."""
import json, os, statistics, sys, time, traceback
import torch
from transformers import AutoModelForCausalLM, Qwen3Config
from peft import LoraConfig, get_peft_model
from peft.helpers import disable_input_dtype_casting
from stages.train import settings
from stages.train.autotune import packed_batch

LAYERS = int(os.environ.get("LAYERS", "4"))
SHAPE = dict(hidden_size=4096, num_hidden_layers=LAYERS, num_attention_heads=32, num_key_value_heads=8, head_dim=128,
             intermediate_size=12288, vocab_size=151936)
PLAN = {"attn_implementation": "flex_attention", "sdpa_backend": None, "rocm_fa_library": None,
        "gradient_checkpointing": "off", "micro_batch_size": 4, "compile": True, "fused_cross_entropy": False}
out = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "layers": LAYERS}
batch = packed_batch(4, 2048, SHAPE["vocab_size"])

def build(lora=True):
    torch.manual_seed(0)
    with torch.device("cuda"):
        m = AutoModelForCausalLM.from_config(Qwen3Config(**SHAPE), dtype=torch.bfloat16, attn_implementation="flex_attention")
    m.config.use_cache = False
    if lora:
        m = get_peft_model(m, LoraConfig(r=16, lora_alpha=32, target_modules="all-linear", task_type="CAUSAL_LM"))
    return m

def timed(m, kw, n=15):
    ts = []
    with disable_input_dtype_casting(m, active=True):
        for i in range(n + 4):
            torch.cuda.synchronize(); s = time.perf_counter()
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss = m(**batch, **kw).loss
            loss.backward()
            torch.cuda.synchronize(); ts.append(time.perf_counter() - s)
            if i == 0: first = ts[0]
    for p in m.parameters(): p.grad = None
    return {"step_ms": round(statistics.median(ts[4:]) * 1e3, 2), "min_ms": round(min(ts[4:]) * 1e3, 2),
            "first_s": round(first, 1), "loss": round(loss.item(), 5)}

def variant(name, opts=None, kw=None, lora=True, attn="flex_attention", compile=True):
    m = None
    try:
        torch._dynamo.reset()
        m = build(lora)
        settings.switch_settings(m, {**PLAN, "attn_implementation": attn})
        o = {**settings.COMPILE_OPTIONS, **(opts or {})}
        for layer in settings.decoder_layers(m) if compile else []:
            layer.compile(options=o)
        base = settings.without_peft(m)
        base.loss_function = torch.compile(base.loss_function, options=settings.COMPILE_OPTIONS)
        if not lora:
            m.model.embed_tokens.weight.requires_grad_(True)  # gradients flow through every layer
            for n_, p in m.named_parameters():
                if "embed" not in n_: p.requires_grad_(False)
        r = timed(m, kw or {})
    except Exception:
        r = {"error": traceback.format_exc()[-800:]}
    out[name] = r; print(name, r, flush=True)
    del m; torch.cuda.empty_cache()

variant("ours")
variant("fa4", attn="flash_attention_4")
variant("fa4_eager_layers", attn="flash_attention_4", compile=False)
json.dump(out, open(os.environ.get("OUT", ".") + "/layer_sweep.json", "w"), indent=1)
