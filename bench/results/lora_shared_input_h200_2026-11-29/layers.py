"""Issue 39: LoRA's A product shared by the projections that read one input (q/k/v, gate/up;
lora_shared_input.SharedInput, which is stages/train/lora_scale.py with it, as this call ran it)
against one A product per projection, both with the scale in B's weight. LAYERS Qwen3-8B decoder layers + LM head, LoRA r16 (all-linear), one packed micro-batch
of 4 x 2048 (stages.train.autotune.packed_batch), forward+backward under bf16 autocast as the
trainer runs them (regional compile with COMPILE_OPTIONS, flex attention, PEFT's input cast off).

    python layers.py layers separate|shared   median step of 20 after 4 warm-ups, one process
    python layers.py parity                   one model, lora_B random: loss and gradients of both"""
import json, os, statistics, sys, time, traceback
from functools import partial
import torch
from transformers import AutoModelForCausalLM, Qwen3Config
from peft import LoraConfig, get_peft_model
from peft.helpers import disable_input_dtype_casting
from stages.train import settings
from stages.train.autotune import packed_batch
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from lora_shared_input import scale_in_weight  # noqa: E402 (stages/train/lora_scale.py as this call ran it)

CONTEXT = {"separate": partial(scale_in_weight, share_inputs=False), "shared": scale_in_weight}
LAYERS = int(os.environ.get("LAYERS", "8"))
SHAPE = dict(hidden_size=4096, num_hidden_layers=LAYERS, num_attention_heads=32, num_key_value_heads=8, head_dim=128,
             intermediate_size=12288, vocab_size=151936)
PLAN = {"attn_implementation": "flex_attention", "sdpa_backend": None, "rocm_fa_library": None,
        "gradient_checkpointing": "off", "micro_batch_size": 4, "compile": True, "fused_cross_entropy": False}
out = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "layers": LAYERS}
batch = packed_batch(4, 2048, SHAPE["vocab_size"])


def build():
    torch.manual_seed(0)
    with torch.device("cuda"):
        m = AutoModelForCausalLM.from_config(Qwen3Config(**SHAPE), dtype=torch.bfloat16, attn_implementation="flex_attention")
    m.config.use_cache = False
    m = get_peft_model(m, LoraConfig(r=16, lora_alpha=32, target_modules="all-linear", task_type="CAUSAL_LM"))
    settings.switch_settings(m, PLAN)
    settings.compile_regions(m)
    return m


def step(m):
    with torch.autocast("cuda", dtype=torch.bfloat16):
        loss = m(**batch).loss
    loss.backward()
    return loss


def layers(which, n=20):
    m, ts = build(), []
    with disable_input_dtype_casting(m, active=True), CONTEXT[which](m):
        for i in range(n + 4):
            torch.cuda.synchronize(); s = time.perf_counter()
            loss = step(m)
            torch.cuda.synchronize(); ts.append(time.perf_counter() - s)
    return {"step_ms": round(statistics.median(ts[4:]) * 1e3, 2), "min_ms": round(min(ts[4:]) * 1e3, 2),
            "first_s": round(ts[0], 1), "loss": round(loss.item(), 5), "peak_gib": round(torch.cuda.max_memory_allocated() / 2**30, 1)}


def parity():
    m = build()
    for n_, p in m.named_parameters():
        if "lora_B" in n_: torch.nn.init.normal_(p, std=0.02)
    res = {}
    for name in ("separate", "shared", "separate_again"):
        m.zero_grad(set_to_none=True)
        with disable_input_dtype_casting(m, active=True), CONTEXT[name.replace("_again", "")](m):
            loss = step(m)
        res[name] = (loss.item(), {n_: p.grad.float().clone() for n_, p in m.named_parameters() if p.grad is not None})
    rel = lambda a, b: max(((a[k] - b[k]).norm() / b[k].norm()).item() for k in b)
    return {"loss_separate": res["separate"][0], "loss_shared": res["shared"][0], "loss_separate_again": res["separate_again"][0],
            "grad_rel_diff_shared_vs_separate": rel(res["shared"][1], res["separate"][1]),
            "grad_rel_diff_separate_vs_separate": rel(res["separate_again"][1], res["separate"][1]), "grads": len(res["separate"][1])}


if __name__ == "__main__":
    which = sys.argv[1]
    try:
        r = layers(sys.argv[2]) if which == "layers" else parity()
    except Exception:
        r = {"error": traceback.format_exc()[-1500:]}
    print(which, sys.argv[2:], json.dumps(r), flush=True)
    json.dump({**out, which: r}, open(os.environ.get("OUT", ".") + f"/{which}_{'_'.join(sys.argv[2:])}.json", "w"), indent=1)
