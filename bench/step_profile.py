"""Where a training step's time goes, and what a few changes to our settings buy: the
8B LoRA workload of bench/train_speed.py, one model per variant, timed with the probe's own
step loop (stages/autotune.packed_batch), then one step under torch.profiler.

Variants in the probe's step loop (decisions; bf16 autocast or not; PEFT's cast of each
LoRA input to the fp32 adapters' dtype or not):
  best                the plan probe's H100 decisions (flex attention, no checkpointing,
                      micro-batch 2, regional compile), without autocast
  best_amp            the same under bf16 autocast, as the Trainer runs it
  best_amp_nocast     and without PEFT's input cast
  fused_ce            + Liger's fused linear cross-entropy
  mb4_sel, mb4_off_ce, mb4_sel_amp_nocast: micro-batch 4 with selective checkpointing or
                      with the fused loss
And through the checkpoint stage's trainer (stages/checkpoint.make_trainer, 4 sequences per
step, steps timed by a callback):
  trainer             our trainer: the model's own loss
  trainer_trl_loss    the same with TRL's compute_loss (its chunked LM head and metrics)
  trainer_nogc        our trainer with Python's garbage collector off while it trains

Prints, per variant, tokens/s, peak memory, and the share of the step the GPU was busy;
for the first two, the top kernels by GPU time. Also measures the bf16 matmul peak.

    python bench/step_profile.py [variant ...] [--out FILE]
"""
from __future__ import annotations

import argparse
import gc
import json
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "bench"))

from autotune_probe import matmul_peak_tflops  # noqa: E402
from train_speed import new_model  # noqa: E402

BEST = {"attn_implementation": "flex_attention", "sdpa_backend": None, "rocm_fa_library": None,
        "gradient_checkpointing": "off", "micro_batch_size": 2, "compile": True, "fused_cross_entropy": False}
VARIANTS = {  # (decisions, bf16 autocast as the Trainer does, PEFT's cast of inputs to fp32 adapters)
    "best": (BEST, False, True),
    "best_amp": (BEST, True, True),
    "best_amp_nocast": (BEST, True, False),
    "fused_ce": ({**BEST, "fused_cross_entropy": True}, False, True),
    "mb4_sel": ({**BEST, "micro_batch_size": 4, "gradient_checkpointing": "selective"}, False, True),
    "mb4_off_ce": ({**BEST, "micro_batch_size": 4, "fused_cross_entropy": True}, False, True),
    "mb4_sel_amp_nocast": ({**BEST, "micro_batch_size": 4, "gradient_checkpointing": "selective"}, True, False),
}


def busy_and_top(prof, wall: float) -> dict:
    """Share of the wall time the GPU ran kernels, the top kernels by GPU time, and the
    top host-side operations by CPU time (what the GPU may be waiting for)."""
    import torch

    averages = prof.key_averages()
    kernels = [e for e in averages if e.device_type == torch.autograd.DeviceType.CUDA]
    gpu = sum(e.self_device_time_total for e in kernels) / 1e6
    top = sorted(kernels, key=lambda e: -e.self_device_time_total)[:30]
    host = sorted((e for e in averages if e.device_type == torch.autograd.DeviceType.CPU),
                  key=lambda e: -e.cpu_time_total)[:25]
    return {"gpu_busy": round(gpu / wall, 3),
            "top_kernels": [(e.key[:90], round(e.self_device_time_total / 1e3, 2), e.count) for e in top],
            "top_host": [(e.key[:90], round(e.cpu_time_total / 1e3, 2), e.count) for e in host]}


