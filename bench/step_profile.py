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
  mb4_amp_nocast      micro-batch 4, no checkpointing, as the trainer runs it (issue 17's "ours")
  mb4_amp_nocast_fp8, _fp8_rowwise, _fp8_forward: the same with the frozen base projections
                      of every decoder layer in FP8 through torchao's float8 training linear
                      (tensorwise or rowwise scales, or FP8 in the forward only; LoRA's adapters
                      and the LM head stay bf16); each records its loss per step on the same
                      batch, for the loss check (needs torchao, not a dependency of the
                      project: pip install torchao; 0.17 was measured)
And through the checkpoint stage's trainer (stages/train/sft.make_trainer, 4 sequences per
step; a callback times the 8 steps after 3 warm-up steps as one window, then profiles one;
results committed before 2026-11-25 timed each step with a sync of its own):
  trainer             our trainer: the model's own loss
  trainer_trl_loss    the same with TRL's compute_loss (its chunked LM head and metrics)
  trainer_nogc        our trainer with Python's garbage collector off while it trains
  trainer_nan_filter  the Trainer's per-micro-batch NaN check of the loss (a host sync) back on,
                      as the Trainer defaults
  trainer_mb4*        micro-batch 4 (one per step), alone, with the fused loss, with the loss
                      left eager (not compiled with the layers), with PEFT's cast of LoRA
                      inputs to fp32 back on, with one lora_A product per projection
                      (trainer_mb4_separate_a: the baseline of A's product shared per input),
                      or with the above
  trainer_mb4_noclip, trainer_mb4_workers: where micro-batch 4 through the trainer loses to
                      the step loop (14.6k vs 15.4k tokens/s): no gradient clipping (the
                      Trainer still computes the norm for each log), two data loader workers
  trainer_cudagraphs* the compiled layers under CUDA graphs (inductor's cudagraph trees, with
                      the layers' COMPILE_OPTIONS), marking each micro-batch a new graph step,
                      keeping gradients allocated
  trainer_mb4_cpp_wrapper, trainer_mb4_combo_kernels: the layers compiled with inductor's C++
                      wrapper (kernels launched from C++, not Python) or its combo kernels
                      (independent small kernels launched as one): the host's share of the step
  trainer_mb4_skip_guards, trainer_mb4_combo_skip_guards: after the warm-up steps, dynamo's
                      guards not evaluated (torch.compiler.set_stance's skip_guard_eval_unsafe),
                      alone or with combo kernels
  trainer_mb4_fp32_logits: the loss from the logits the model returns, which accelerate has
                      converted to fp32 (a copy each way), as before 2026-12-07 (the baseline of
                      stages/train/sft.TargetRowsHead keeping the head's own bf16 output)
  trainer_mb4_model_mask: no block mask from the collator (stages/train/document_mask.py):
                      transformers finds the documents itself in each forward, as before
                      2026-12-02 (the baseline of the collator's mask)
  trainer_mb4_sum:    LoRA's outputs as the base's and the low-rank product's sum, as before
                      lora_accumulate (stages/train/lora_scale.py; its baseline)
  trainer_mb4_sources: trainer_mb4 profiled with shapes and Python stacks, its copies' and
                      fills' GPU time charged to where they were launched (launch_sources);
                      its timings carry the profiler's extra host work
  trainer_mb4_cublaslt: every matmul through cuBLASLt (torch.backends.cuda.preferred_blas_library)
                      instead of cuBLAS, torch's default for bf16 products
  trainer_mb4_synced: a host sync at every step's end, as before 2026-12-07: the Trainer's log
                      each step and batches copied to the GPU blocking the host (the baseline
                      of stages/train/trainer.StepRecords: the host fetches, collates and
                      launches the next step while the GPU trains)
  trainer_mb4_graphs_held: the layers under CUDA graphs, each micro-batch a new graph step, with
                      the block mask's tensors copied to one address each step: cudagraph trees
                      take tensors reached through an argument's attributes (the BlockMask's) to
                      stay where they were recorded, and new ones made them record every graph
                      again in every step (bench/results/lora_accumulate_h200_2026-12-02)
Each variant runs in its own process; trainer variants also report where the GPU waited:
every gap between its operations, split into the part before the host launched the next one
(host-late, charged to the host operation launching it) and the part after (queued: the
device's own latency between operations), and how many operations a step has.

Prints, per variant, tokens/s, peak memory, and the share of the step the GPU was busy; for
the first two step-loop variants and every trainer variant, the profiled step's GPU time by kind
of kernel (matmul, attention, pointwise, reduction, optimizer, copies: KINDS) and the top
kernels. Also measures the bf16 matmul peak.

    python -m bench.step_profile [variant ...] [--out FILE]

--tiny: the tiny recipe's model on the CPU in fp32, sequences of 256, the variants best,
best_amp and trainer by default, each with SDPA for flex attention and uncompiled
(bench/tiny.on_cpu), profiling CPU activity only (a smoke test, not a measurement).
"""
from __future__ import annotations

import argparse
import gc
import json
import sys
import time
from contextlib import nullcontext
from pathlib import Path

from bench import tiny, train_speed
from bench.autotune_probe import matmul_peak_tflops, one_gpu
from bench.train_speed import new_model, peak_gib, reset_peak, sync

one_gpu()

REPO = Path(__file__).resolve().parent.parent
LENGTH = 2048
TINY_VARIANTS = ("best", "best_amp", "trainer", "breakdown")


def use_tiny() -> None:
    """--tiny (the docstring says what it runs), in every process: new_model and the clocks are
    train_speed's, which --tiny puts on the CPU."""
    global LENGTH
    train_speed.use_tiny()
    LENGTH = 256


def activities() -> list:
    from torch.profiler import ProfilerActivity

    return [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if train_speed.DEVICE == "cuda" else [])


def packed_batch(micro_batch: int, vocab: int) -> dict:
    from stages.train import autotune

    make = autotune.packed_batch if train_speed.DEVICE == "cuda" else tiny.packed_batch
    return make(micro_batch, LENGTH, vocab)

BEST = {"attn_implementation": "flex_attention", "sdpa_backend": None, "rocm_fa_library": None,
        "gradient_checkpointing": "off", "micro_batch_size": 2, "compile": True, "fused_cross_entropy": False}
MB4 = {**BEST, "micro_batch_size": 4}
VARIANTS = {  # (decisions, bf16 autocast as the Trainer does, PEFT's cast of inputs to fp32 adapters[, FP8 recipe])
    "best": (BEST, False, True),
    "best_amp": (BEST, True, True),
    "best_amp_nocast": (BEST, True, False),
    "fused_ce": ({**BEST, "fused_cross_entropy": True}, False, True),
    "mb4_sel": ({**BEST, "micro_batch_size": 4, "gradient_checkpointing": "selective"}, False, True),
    "mb4_off_ce": ({**BEST, "micro_batch_size": 4, "fused_cross_entropy": True}, False, True),
    "mb4_sel_amp_nocast": ({**BEST, "micro_batch_size": 4, "gradient_checkpointing": "selective"}, True, False),
    "mb4_amp_nocast": (MB4, True, False),
    "mb4_amp_nocast_fp8": (MB4, True, False, "tensorwise"),
    "mb4_amp_nocast_fp8_rowwise": (MB4, True, False, "rowwise"),
    "mb4_amp_nocast_fp8_forward": (MB4, True, False, "forward"),
}


# mb4_amp_nocast eager (bench/breakdown.py says why), with SDPA, as flex attention's eager path compiles
# its own kernel, at micro-batch 2: at 4 the eager loss's fp32 copies of the logits fill an 80 GB H100
BREAKDOWN = {**MB4, "micro_batch_size": 2, "compile": False, "attn_implementation": "sdpa"}


def run_breakdown(setting: dict) -> dict:
    """The step of mb4_amp_nocast, eager at micro-batch 2, by part (bench/breakdown.py): the loss computed outside
    the model, under the loss head's range, and the optimizer's step under its own; beside it, the
    same step timed with no hooks or profiler."""
    import torch
    from peft import get_peft_model
    from peft.helpers import disable_input_dtype_casting
    from torch.profiler import record_function

    from bench.breakdown import TAG, breakdown
    from stages.engine.recipe import TrainSection
    from stages.model import numerics
    from stages.train import settings
    from stages.train.settings import lora_config

    numerics.training_mode()
    model = get_peft_model(new_model("sdpa"), lora_config(TrainSection(peft="lora", lora={"r": 16, "alpha": 32})))
    model.train()
    settings.apply_settings(model, setting)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-5,
                                  fused=train_speed.DEVICE == "cuda")
    batch = packed_batch(setting["micro_batch_size"], model.config.vocab_size)

    def step():
        with torch.autocast(train_speed.DEVICE, dtype=torch.bfloat16):
            logits = model(input_ids=batch["input_ids"], position_ids=batch["position_ids"]).logits
            with record_function(TAG + "loss_head"):
                loss = model.loss_function(logits=logits, labels=batch["labels"], vocab_size=model.config.vocab_size)
        loss.backward()
        with record_function(TAG + "optimizer"):
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)

    with disable_input_dtype_casting(model):
        for _ in range(3):
            step()
        sync()
        start = time.perf_counter()
        step()
        sync()
        plain = time.perf_counter() - start
        parts = breakdown(model, step, batch["input_ids"].numel(), train_speed.DEVICE == "cuda")
    return {"step_seconds_eager": round(plain, 4), **parts}


def fp8_base_projections(model, recipe: str) -> None:
    """The frozen base projections of the decoder layers (PEFT's `base_layer`) as torchao's
    float8 training linear: forward and input-gradient matmuls in FP8 with dynamic scales;
    compiled, the frozen weights' gradients are pruned. LoRA's A/B and the LM head stay bf16."""
    from torchao.float8 import CastConfig, Float8LinearConfig, ScalingType, convert_to_float8_training

    if recipe == "forward":  # FP8 in the forward matmul only; the input gradients in bf16
        bf16 = CastConfig(scaling_type=ScalingType.DISABLED)
        config = Float8LinearConfig(cast_config_grad_output=bf16, cast_config_weight_for_grad_input=bf16,
                                    cast_config_input_for_grad_weight=bf16)
    else:
        config = Float8LinearConfig.from_recipe_name(recipe)
    convert_to_float8_training(model, config=config,
                               module_filter_fn=lambda module, fqn: fqn.endswith(".base_layer") and ".layers." in fqn)


# A GPU operation's kind, by its name: the first kind with a fragment in the name. cuBLAS's Hopper
# kernels are nvjet_* or sm90_xmma_*/cutlass (LoRA's thin products among them); flex attention runs
# as inductor templates (triton_tem_*); inductor's fused kernels are pointwise (triton_poi_*) or
# reductions (triton_red_*, triton_per_*: RMSNorm, the loss, the gradients' norms).
KINDS = (("matmul", ("gemm", "nvjet", "xmma", "cutlass", "splitk")),
         ("attention", ("triton_tem", "flex_attention")),
         ("pointwise", ("triton_poi",)),
         ("reduction", ("triton_red", "triton_per")),
         ("optimizer", ("multi_tensor_apply", "adam")),
         ("copy_fill", ("memcpy", "memset", "copy", "fill")))


def kind_of(name: str) -> str:
    lowered = name.lower()
    return next((kind for kind, fragments in KINDS if any(f in lowered for f in fragments)), "other")


def busy_and_top(prof, wall: float) -> dict:
    """Share of the wall time the GPU ran kernels, its time by kind of kernel (KINDS), the top
    kernels by GPU time, and the top host-side operations by CPU time (what the GPU may be
    waiting for)."""
    import torch

    averages = prof.key_averages()
    kernels = [e for e in averages if e.device_type == torch.autograd.DeviceType.CUDA  # not inductor's ranges
               and not e.key.startswith("## Call CompiledFxGraph")]  # over its kernels (a profile with shapes)
    gpu = sum(e.self_device_time_total for e in kernels) / 1e6
    by_kind: dict = {}
    for e in kernels:
        kind = kind_of(e.key)
        by_kind[kind] = by_kind.get(kind, 0.0) + e.self_device_time_total / 1e3
    top = sorted(kernels, key=lambda e: -e.self_device_time_total)[:30]
    host = sorted((e for e in averages if e.device_type == torch.autograd.DeviceType.CPU),
                  key=lambda e: -e.cpu_time_total)[:25]
    return {"gpu_busy": round(gpu / wall, 3),
            "gpu_ms_by_kind": {k: round(v, 2) for k, v in sorted(by_kind.items(), key=lambda kv: -kv[1])},
            "top_kernels": [(e.key[:90], round(e.self_device_time_total / 1e3, 2), e.count) for e in top],
            "top_host": [(e.key[:90], round(e.cpu_time_total / 1e3, 2), e.count) for e in host]}


def run(name: str, setting: dict, amp: bool, input_cast: bool, fp8: str | None = None, profile: bool = False) -> dict:
    import torch
    from peft import get_peft_model
    from peft.helpers import disable_input_dtype_casting

    from stages.model import numerics
    from stages.train import settings
    from stages.train.settings import lora_config
    from stages.engine.recipe import TrainSection

    numerics.training_mode()
    model = new_model("sdpa")
    model = get_peft_model(model, lora_config(TrainSection(peft="lora", lora={"r": 16, "alpha": 32})))
    model.train()
    if fp8:
        fp8_base_projections(model, fp8)
    settings.apply_settings(model, setting)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-5, fused=True)
    batch = packed_batch(setting["micro_batch_size"], model.config.vocab_size)
    reset_peak()
    losses = []

    def step():
        with torch.autocast(train_speed.DEVICE, dtype=torch.bfloat16, enabled=amp):
            loss = model(**batch).loss
        losses.append(loss.detach())
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    result = {}
    with disable_input_dtype_casting(model, active=not input_cast):  # PEFT's cast of LoRA inputs, or not
        try:
            for _ in range(3):
                step()
            sync()
            start = time.perf_counter()
            for _ in range(5):
                step()
            sync()
            seconds = (time.perf_counter() - start) / 5
            result = {"tokens_per_s": round(batch["input_ids"].numel() / seconds, 1),
                      "step_seconds": round(seconds, 4),
                      "peak_gib": peak_gib(),
                      "losses": [round(x, 4) for x in torch.stack(losses).tolist()]}
            from torch.profiler import profile as torch_profile

            with torch_profile(activities=activities()) as prof:
                sync()
                start = time.perf_counter()
                step()
                sync()
                wall = time.perf_counter() - start
            found = busy_and_top(prof, wall)
            result.update(found if profile else {"gpu_busy": found["gpu_busy"]})
        except torch.OutOfMemoryError as e:
            result = {"error": str(e).splitlines()[0][:120]}
    return result


GRAPHS = {"triton.cudagraphs": True}
TRAINER_VARIANTS = {  # (decisions, options): through the checkpoint stage's trainer
    "trainer": (BEST, {}),
    "trainer_trl_loss": (BEST, {"trl_loss": True}),
    "trainer_nogc": (BEST, {"gc_off": True}),
    "trainer_mb4": ({**BEST, "micro_batch_size": 4}, {}),
    "trainer_mb4_ce": ({**BEST, "micro_batch_size": 4, "fused_cross_entropy": True}, {}),
    "trainer_mb4_eager_loss": ({**BEST, "micro_batch_size": 4}, {"eager_loss": True}),
    "trainer_mb4_input_cast": ({**BEST, "micro_batch_size": 4}, {"input_cast": True}),
    "trainer_mb4_separate_a": ({**BEST, "micro_batch_size": 4}, {"share_inputs": False}),
    "trainer_cudagraphs": (BEST, {"compile_options": GRAPHS}),
    "trainer_mb4_cudagraphs": ({**BEST, "micro_batch_size": 4}, {"compile_options": GRAPHS}),
    "trainer_cudagraphs_marked": (BEST, {"compile_options": GRAPHS, "mark_steps": True}),
    "trainer_mb4_cudagraphs_marked": ({**BEST, "micro_batch_size": 4}, {"compile_options": GRAPHS, "mark_steps": True}),
    "trainer_cudagraphs_grads": (BEST, {"compile_options": GRAPHS, "mark_steps": True, "grads_kept": True}),
    "trainer_mb4_cudagraphs_grads": ({**BEST, "micro_batch_size": 4},
                                     {"compile_options": GRAPHS, "mark_steps": True, "grads_kept": True}),
    "trainer_mb4_cpp_wrapper": (MB4, {"compile_options": {"cpp_wrapper": True}}),
    "trainer_mb4_combo_kernels": (MB4, {"compile_options": {"combo_kernels": True}}),
    "trainer_mb4_skip_guards": (MB4, {"skip_guards": True}),
    "trainer_mb4_combo_skip_guards": (MB4, {"compile_options": {"combo_kernels": True}, "skip_guards": True}),
    "trainer_mb4_model_mask": (MB4, {"model_mask": True}),
    "trainer_mb4_fp32_logits": (MB4, {"fp32_logits": True}),
    "trainer_mb4_sum": (MB4, {"accumulate": False}),
    "trainer_mb4_graphs_held": (MB4, {"compile_options": GRAPHS, "mark_steps": True, "held_blocks": True}),
    "trainer_nan_filter": (BEST, {"nan_filter": True}),
    "trainer_mb4_synced": (MB4, {"synced": True}),
    "trainer_mb4_noclip": (MB4, {"clip": False}),
    "trainer_mb4_workers": (MB4, {"workers": 2}),
    "trainer_mb4_sources": (MB4, {"sources": True}),
    "trainer_mb4_cublaslt": (MB4, {"blas": "cublaslt"}),
}


GPU_OPS = ("kernel", "gpu_memcpy", "gpu_memset")


class HostIndex:
    """A profiler trace's host side: each GPU operation's launch (by correlation id) and, per
    thread, the host events of the given categories that enclose a moment, outermost first
    (among the `window` latest started: the innermost are there)."""

    def __init__(self, events: list, categories: tuple = ("cpu_op",), window: int = 64):
        self.launches = {e["args"]["correlation"]: e for e in events
                         if e.get("cat") in ("cuda_runtime", "cuda_driver") and "correlation" in e.get("args", {})}
        self.host: dict = {}
        for e in events:
            if e.get("ph") == "X" and e.get("cat") in categories:
                self.host.setdefault(e["tid"], []).append(e)
        for found in self.host.values():
            found.sort(key=lambda e: e["ts"])
        self.starts = {tid: [e["ts"] for e in found] for tid, found in self.host.items()}
        self.window = window

    def launch(self, op: dict):
        return self.launches.get(op.get("args", {}).get("correlation"))

    def enclosing(self, tid, ts: float) -> list:
        from bisect import bisect_right

        found, end = self.host.get(tid, []), bisect_right(self.starts.get(tid, []), ts)
        return [e for e in found[max(0, end - self.window):end] if e["ts"] + e["dur"] >= ts]


def gap_split(events: list) -> dict:
    """Every gap between the GPU's operations in a profiler trace (its traceEvents), split in
    two: host-late, the part before the host had launched the next operation (the GPU waited
    for the host: launch overhead, a sync, Python), and queued, the part after (the device's own
    latency between operations, which only fewer operations shorten). Host-late time is charged
    to the operations the launching thread was in at the launch (outermost and innermost), and
    to the thread. In ms; gpu_ops counts the GPU's operations."""
    gpu = sorted((e for e in events if e.get("ph") == "X" and e.get("cat") in GPU_OPS), key=lambda e: e["ts"])
    index = HostIndex(events)
    names = {e["tid"]: e["args"]["name"] for e in events if e.get("ph") == "M" and e.get("name") == "thread_name"}

    def enclosing(tid, ts: float) -> tuple:
        inside = index.enclosing(tid, ts)
        outer = min(inside, key=lambda e: e["ts"])["name"][:80] if inside else "(none)"
        inner = max(inside, key=lambda e: e["ts"])["name"][:80] if inside else "(none)"
        return outer, inner

    late = queued = 0.0
    by = {"by_thread": {}, "by_outer": {}, "by_inner": {}}
    end = None
    for op in gpu:
        if end is not None and op["ts"] > end:
            gap = op["ts"] - end
            launch = index.launch(op)
            launched = launch["ts"] + launch["dur"] if launch else end
            wait = min(gap, max(0.0, launched - end))
            late, queued = late + wait, queued + gap - wait
            if wait > 0:
                outer, inner = enclosing(launch["tid"], launch["ts"])
                for key, name in (("by_thread", str(names.get(launch["tid"], launch["tid"]))),
                                  ("by_outer", outer), ("by_inner", inner)):
                    by[key][name] = by[key].get(name, 0.0) + wait
        end = op["ts"] + op["dur"] if end is None else max(end, op["ts"] + op["dur"])
    top = lambda d: sorted(((k, round(v / 1e3, 2)) for k, v in d.items()), key=lambda kv: -kv[1])[:12]
    return {"gpu_ops": len(gpu), "gaps_ms": round((late + queued) / 1e3, 2), "host_late_ms": round(late / 1e3, 2),
            "queued_ms": round(queued / 1e3, 2), **{k: top(v) for k, v in by.items()}}


def launch_sources(events: list, kinds: tuple = ("copy_fill",)) -> list:
    """The GPU time of the kernels of these kinds (kind_of) in a profiler trace, charged to
    where the host launched them: the innermost host operation with its inputs' shapes (a
    profile with record_shapes) and the innermost Python frames outside torch (one with
    with_stack). In ms, the 15 costliest sources with their kernel counts: what to look at
    to remove a copy or a fill."""
    index = HostIndex(events, ("cpu_op", "python_function"), window=2000)
    charged: dict = {}
    for op in events:
        if op.get("ph") != "X" or op.get("cat") not in GPU_OPS:
            continue
        if op["cat"] == "kernel" and kind_of(op["name"]) not in kinds:
            continue
        launch = index.launch(op)
        where = "(launch not found)"
        if launch:
            inside = index.enclosing(launch["tid"], launch["ts"])
            ops = [e for e in inside if e["cat"] == "cpu_op"]
            frames = [e["name"] for e in inside if e["cat"] == "python_function"
                      and "torch/" not in e["name"] and not e["name"].startswith("<built-in")]
            inner = f"{ops[-1]['name']} {ops[-1].get('args', {}).get('Input Dims', '')}" if ops else "(no op)"
            where = " < ".join([inner[:120]] + [f[-90:] for f in frames[-3:][::-1]])
        key = f"{op['name'][:50]} @ {where}"
        ms, count = charged.get(key, (0.0, 0))
        charged[key] = (ms + op["dur"] / 1e3, count + 1)
    return [(k, round(ms, 2), n) for k, (ms, n) in sorted(charged.items(), key=lambda kv: -kv[1][0])[:15]]


def idle_gaps(prof, sources: bool = False) -> dict:
    """gap_split of a finished profile (its trace written and read back: the trace is where
    each GPU operation's launch is named), and with sources its copies' and fills'
    launch_sources."""
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        prof.export_chrome_trace(f"{tmp}/trace.json")
        events = json.loads(Path(f"{tmp}/trace.json").read_text())["traceEvents"]
    return {**gap_split(events), **({"copy_sources": launch_sources(events)} if sources else {})}


def run_trainer(name: str, setting: dict, trl_loss: bool = False, gc_off: bool = False,
                synced: bool = False, compile_options: dict | None = None, mark_steps: bool = False,
                grads_kept: bool = False, nan_filter: bool = False,
                eager_loss: bool = False, input_cast: bool = False, clip: bool = True, workers: int = 0,
                share_inputs: bool = True, skip_guards: bool = False, model_mask: bool = False,
                fp32_logits: bool = False, accumulate: bool = True, held_blocks: bool = False,
                sources: bool = False, blas: str | None = None) -> dict:
    import torch
    from datasets import Dataset
    from transformers import TrainerCallback
    from trl import SFTTrainer

    from stages.model import numerics
    from stages.train import settings
    from stages.model.tiny import char_tokenizer
    from stages.train.settings import step_context
    from stages.train.methods import METHODS
    from stages.train.sft import make_trainer
    from stages.train.trainer import StepRecords
    from stages.engine.recipe import TrainSection

    numerics.training_mode()
    if blas:  # every matmul through this BLAS library (torch's default for bf16 products is cuBLAS)
        torch.backends.cuda.preferred_blas_library(blas)
    model = new_model("sdpa")
    settings.apply_settings(model, setting)
    if compile_options:  # the layers compiled again, as they train, with more of inductor's options
        for layer in settings.decoder_layers(model):
            layer.compile(options={**settings.COMPILE_OPTIONS, **compile_options})
    if eager_loss:  # the loss as transformers runs it, not compiled with the layers
        from transformers.loss.loss_utils import LOSS_MAPPING

        model.loss_function = LOSS_MAPPING["ForCausalLM"]
    steps, warmup, mb = 13, 3, setting["micro_batch_size"]
    batch = packed_batch(4 * steps, model.config.vocab_size)
    rows = Dataset.from_dict({k: v.cpu().tolist() for k, v in batch.items()})
    t = TrainSection(peft="lora", lora={"r": 16, "alpha": 32}, max_steps=steps, micro_batch_size=4, save_steps=10**6)
    plan = {**setting, "device": train_speed.DEVICE, "dtype": train_speed.DTYPE, "processes": 1, "grad_accum": 4 // mb}
    trainer = make_trainer(METHODS["sft"], model, rows, char_tokenizer(), plan, t, Path("/tmp/step_profile") / name)
    StepRecords(trainer)  # as the checkpoint stage trains: each step's figures kept without a sync
    if synced:  # a log each step and batches copied blocking the host (accelerate reads this in train())
        trainer.args.logging_steps = 1
        trainer.accelerator.dataloader_config.non_blocking = False
    if fp32_logits:  # the model returns the head's logits, which accelerate converts to fp32 (its baseline)
        trainer.head.keep = False
    if model_mask:  # the collator's rows without flex's blocks: the model finds the documents itself
        from stages.train.sft import collate

        trainer.data_collator = collate
    if held_blocks:  # the block mask's tensors copied to one address per shape
        from stages.train.document_mask import KEYS

        held, compute_loss = {}, trainer.compute_loss

        def held_loss(model, inputs, *args, **kwargs):
            if KEYS[0] not in inputs:  # no block mask (not flex attention: the CPU's smoke run)
                return compute_loss(model, inputs, *args, **kwargs)
            shapes = tuple(tuple(inputs[k].shape) for k in KEYS)
            if shapes not in held:
                held[shapes] = {k: torch.empty_like(inputs[k]) for k in KEYS}
            for k in KEYS:
                held[shapes][k].copy_(inputs[k])
            return compute_loss(model, {**inputs, **held[shapes]}, *args, **kwargs)
        trainer.compute_loss = held_loss
    if trl_loss:
        trainer.compute_loss = SFTTrainer.compute_loss.__get__(trainer)
    if mark_steps:  # each micro-batch a new CUDA graph step
        training_step = trainer.training_step

        def marked(*args, **kwargs):
            torch.compiler.cudagraph_mark_step_begin()
            return training_step(*args, **kwargs)
        trainer.training_step = marked
    if not clip:  # what clipping the gradients' norm to 1.0 costs (the recipe's setting, not ours to drop)
        trainer.args.max_grad_norm = 0
    trainer.args.dataloader_num_workers = workers  # rows fetched and collated off the training process
    if nan_filter:  # the Trainer's default, which the checkpoint stage turns off
        trainer.args.logging_nan_inf_filter = True
    window, profiled = [], {}

    class Clock(TrainerCallback):
        """Times the steps after the warm-up as one window, with no sync of its own between
        them (the Trainer's own syncs, such as a log's, stay in), then profiles the next-to-last
        step on its own (the profiler's cost stays out of the window)."""
        def on_step_begin(self, args, state, control, **kwargs):
            if grads_kept:  # gradients accumulate into these instead of taking a CUDA graph's output
                for p in kwargs["model"].parameters():
                    if p.requires_grad and p.grad is None:
                        p.grad = torch.zeros_like(p)
            if skip_guards and state.global_step == warmup:  # every graph compiled by now
                torch.compiler.set_stance("default", skip_guard_eval_unsafe=True)
            if state.global_step in (warmup, steps - 2):
                sync()
                now = time.perf_counter()
                if state.global_step == warmup:
                    self.start = now
                else:
                    window.append(now - self.start)
                    from torch.profiler import profile as torch_profile

                    self.prof = torch_profile(activities=activities(), record_shapes=sources, with_stack=sources)
                    self.prof.__enter__()
                    self.start = time.perf_counter()

        def on_step_end(self, args, state, control, **kwargs):
            if state.global_step == steps - 1:
                sync()
                wall = time.perf_counter() - self.start
                self.prof.__exit__(None, None, None)
                found = busy_and_top(self.prof, wall)
                profiled.update({k: found[k] for k in ("gpu_busy", "gpu_ms_by_kind", "top_kernels")})
                profiled.update(idle_gaps(self.prof, sources))

    trainer.add_callback(Clock())
    reset_peak()
    if gc_off:
        gc.collect()
        gc.freeze()
        gc.disable()
    try:  # as the checkpoint stage trains (BEST names no SDPA backend: input_cast leaves PEFT's cast on)
        with nullcontext() if input_cast else step_context(trainer.model, plan, trainer.args.bf16, share_inputs,
                                                                   accumulate):
            trainer.train()
    except Exception as e:  # OOM, a compile mode that cannot run this graph: recorded
        return {"error": f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"}
    seconds = window[0] / (steps - 2 - warmup)
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    return {"tokens_per_s": round(4 * LENGTH / seconds, 1), "step_seconds": round(seconds, 4),
            "peak_gib": peak_gib(), "last_loss": losses[-1], **profiled}


def run_one(name: str, first: bool) -> dict:
    on_device = tiny.on_cpu if train_speed.DEVICE == "cpu" else (lambda setting: setting)
    if name == "breakdown":
        return run_breakdown(on_device(BREAKDOWN))
    if name in TRAINER_VARIANTS:
        setting, options = TRAINER_VARIANTS[name]
        return run_trainer(name, on_device(setting), **options)
    setting, *rest = VARIANTS[name]
    return run(name, on_device(setting), *rest, profile=first)


def main() -> None:
    import subprocess

    ap = argparse.ArgumentParser()
    ap.add_argument("variants", nargs="*")
    ap.add_argument("--out", help="default bench/results/step_profile.json")
    ap.add_argument("--one", action="store_true", help="(internal) run one variant in this process")
    ap.add_argument("--tiny", action="store_true", help="the tiny model on the CPU: a smoke test, not a measurement")
    a = ap.parse_args()
    if a.tiny:
        use_tiny()
    if a.one:  # a child: one variant, its result as the last line
        print(json.dumps(run_one(a.variants[0], a.variants[1] == "first")), flush=True)
        return
    a.variants = a.variants or (TINY_VARIANTS if a.tiny else [*VARIANTS, *TRAINER_VARIANTS, "breakdown"])
    a.out = a.out or (tiny.results_path("step_profile.json") if a.tiny else
                      REPO / "bench" / "results" / "step_profile.json")
    results = {"matmul_peak_tflops": round(matmul_peak_tflops(train_speed.DEVICE), 1)}
    print("bf16 matmul peak", results["matmul_peak_tflops"], "TFLOP/s", flush=True)
    for i, name in enumerate(a.variants):
        # each variant in a process of its own: compiled graphs, CUDA graph pools and Liger's
        # patches must not carry over into the next one
        child = subprocess.run([sys.executable, "-m", "bench.step_profile", "--one", name, "first" if i <= 1 else "-"]
                               + (["--tiny"] if a.tiny else []), stdout=subprocess.PIPE, text=True)
        lines = child.stdout.strip().splitlines()
        results[name] = json.loads(lines[-1]) if child.returncode == 0 and lines else {"error": f"exit {child.returncode}"}
        print(name, json.dumps(results[name]), flush=True)
        Path(a.out).write_text(json.dumps(results, indent=1) + "\n")


if __name__ == "__main__":
    main()
