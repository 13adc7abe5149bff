"""autotune: the plan stage's probe on a GPU. A few real training steps per candidate, on
the run's shapes (the model's own architecture in the run's dtype, LoRA as the recipe
says, micro-batches of packed sequences shaped as the method runs them: its row's step_shape in
stages/train/methods.py, two sequences per preference pair, a GRPO prompt plus its completion),
inside a time budget.

Candidates are tried in stages, each keeping the winner of the last: attention
implementation; activation checkpointing (off / selective: every other layer / full)
with, for each mode, micro-batches (divisors of the global batch) grown while they fit
under the memory margin; then regional torch.compile (each decoder layer, and the loss) of
every attention implementation that ran, fastest first (compiled, their order can
change: flex attention gains most), and, compiled, the (checkpointing, micro-batch) frontier
searched again, each mode at the largest micro-batch that fits (compiled layers hold fewer
activations, so a micro-batch that did not fit may fit now); then a fused linear cross-entropy
where its library is present. Whatever is not reached inside the budget keeps the best found so
far. The weights are random: speed does not depend on them, and the plan must not depend on the
data (editing a row does not re-plan). Steps run under bf16 autocast, as the Trainer's do.
"""
from __future__ import annotations

import importlib.util
import statistics
import tempfile
import time
from pathlib import Path

from stages.train.methods import METHODS
from stages.train.settings import (apply_checkpointing, apply_settings, lora_config, nf4_config, rocm_env, sdpa_backend,
                                   training_mode)

TIMED_STEPS = 3  # after one warm-up step; the median, so one step held up by the host does not decide
MEMORY_MARGIN = 0.10  # of the GPU's memory, left free for fragmentation and longer runs
DOCUMENT_MEDIAN = 450  # tokens: packed sequences are cut into documents of lognormal length
# (at most an eighth of the sequence, so a sequence always holds several, as packed shards do:
# attention then needs a per-document mask, which rules some kernels out)


def attention_candidates(facts: dict) -> list[dict]:
    """Attention implementations worth timing on this device. On ROCm the flash backend
    comes from one of two libraries, AOTriton or CK, chosen by torch's switch."""
    if facts.get("hip"):
        sdpa = [("flash_attention", "aotriton"), ("flash_attention", "ck"), ("efficient_attention", None)]
    else:
        sdpa = [("flash_attention", None), ("cudnn_attention", None), ("efficient_attention", None)]
    out = [{"attn_implementation": "sdpa", "sdpa_backend": b, "rocm_fa_library": lib} for b, lib in sdpa]
    out.append({"attn_implementation": "flex_attention", "sdpa_backend": None, "rocm_fa_library": None})
    if importlib.util.find_spec("flash_attn") is not None:
        out.append({"attn_implementation": "flash_attention_2", "sdpa_backend": None, "rocm_fa_library": None})
    return out


def micro_batches(global_batch: int) -> list[int]:
    """Micro-batch sizes that keep the recipe's global batch exact (micro x accumulation)."""
    return [m for m in range(1, global_batch + 1) if global_batch % m == 0]


