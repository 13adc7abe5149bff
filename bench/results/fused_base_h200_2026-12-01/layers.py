"""Issue 39, item 2: two levers on the training step, each against the step as it trains now,
in fresh processes. LAYERS Qwen3-8B decoder layers + the LM head, LoRA r16 alpha 32 (all-linear,
PEFT), one packed micro-batch of 4 x 2048 (stages.train.autotune.packed_batch: random tokens,
lognormal documents), forward + backward under bf16 autocast with our settings (flex attention,
each layer compiled with COMPILE_OPTIONS, the loss compiled, PEFT's input cast off, LoRA's scale
in B's weight), then AdamW's step and zero_grad, as the trainer does.

  current       the step as it trains (stages.train.settings.step_context)
  fused         + the base matmuls of q/k/v and gate/up fused per input (fused_base.py)
  fused_op      the same through fused_base.grouped_linear, a custom op with its own backward
                (written after call 4 for the next session; not yet run on a GPU)
  graphs        current, the compiled layers under CUDA graphs (inductor's cudagraph trees,
                each step marked a new graph step)
  fused_graphs  both

    python layers.py layers VARIANT    median step of 20 after 5 warm-ups, one process
    python layers.py parity            one model, lora_B random: loss and gradients of fused vs current"""
import json, os, statistics, sys, time, traceback
import torch
from transformers import AutoModelForCausalLM, Qwen3Config
from peft import LoraConfig, get_peft_model
from peft.helpers import disable_input_dtype_casting
from stages.train import settings
from stages.train.autotune import packed_batch
from stages.train.lora_scale import scale_in_weight
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from fused_base import fused_base  # noqa: E402

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
    b = packed_batch(4, 2048 if DEVICE == "cuda" else 128, SHAPE["vocab_size"]) if DEVICE == "cuda" else None
    if b is None:
        g = torch.Generator().manual_seed(0)
        ids = torch.randint(0, SHAPE["vocab_size"], (4, 128), generator=g)
        b = {"input_ids": ids, "labels": ids, "position_ids": torch.arange(128).repeat(4, 1)}
    return b


def build(graphs: bool, compiled: bool = True):
    torch.manual_seed(0)
    with torch.device(DEVICE):
        m = AutoModelForCausalLM.from_config(Qwen3Config(**SHAPE), dtype=torch.bfloat16,
                                             attn_implementation=PLAN["attn_implementation"])
    m.config.use_cache = False
    m = get_peft_model(m, LoraConfig(r=16, lora_alpha=32, target_modules="all-linear", task_type="CAUSAL_LM"))
    settings.switch_settings(m, PLAN)
    if compiled:
        settings.compile_regions(m)
    if graphs:
        for layer in settings.decoder_layers(m):
            layer.compile(options={**settings.COMPILE_OPTIONS, "triton.cudagraphs": True})
    return m


def context(m, fused: bool):
    from contextlib import ExitStack
    stack = ExitStack()
    stack.enter_context(disable_input_dtype_casting(m, active=True))
    stack.enter_context(fused_base(m, op=fused == "op") if fused else scale_in_weight(m))
    return stack


def step(m, b, opt=None):
    if DEVICE == "cuda":
        torch.compiler.cudagraph_mark_step_begin()
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


def layers(variant, n=20, warm=5):
    m, b, ts = build("graphs" in variant), batch(), []
    opt = torch.optim.AdamW([p for p in m.parameters() if p.requires_grad], lr=1e-4, fused=DEVICE == "cuda")
    with context(m, "op" if variant.startswith("fused_op") else variant.startswith("fused")):
        for _ in range(n + warm):
            sync(); s = time.perf_counter()
            loss = step(m, b, opt)
            sync(); ts.append(time.perf_counter() - s)
    timed = ts[warm:]
    return {"step_ms": round(statistics.median(timed) * 1e3, 2), "min_ms": round(min(timed) * 1e3, 2),
            "max_ms": round(max(timed) * 1e3, 2), "first_s": round(ts[0], 1), "loss": round(loss.item(), 5),
            "peak_gib": round(torch.cuda.max_memory_allocated() / 2**30, 1) if DEVICE == "cuda" else None}


def parity():
    """fused against current on one model (compiled on the GPU, eager on the CPU), then current
    again: the loss and each gradient's relative difference, beside current's own repeat."""
    m, b = build(False, compiled=DEVICE == "cuda"), batch()
    for n_, p in m.named_parameters():
        if "lora_B" in n_:
            torch.nn.init.normal_(p, std=0.02)
    res = {}
    for name in ("current", "fused", "fused_op", "current_again"):
        m.zero_grad(set_to_none=True)
        with context(m, {"fused": True, "fused_op": "op"}.get(name, False)):
            loss = step(m, b)
        res[name] = (loss.item(), {n_: p.grad.float().clone() for n_, p in m.named_parameters() if p.grad is not None})
    rel = lambda a, b: max(((a[k] - b[k]).norm() / b[k].norm()).item() for k in b)
    return {"loss_current": res["current"][0], "loss_fused": res["fused"][0], "loss_current_again": res["current_again"][0],
            "grad_rel_diff_fused_vs_current": rel(res["fused"][1], res["current"][1]),
            "loss_fused_op": res["fused_op"][0], "grad_rel_diff_fused_op_vs_current": rel(res["fused_op"][1], res["current"][1]),
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
