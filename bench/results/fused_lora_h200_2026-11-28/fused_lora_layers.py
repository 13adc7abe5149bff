"""Issue 39 (fused LoRA, fresh processes): LAYERS Qwen3-8B decoder layers + LM head with LoRA r16
(all-linear), 4 x 2048 packed, forward+backward under bf16 autocast as the trainer runs them
(regional compile with COMPILE_OPTIONS, flex attention, inputs left in bf16): PEFT's LoRA forward
(peft), this folder's fused_lora.py (fused), stages/train/lora_scale (scaled: call 4), no LoRA with gradients through every layer (no_lora).
parity [fused|scaled]: PEFT against the other on one model (lora_B random, so every gradient is non-zero), loss and
gradients. ops: the forward's and the input gradient's cuBLAS orderings on one projection."""
import json, os, statistics, sys, time, traceback
from contextlib import nullcontext
import torch
from transformers import AutoModelForCausalLM, Qwen3Config
from peft import LoraConfig, get_peft_model
from peft.helpers import disable_input_dtype_casting
from stages.train import settings
from stages.train.autotune import packed_batch
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from fused_lora import fused_lora  # noqa: E402 (this folder's: the version each call ran is in its README)
from stages.train.lora_scale import scale_in_weight  # noqa: E402

CONTEXT = {"peft": lambda m: nullcontext(), "no_lora": lambda m: nullcontext(), "fused": fused_lora,
           "scaled": scale_in_weight}

LAYERS = int(os.environ.get("LAYERS", "8"))
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
    settings.switch_settings(m, PLAN)
    settings.compile_regions(m)
    return m


def step(m):
    with torch.autocast("cuda", dtype=torch.bfloat16):
        loss = m(**batch).loss
    loss.backward()
    return loss


def timed(m, which, n=20):
    ts = []
    with disable_input_dtype_casting(m, active=True), CONTEXT[which](m):
        for i in range(n + 4):
            torch.cuda.synchronize(); s = time.perf_counter()
            loss = step(m)
            torch.cuda.synchronize(); ts.append(time.perf_counter() - s)
    return {"step_ms": round(statistics.median(ts[4:]) * 1e3, 2), "min_ms": round(min(ts[4:]) * 1e3, 2),
            "first_s": round(ts[0], 1), "loss": round(loss.item(), 5), "peak_gib": round(torch.cuda.max_memory_allocated() / 2**30, 1)}


def layers(which):
    m = build(which != "no_lora")
    if which == "no_lora":
        m.model.embed_tokens.weight.requires_grad_(True)  # gradients flow through every layer
        for n_, p in m.named_parameters():
            if "embed" not in n_: p.requires_grad_(False)
    return timed(m, which)


def parity(other="fused"):
    m = build()
    for n_, p in m.named_parameters():
        if "lora_B" in n_: torch.nn.init.normal_(p, std=0.02)
    res = {}
    for name in ("peft", other, "peft_again"):
        m.zero_grad(set_to_none=True)
        with disable_input_dtype_casting(m, active=True), CONTEXT[name.replace("_again", "")](m):
            loss = step(m)
        res[name] = (loss.item(), {n_: p.grad.float().clone() for n_, p in m.named_parameters() if p.grad is not None})
    def rel(a, b):
        return max(((a[k] - b[k]).norm() / b[k].norm()).item() for k in b)
    return {"loss_peft": res["peft"][0], f"loss_{other}": res[other][0], "loss_peft_again": res["peft_again"][0],
            f"grad_rel_diff_{other}_vs_peft": rel(res[other][1], res["peft"][1]),
            "grad_rel_diff_peft_vs_peft": rel(res["peft_again"][1], res["peft"][1]), "grads": len(res["peft"][1])}


def ops():
    def t(f, n=50):
        for _ in range(5): f()
        torch.cuda.synchronize(); ts = []
        for _ in range(n):
            s = torch.cuda.Event(enable_timing=True); e = torch.cuda.Event(enable_timing=True)
            s.record(); f(); e.record(); torch.cuda.synchronize(); ts.append(s.elapsed_time(e))
        return round(statistics.median(ts), 4)
    r = {}
    for name, (i, o) in {"q": (4096, 4096), "k": (4096, 1024), "gate": (4096, 12288), "down": (12288, 4096)}.items():
        x = torch.randn(8192, i, device="cuda", dtype=torch.bfloat16); w = torch.randn(o, i, device="cuda", dtype=torch.bfloat16) * .02
        a = torch.randn(16, i, device="cuda", dtype=torch.bfloat16) * .02; b = torch.randn(o, 16, device="cuda", dtype=torch.bfloat16) * .02
        g = torch.randn(8192, o, device="cuda", dtype=torch.bfloat16); gl = torch.randn(8192, 16, device="cuda", dtype=torch.bfloat16)
        low = x @ a.t()
        wf = torch.zeros(o + 16, i + 16, device="cuda", dtype=torch.bfloat16); wf[:o, :i] = w  # W, sB and A in one buffer
        r[name] = {"fwd_base_mm": t(lambda: x @ w.t()),
                   "fwd_mm_then_addmm_inplace": t(lambda: (x @ w.t()).addmm_(low, b.t(), alpha=2.0)),
                   "fwd_addmm_beta_big": t(lambda: torch.addmm(low @ (b.t() * 2.0), x, w.t())),
                   "fwd_lowrank_A": t(lambda: x @ a.t()),
                   "bwd_base_mm": t(lambda: g @ w),
                   "bwd_mm_then_addmm_inplace": t(lambda: (g @ w).addmm_(gl, a)),
                   "bwd_addmm_beta_big": t(lambda: torch.addmm(gl @ a, g, w)),
                   "bwd_g_low": t(lambda: g @ b), "bwd_grad_b": t(lambda: g.t() @ low), "bwd_grad_a": t(lambda: gl.t() @ x),
                   # one product over an extended inner dimension: the operands concatenated per call (as
                   # fused_lora does), and with the weight kept extended (only the activation concatenated)
                   "fwd_ext_cat": t(lambda: torch.cat([x, low], 1) @ torch.cat([w, b * 2.0], 1).t()),
                   "fwd_ext_weight_kept": t(lambda: torch.cat([x, low], 1) @ wf[:o].t()),
                   "bwd_ext_cat": t(lambda: torch.cat([g, gl], 1) @ torch.cat([w, a], 0)),
                   "bwd_ext_weight_kept": t(lambda: torch.cat([g, gl], 1) @ wf[:, :i])}
    return r


if __name__ == "__main__":  # (kernel_profile.py imports build and step)
    which = sys.argv[1]
    try:
        r = layers(sys.argv[2]) if which == "layers" else {"parity": parity, "ops": ops}[which](*sys.argv[2:3])
    except Exception:
        r = {"error": traceback.format_exc()[-1500:]}
    out[which if which != "layers" else sys.argv[2]] = r
    print(which, sys.argv[2:], json.dumps(r), flush=True)
    json.dump(out, open(os.environ.get("OUT", ".") + f"/{which}_{'_'.join(sys.argv[2:])}.json", "w"), indent=1)
