"""The plan stage's probe (stages/train/autotune.py) on real model shapes, on one GPU.

Writes a config.json of the named shape (random weights: speed does not depend on them),
runs the same probe the plan stage runs, with the given budget, and prints every
measurement and the decisions. MFU: model FLOPs per token (flops_per_token) over the bf16
matmul peak measured on this GPU in this run (matmul_peak_tflops). Writes JSON under
bench/results/ (or --out).

    python -m bench.autotune_probe --shape qwen3-8b --peft lora --budget 180

--tiny: the tiny recipe's shape on the CPU, sequences of 256, five seconds of probing, with
bench/tiny.probe standing in for the CUDA-only autotune.probe (a smoke test, not a measurement).
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import tempfile
import time
from pathlib import Path

from bench import tiny

REPO = Path(__file__).resolve().parent.parent


def one_gpu() -> None:
    """The benches measure one GPU: where more are visible, the Trainer would spread each batch
    over all of them with nn.DataParallel (TRL refuses it). Before CUDA starts; children inherit it."""
    os.environ.setdefault("CUDA_VISIBLE_DEVICES", "0")


def recipe_probe_budget() -> float:
    """qwen3_8b's autotune.budget_seconds: the training benches probe as the 8B recipe does."""
    from stages.engine.recipe import load

    return load(REPO / "recipes" / "qwen3_8b.yaml").autotune.budget_seconds


SHAPES = {  # Qwen3 sizes, as their config.json give them
    "qwen3-8b": dict(hidden_size=4096, num_hidden_layers=36, num_attention_heads=32, num_key_value_heads=8,
                     head_dim=128, intermediate_size=12288, vocab_size=151936),
    "qwen3-1.7b": dict(hidden_size=2048, num_hidden_layers=28, num_attention_heads=16, num_key_value_heads=8,
                       head_dim=128, intermediate_size=6144, vocab_size=151936, tie_word_embeddings=True),
    "tiny": tiny.SHAPE,
}


def flops_per_token(shape: dict, peft: str) -> int:
    """Model FLOPs of one trained token: the forward's matmuls (2N) and the backward's
    input gradients (2N), plus the weight gradients (2N) only where weights train: 6N for
    full fine-tuning, 4N for LoRA (its adapters' own FLOPs are under 1% and not counted).
    N counts every matmul weight, LM head included. Not counted: attention scores (about 1%
    at these document lengths) and recomputation under activation checkpointing (it is
    hardware work, not model work)."""
    return (6 if peft == "none" else 4) * matmul_params(shape)


def matmul_peak_tflops(device: str = "cuda") -> float:
    """The best bf16 matmul throughput this GPU reaches (8192^3 products, best of 5 x 20; on
    the CPU, for --tiny, 512^3)."""
    import time

    import torch

    n = 8192 if device == "cuda" else 512
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    a, b = (torch.randn(n, n, device=device, dtype=torch.bfloat16) for _ in range(2))
    for _ in range(5):
        a @ b
    best = float("inf")
    for _ in range(5):
        sync()
        start = time.perf_counter()
        for _ in range(20):
            a @ b
        sync()
        best = min(best, (time.perf_counter() - start) / 20)
    return 2 * n**3 / best / 1e12


def lm_head_share(shape: dict) -> float:
    """The LM head's share of matmul_params: of the FLOPs counted per token, those a trainer that
    runs the head only on tokens with a target skips for the others."""
    return shape["hidden_size"] * shape["vocab_size"] / matmul_params(shape)


def matmul_params(shape: dict) -> int:
    h, layers, kv = shape["hidden_size"], shape["num_hidden_layers"], shape["num_key_value_heads"]
    q = shape["num_attention_heads"] * shape["head_dim"]
    per_layer = h * q * 2 + h * kv * shape["head_dim"] * 2 + 3 * h * shape["intermediate_size"]
    return layers * per_layer + h * shape["vocab_size"]  # + the LM head


def main() -> None:
    from transformers import Qwen3Config

    from stages.train import autotune
    from stages.engine.recipe import Recipe

    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", choices=sorted(SHAPES), default="qwen3-8b")
    ap.add_argument("--peft", choices=("lora", "none"), default="lora")
    ap.add_argument("--max-length", type=int, default=2048)
    ap.add_argument("--global-batch", type=int, default=8)
    ap.add_argument("--budget", type=float, default=180)
    ap.add_argument("--out")
    ap.add_argument("--tiny", action="store_true", help="the tiny shape on the CPU: a smoke test, not a measurement")
    a = ap.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    if a.tiny:
        a.shape, a.max_length, a.global_batch, a.budget = "tiny", 256, 4, tiny.BUDGET
    name = f"autotune_{a.shape}_{a.peft}_{a.max_length}.json"

    config_dir = Path(tempfile.mkdtemp())
    Qwen3Config(**SHAPES[a.shape]).save_pretrained(config_dir)
    recipe = Recipe.model_validate({
        "model": {"path": "unused"},  # the probe reads config_dir
        "data": {"sources": [{"path": "unused.jsonl"}], "max_length": a.max_length},
        "train": {"peft": a.peft, "lora": {"r": 16, "alpha": 32, "target_modules": "all-linear"},
                  "micro_batch_size": a.global_batch, "grad_accum": 1},
        "hardware": {"profile": "cpu" if a.tiny else "h100"}, "autotune": {"budget_seconds": a.budget}})
    peak = matmul_peak_tflops("cpu" if a.tiny else "cuda")
    start = time.perf_counter()
    found = (tiny.probe if a.tiny else autotune.probe)(config_dir, recipe, logging.getLogger("probe"),
                                                       recipe.train.global_batch)
    probe_seconds = round(time.perf_counter() - start, 1)
    out = Path(a.out or (tiny.results_path(name) if a.tiny else REPO / "bench" / "results" / name))
    out.parent.mkdir(parents=True, exist_ok=True)
    result = {"shape": a.shape, "peft": a.peft, "max_length": a.max_length, "global_batch": a.global_batch,
              "budget_seconds": a.budget, "flops_per_token": flops_per_token(SHAPES[a.shape], a.peft),
              "matmul_peak_tflops": round(peak, 3), "probe_seconds": probe_seconds, **found}
    out.write_text(json.dumps(result, indent=1) + "\n")
    print_table(result)


def print_table(r: dict) -> None:
    """The probe's measurements as a table (`python -c` over a results file prints it again)."""
    print(f"\n{r['shape']} {r['peft']} seq {r['max_length']} global batch {r['global_batch']}, "
          f"budget {r['budget_seconds']:.0f} s, probe {r.get('probe_seconds', float('nan')):.0f} s")
    print(f"{'attention':34} {'ckpt':9} {'mb':>3} {'compile':>7} {'fusedCE':>7} "
          f"{'tokens/s':>9} {'MFU':>6} {'peak GiB':>9}")
    for m in r["measurements"]:
        row = (f"{m['attn_implementation'] + '/' + (m['sdpa_backend'] or '-'):34} {m['gradient_checkpointing']:9} "
               f"{m['micro_batch_size']:>3} {m['compile']!s:>7} {m['fused_cross_entropy']!s:>7}")
        if "error" in m:
            print(f"{row}  {m['error'][:60]}")
            continue
        mfu = m["tokens_per_s"] * r["flops_per_token"] / (r["matmul_peak_tflops"] * 1e12)
        print(f"{row} {m['tokens_per_s']:>9.0f} {mfu:>6.1%} {m['peak_bytes'] / 2**30:>9.1f}")
    print("decisions:", json.dumps(r["decisions"]))


if __name__ == "__main__":
    main()
