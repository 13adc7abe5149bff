"""Issue 39, item 2: LoRA's low-rank product first and the frozen base product added into it
by cuBLAS's epilogue (stages/train/lora_scale.lora_accumulate), against the step as it trains,
in fresh processes. LAYERS Qwen3-8B decoder layers + the LM head, LoRA r16 alpha 32 (all-linear,
PEFT), one packed micro-batch of 4 x 2048 (stages.train.autotune.packed_batch: random tokens,
lognormal documents), forward + backward under bf16 autocast with our settings (flex attention,
each layer compiled with COMPILE_OPTIONS, the loss compiled, PEFT's input cast off, LoRA's scale
in B's weight, A's product shared per input), then clipping, fused AdamW's step and zero_grad.

  current     the step as it trains (scale_in_weight as stages.train.settings.step_context has it)
  accumulate  scale_in_weight(accumulate=True): every projection through lora_accumulate
  cublaslt    current with torch.backends.cuda.preferred_blas_library("cublaslt")

    python layers.py layers VARIANT    median step of 15 after 4 warm-ups, one process
    python layers.py parity            one model, lora_B random: loss and gradients of accumulate vs current"""
import json, os, statistics, sys, time, traceback
import torch
from transformers import AutoModelForCausalLM, Qwen3Config
from peft import LoraConfig, get_peft_model
from peft.helpers import disable_input_dtype_casting
from stages.train import settings
from stages.train.autotune import packed_batch
from stages.train.lora_scale import scale_in_weight

LAYERS = int(os.environ.get("LAYERS", "8"))
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
SHAPE = dict(hidden_size=4096, num_hidden_layers=LAYERS, num_attention_heads=32, num_key_value_heads=8, head_dim=128,
             intermediate_size=12288, vocab_size=151936)
if DEVICE == "cpu":  # a CPU smoke run of the same code
    SHAPE = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                 intermediate_size=128, vocab_size=256)
PLAN = {"attn_implementation": "flex_attention" if DEVICE == "cuda" else "sdpa", "sdpa_backend": None,
        "rocm_fa_library": None, "gradient_checkpointing": "off", "micro_batch_size": 4, "compile": True,
        "fused_cross_entropy": False}
out = {"gpu": torch.cuda.get_device_name() if DEVICE == "cuda" else "cpu", "torch": torch.__version__, "layers": LAYERS}


def batch():
    if DEVICE == "cuda":
        return packed_batch(4, 2048, SHAPE["vocab_size"])
    ids = torch.randint(0, SHAPE["vocab_size"], (4, 128), generator=torch.Generator().manual_seed(0))
    return {"input_ids": ids, "labels": ids, "position_ids": torch.arange(128).repeat(4, 1)}


def build(compiled: bool = True):
    torch.manual_seed(0)
    with torch.device(DEVICE):
        m = AutoModelForCausalLM.from_config(Qwen3Config(**SHAPE), dtype=torch.bfloat16,
                                             attn_implementation=PLAN["attn_implementation"])
    m.config.use_cache = False
    m = get_peft_model(m, LoraConfig(r=16, lora_alpha=32, target_modules="all-linear", task_type="CAUSAL_LM"))
    settings.switch_settings(m, PLAN)
    if compiled:
        settings.compile_regions(m)
    return m


def context(m, accumulate: bool):
    from contextlib import ExitStack
    stack = ExitStack()
    stack.enter_context(disable_input_dtype_casting(m, active=True))
    stack.enter_context(scale_in_weight(m, accumulate=accumulate))
    return stack


def step(m, b, opt=None):
    with torch.autocast(DEVICE, dtype=torch.bfloat16):
        loss = m(**b).loss
    loss.backward()
    if opt is not None:
        torch.nn.utils.clip_grad_norm_([p for p in m.parameters() if p.requires_grad], 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
    return loss.detach()


def sync():
    if DEVICE == "cuda":
        torch.cuda.synchronize()


def layers(variant, n=15, warm=4):
    if variant == "cublaslt":
        torch.backends.cuda.preferred_blas_library("cublaslt")
    m, b, ts = build(), batch(), []
    opt = torch.optim.AdamW([p for p in m.parameters() if p.requires_grad], lr=1e-4, fused=DEVICE == "cuda")
    with context(m, variant == "accumulate"):
        for _ in range(n + warm):
            sync(); s = time.perf_counter()
            loss = step(m, b, opt)
            sync(); ts.append(time.perf_counter() - s)
    timed = ts[warm:]
    return {"step_ms": round(statistics.median(timed) * 1e3, 2), "min_ms": round(min(timed) * 1e3, 2),
            "max_ms": round(max(timed) * 1e3, 2), "first_s": round(ts[0], 1), "loss": round(loss.item(), 5),
            "peak_gib": round(torch.cuda.max_memory_allocated() / 2**30, 1) if DEVICE == "cuda" else None}


def parity():
    """accumulate against current on one model (compiled on the GPU, eager on the CPU), then
    current again: the loss and each gradient's relative difference, beside current's own repeat."""
    m, b = build(compiled=DEVICE == "cuda"), batch()
    for n_, p in m.named_parameters():
        if "lora_B" in n_:
            torch.nn.init.normal_(p, std=0.02)
    res = {}
    for name in ("current", "accumulate", "current_again"):
        m.zero_grad(set_to_none=True)
        with context(m, name == "accumulate"):
            loss = step(m, b)
        res[name] = (loss.item(), {n_: p.grad.float().clone() for n_, p in m.named_parameters() if p.grad is not None})
    rel = lambda a, b: max(((a[k] - b[k]).norm() / b[k].norm()).item() for k in b)
    return {"loss_current": res["current"][0], "loss_accumulate": res["accumulate"][0],
            "loss_current_again": res["current_again"][0],
            "grad_rel_diff_accumulate_vs_current": rel(res["accumulate"][1], res["current"][1]),
            "grad_rel_diff_current_vs_current": rel(res["current_again"][1], res["current"][1]),
            "grads": len(res["current"][1])}


if __name__ == "__main__":
    which = sys.argv[1]
    try:
        r = layers(sys.argv[2]) if which == "layers" else parity()
    except Exception:
        r = {"error": traceback.format_exc()[-2000:]}
    print(which, sys.argv[2:], json.dumps(r), flush=True)
    json.dump({**out, which: r}, open(os.environ.get("OUT", "/tmp") + f"/{which}_{'_'.join(sys.argv[2:])}.json", "w"), indent=1)