def run(name: str, setting: dict, amp: bool, input_cast: bool, profile: bool) -> dict:
    import torch
    from peft import get_peft_model

    from stages import autotune
    from stages.checkpoint import lora_config
    from stages.recipe import TrainSection

    autotune.training_mode()
    model = new_model("sdpa")
    model = get_peft_model(model, lora_config(TrainSection(peft="lora", lora={"r": 16, "alpha": 32})))
    model.train()
    autotune.apply_settings(model, setting)
    for m in model.modules():
        if hasattr(m, "cast_input_dtype_enabled"):
            m.cast_input_dtype_enabled = input_cast
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-5, fused=True)
    batch = autotune.packed_batch(setting["micro_batch_size"], 2048, model.config.vocab_size)
    torch.cuda.reset_peak_memory_stats()

    def step():
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=amp):
            loss = model(**batch).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    result = {}
    try:
        for _ in range(3):
            step()
        torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(5):
            step()
        torch.cuda.synchronize()
        seconds = (time.perf_counter() - start) / 5
        result = {"tokens_per_s": round(batch["input_ids"].numel() / seconds, 1), "step_seconds": round(seconds, 4),
                  "peak_gib": round(torch.cuda.max_memory_allocated() / 2**30, 1)}
        from torch.profiler import ProfilerActivity, profile as torch_profile

        with torch_profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            torch.cuda.synchronize()
            start = time.perf_counter()
            step()
            torch.cuda.synchronize()
            wall = time.perf_counter() - start
        found = busy_and_top(prof, wall)
        result.update(found if profile else {"gpu_busy": found["gpu_busy"]})
    except torch.OutOfMemoryError as e:
        result = {"error": str(e).splitlines()[0][:120]}
    print(name, json.dumps(result, indent=1), flush=True)
    del model, optimizer
    gc.collect()
    torch.cuda.empty_cache()
    torch._dynamo.reset()
    return result


def run_trainer(name: str, trl_loss: bool, gc_off: bool = False) -> dict:
    import torch
    from datasets import Dataset
    from transformers import TrainerCallback
    from trl import SFTTrainer

    from stages import autotune
    from stages.base import char_tokenizer
    from stages.checkpoint import make_trainer
    from stages.recipe import TrainSection

    autotune.training_mode()
    model = new_model("sdpa")
    autotune.apply_settings(model, BEST)
    steps, warmup = 13, 3
    batch = autotune.packed_batch(4 * steps, 2048, model.config.vocab_size)
    rows = Dataset.from_dict({k: v.cpu().tolist() for k, v in batch.items()})
    t = TrainSection(peft="lora", lora={"r": 16, "alpha": 32}, max_steps=steps, micro_batch_size=4, save_steps=10**6)
    plan = {**BEST, "device": "cuda", "dtype": "bfloat16", "grad_accum": 2}
    trainer = make_trainer(model, rows, char_tokenizer(), plan, t, Path("/tmp/step_profile") / name)
    if trl_loss:
        trainer.compute_loss = SFTTrainer.compute_loss.__get__(trainer)
    times = []

    profiled = {}

    class Clock(TrainerCallback):
        """Times each step; profiles the next-to-last one."""
        def on_step_begin(self, args, state, control, **kwargs):
            if state.global_step == steps - 2:
                from torch.profiler import ProfilerActivity, profile as torch_profile

                self.prof = torch_profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA])
                self.prof.__enter__()
            torch.cuda.synchronize()
            self.start = time.perf_counter()

        def on_step_end(self, args, state, control, **kwargs):
            torch.cuda.synchronize()
            times.append(time.perf_counter() - self.start)
            if state.global_step == steps - 1:
                self.prof.__exit__(None, None, None)
                profiled.update(busy_and_top(self.prof, times[-1]))

    trainer.add_callback(Clock())
    torch.cuda.reset_peak_memory_stats()
    if gc_off:
        gc.collect()
        gc.freeze()
        gc.disable()
    trainer.train()
    gc.enable()
    gc.unfreeze()
    seconds = sum(times[warmup:]) / (steps - warmup)
    result = {"tokens_per_s": round(4 * 2048 / seconds, 1), "step_seconds": round(seconds, 4),
              "peak_gib": round(torch.cuda.max_memory_allocated() / 2**30, 1), **profiled}
    print(name, json.dumps(result), flush=True)
    del trainer, model
    gc.collect()
    torch.cuda.empty_cache()
    torch._dynamo.reset()
    return result


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("variants", nargs="*", default=[*VARIANTS, "trainer", "trainer_trl_loss"])
    ap.add_argument("--out", default=str(REPO / "bench" / "results" / "step_profile.json"))
    a = ap.parse_args()
    results = {"matmul_peak_tflops": round(matmul_peak_tflops(), 1)}
    print("bf16 matmul peak", results["matmul_peak_tflops"], "TFLOP/s", flush=True)
    for i, name in enumerate(a.variants):
        if name.startswith("trainer"):
            results[name] = run_trainer(name, trl_loss=name == "trainer_trl_loss", gc_off=name.endswith("nogc"))
        else:
            results[name] = run(name, *VARIANTS[name], profile=i <= 1)
        Path(a.out).write_text(json.dumps(results, indent=1) + "\n")


if __name__ == "__main__":
    main()