def search(measure, attention: list[dict], global_batch: int, deadline: float, total_memory: int) -> dict:
    """The fastest setting found before the deadline. `measure(setting)` runs real steps and
    returns {"tokens_per_s", "peak_bytes"} or {"error"}; every measurement is kept."""
    tried = []

    def run(setting):
        if time.monotonic() > deadline:
            return None
        result = measure(setting)
        tried.append({**setting, **result})
        return None if "error" in result else result

    safe = {"gradient_checkpointing": "full", "micro_batch_size": 1, "compile": False,
            "fused_cross_entropy": False}
    best, best_speed, ran = None, 0.0, []
    for candidate in attention:
        result = run({**candidate, **safe})
        if result:
            ran.append((result["tokens_per_s"], candidate))
            if result["tokens_per_s"] > best_speed:
                best, best_speed = {**candidate, **safe}, result["tokens_per_s"]
    if best is None:
        return {"decisions": None, "measurements": tried}
    limit = total_memory * (1 - MEMORY_MARGIN)

    def grow(base: dict, sizes: list[int]) -> tuple[int, float]:
        """Micro-batches of `base`, smallest first, while they fit; the fastest becomes best.
        Returns the largest micro-batch that fit (0: none) and the best speed among them."""
        nonlocal best, best_speed
        fit, fastest = 0, 0.0
        for mb in sizes:
            setting = {**base, "micro_batch_size": mb}
            result = {"tokens_per_s": best_speed, "peak_bytes": 0} if setting == best else run(setting)
            if result is None or result["peak_bytes"] > limit:
                break  # larger micro-batches do not fit either (or time is up)
            fit, fastest = mb, max(fastest, result["tokens_per_s"])
            if result["tokens_per_s"] > best_speed:
                best, best_speed = setting, result["tokens_per_s"]
        return fit, fastest

    def largest_fitting(base: dict, sizes: list[int]) -> None:
        """The largest micro-batch of `base` that fits, tried largest first; it becomes best if
        faster. Smaller ones are not tried: speed grows with the micro-batch as long as it fits
        (fewer, larger kernels for the same tokens; so in every mode of every H100 probe here)."""
        nonlocal best, best_speed
        for mb in sorted(sizes, reverse=True):
            setting = {**base, "micro_batch_size": mb}
            if setting == best:
                return
            result = run(setting)
            if result is not None and result["peak_bytes"] <= limit:
                if result["tokens_per_s"] > best_speed:
                    best, best_speed = setting, result["tokens_per_s"]
                return

    frontier = {mode: grow({**best, "gradient_checkpointing": mode}, micro_batches(global_batch))
                for mode in ("off", "selective", "full")}
    uncompiled = best_speed
    for _, candidate in sorted(ran, key=lambda r: -r[0]):  # compiled kernels can reorder the attention
        setting = {**best, **candidate, "compile": True}   # choices: compile each one that ran
        result = run(setting)
        if result and result["peak_bytes"] <= limit and result["tokens_per_s"] > max(best_speed, uncompiled * 1.03):
            best, best_speed = setting, result["tokens_per_s"]
    if best["compile"]:
        # Compiled layers hold fewer activations, so the (checkpointing, micro-batch) frontier moves:
        # search it again compiled, least recomputation first (a near tie uncompiled, decided by noise,
        # must not decide which modes are ever compiled). Each compiled micro-batch costs a compile
        # (half a minute for an 8B model), so each mode tries only its largest micro-batch that fits,
        # largest first down to the one that fit uncompiled; and a mode whose best uncompiled speed,
        # times the gain compiling gave, could not come within 5% of the best is skipped.
        gain = best_speed / uncompiled
        for mode, (fit, fastest) in frontier.items():
            if fastest * gain >= 0.95 * best_speed:
                largest_fitting({**best, "gradient_checkpointing": mode},
                                [m for m in micro_batches(global_batch) if m >= max(fit, 1)])
    if fused_cross_entropy_available():
        result = run({**best, "fused_cross_entropy": True})
        if result and result["peak_bytes"] <= limit and result["tokens_per_s"] > best_speed * 1.03:
            best, best_speed = {**best, "fused_cross_entropy": True}, result["tokens_per_s"]
    return {"decisions": best, "tokens_per_s": best_speed, "measurements": tried}


def fused_cross_entropy_available() -> bool:
    return importlib.util.find_spec("liger_kernel") is not None


def batch_shape(recipe, micro_batch: int) -> tuple[int, int]:
    """(rows, tokens per row) of one probe micro-batch: `micro_batch` examples of the recipe's
    method, each its row's step shape."""
    sequences, length = METHODS[recipe.train.method].step_shape(recipe.train, recipe.data.max_length)
    return micro_batch * sequences, length


def packed_batch(micro_batch: int, length: int, vocab: int, seed: int = 0):
    """Random token ids in packed sequences: documents of lognormal length restart positions."""
    import torch

    g, median = torch.Generator().manual_seed(seed), min(DOCUMENT_MEDIAN, length // 8)
    ids = torch.randint(0, vocab, (micro_batch, length), generator=g)
    positions = torch.empty(micro_batch, length, dtype=torch.long)
    for row in range(micro_batch):
        at = 0
        while at < length:
            n = int(torch.empty(1).log_normal_(0, 0.8, generator=g).item() * median)
            n = min(max(n, 32), length - at)
            positions[row, at: at + n] = torch.arange(n)
            at += n
    return {"input_ids": ids.cuda(), "labels": ids.cuda(), "position_ids": positions.cuda()}


def probe(config_dir, recipe, log, batch: int) -> dict:
    """Build the run's model on the GPU and search micro-batches that divide `batch` (one
    process's share of the global batch); returns search()'s result."""
    import os

    import torch
    from peft.helpers import disable_input_dtype_casting
    from transformers import AutoConfig, AutoModelForCausalLM

    training_mode()
    config = AutoConfig.from_pretrained(config_dir)
    t = recipe.train
    deadline = time.monotonic() + recipe.autotune.budget_seconds
    total = torch.cuda.get_device_properties(0).total_memory

    weights = tempfile.TemporaryDirectory(prefix="mindxtrain-probe-")  # qlora: random weights to load in 4-bit

    def build(setting):
        os.environ.update(rocm_env(setting["rocm_fa_library"]))
        if t.peft == "qlora":  # bitsandbytes quantizes while loading, so the 4-bit model comes from saved weights
            if not any(Path(weights.name).iterdir()):
                AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16).save_pretrained(weights.name)
            model = AutoModelForCausalLM.from_pretrained(weights.name, dtype=torch.bfloat16,
                                                         quantization_config=nf4_config(),
                                                         device_map={"": torch.cuda.current_device()})
        else:
            with torch.device("cuda"):
                model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
        model.config.use_cache = False
        if t.peft != "none":
            from peft import get_peft_model

            model = get_peft_model(model, lora_config(t))
        model.train()
        apply_settings(model, setting)
        return model

    built = {"key": None, "model": None}  # one model per attention/compile/fused-loss choice

    def model_for(setting):
        # uncompiled, SDPA's backends share one model (the backend is chosen around each step: an 8B
        # build costs seconds); compiled, the traced graph holds the backend and the micro-batch
        # (static shapes, as training compiles them), so each gets a fresh compile
        key = tuple(setting[k] for k in ("attn_implementation", "rocm_fa_library", "compile", "fused_cross_entropy"))
        if setting["compile"]:
            key += (setting["sdpa_backend"], setting["micro_batch_size"])
        if built["key"] != key:
            built.update(key=None, model=None)
            torch.cuda.empty_cache()
            torch.compiler.reset()
            built.update(key=key, model=build(setting))
        apply_checkpointing(built["model"], setting["gradient_checkpointing"])
        return built["model"]

    def measure(setting) -> dict:
        model = optimizer = None
        began = time.monotonic()
        try:
            model = model_for(setting)
            optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-5, fused=True)
            batch = packed_batch(*batch_shape(recipe, setting["micro_batch_size"]), config.vocab_size)
            # as training runs: the plan's SDPA backend, LoRA inputs left in bf16 under autocast
            with sdpa_backend(setting["sdpa_backend"]), disable_input_dtype_casting(model):
                times = []
                for _ in range(1 + TIMED_STEPS):  # the first step warms up (and compiles)
                    torch.cuda.synchronize()
                    start = time.perf_counter()
                    with torch.autocast("cuda", dtype=torch.bfloat16):  # as the Trainer runs bf16
                        loss = model(**batch).loss
                    loss.backward()
                    optimizer.step()
                    optimizer.zero_grad(set_to_none=True)
                    torch.cuda.synchronize()
                    times.append(time.perf_counter() - start)
            seconds = statistics.median(times[1:])
            result = {"tokens_per_s": round(batch["input_ids"].numel() / seconds, 1),
                      "peak_bytes": torch.cuda.max_memory_allocated(), "step_seconds": round(seconds, 4)}
        except Exception as e:  # OOM, a backend that cannot run these shapes: recorded, the search goes on
            result = {"error": f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"}
            if model is not None:
                model.zero_grad(set_to_none=True)
        del optimizer
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        result["seconds"] = round(time.monotonic() - began, 1)  # what it cost: building, compiling, steps
        log.info("probe %s -> %s", setting, result)
        return result

    found = search(measure, attention_candidates({"hip": torch.version.hip}),
                   batch, deadline, total)
    built.update(key=None, model=None)
    weights.cleanup()
    torch.cuda.empty_cache()
    torch.compiler.reset()
    return found
