"""autotune: the plan stage's probe on a GPU. A few real training steps per candidate, on
the run's shapes (the model's own architecture in the run's dtype, LoRA as the recipe
says, micro-batches of packed sequences shaped as the method runs them: its row's step_shape in
stages/train/methods.py, two sequences per preference pair, a GRPO prompt plus its completion),
inside a time budget.

The search (search() says each step) measures what can win and rules out the rest by what
earlier measurements show: compiled layers beat eager ones (1.6-1.7x for 8B LoRA on an H100),
less recomputation beats more at the same micro-batch, a larger micro-batch beats a smaller one
while it fits, and a micro-batch that cannot fit even at the memory floor is not compiled. One
model is built and kept: attention implementations are switched on it, and compiling it (in
place) comes after every eager measurement. A cold probe of qwen3_8b on an H100 so measures
five or six settings, two of them compiled, instead of sixteen. Whatever is not reached inside
the budget keeps the best found so far. The weights are random: speed does not depend on them,
and the plan must not depend on the data (editing a row does not re-plan). Steps run under
bf16 autocast, as the Trainer's do.

A run the plan shards over several GPUs (FSDP2) is probed on one GPU through a memory model
(sharded_estimate): each setting is timed on slices of the model, DEPTHS decoder layers deep,
and what a layer adds (time, activations) is carried to the model's depth, over weights,
gradients and optimizer state divided by the processes plus what FSDP2 gathers whole at once.
So a base that fits no single GPU is planned too, by the search above, on the sharded run's
figures; the plan's sidecar keeps the peak it expects, the checkpoint's the peak training reached.
"""
from __future__ import annotations

import importlib.util
import statistics
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path

from stages.model.numerics import training_mode
from stages.train.methods import METHODS
from stages.train.settings import (apply_settings, compile_regions, decoder_layers, lora_config, nf4_config, rocm_env,
                                   step_context, switch_settings, without_peft)

TIMED_STEPS = 3  # after one warm-up step; the median, so one step held up by the host does not decide
MEMORY_MARGIN = 0.10  # of the GPU's memory, left free for fragmentation and longer runs
DOCUMENT_MEDIAN = 450  # tokens: packed sequences are cut into documents of lognormal length
# (at most an eighth of the sequence, so a sequence always holds several, as packed shards do:
# attention then needs a per-document mask, which rules some kernels out)
COMPILED_ONLY = {"flex_attention"}  # its eager path compiles its own kernel (20-30 s for an 8B on an
# H100), which compiled layers compile again; it is measured compiled only
MEMORY_FLOOR = 0.5  # compiled layers keep at least this share of the activations eager layers keep
# (Qwen3-8B LoRA at 2048 on an H100: 10.6 of 16.5 GiB a sequence, 0.64): a micro-batch that
# would not fit even then is not compiled
DEPTHS = (2, 4)  # decoder layers of the two slices a sharded run's probe times: every layer is alike, so
# the difference is one layer's cost, and the shallower slice's remainder the rest of the model's
SATURATING_TOKENS = 4096  # tokens per micro-batch past which doubling it gains less than
# recomputation costs (8B LoRA compiled on an H100: micro-batch 2 -> 4 of 2048 gained 4%, selective
# checkpointing at 4 cost 12%): once a lighter mode fits that many, heavier ones are not tried


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


def search(measure, attention: list[dict], global_batch: int, example_tokens: int, deadline: float,
           total_memory: int) -> dict:
    """The fastest setting found before the deadline. `measure(setting)` runs real steps and
    returns {"tokens_per_s", "peak_bytes", "resident_bytes"} or {"error"}; every measurement is
    kept. Each step rules out what cannot win rather than measuring it:

    1. screen: each attention implementation eagerly at the safe setting (full checkpointing,
       micro-batch 1): which run at all, and the fallback where nothing compiles;
    2. reference: the fastest without checkpointing, still micro-batch 1, for the memory floor;
    3. frontier, compiled, with the first attention (flex where offered, then the screened
       fastest first): each checkpointing mode, least recomputation first, at its largest
       micro-batch that fits. A heavier mode is tried only at micro-batches larger than a
       lighter one fit (at the same micro-batch less recomputation is faster) and only until
       a lighter one fits SATURATING_TOKENS;
    4. every other attention that ran, compiled, at that winner's checkpointing and micro-batch;
    5. nothing compiled ran: the frontier again, eager, with the screened fastest;
    6. the fused cross-entropy where its library is present.
    Where time runs out before any of 3-5 finds a setting, the fastest measured one that fit is the
    decision (the screen's safe settings at least); None only where nothing ran and fit."""
    tried, ran = [], []  # every measurement; (setting, tokens/s) of each that fit
    limit = total_memory * (1 - MEMORY_MARGIN)
    sizes = sorted(micro_batches(global_batch), reverse=True)

    def run(setting: dict) -> dict | None:
        """The measurement of `setting` (an error included), None once time is up."""
        if time.monotonic() > deadline:
            return None
        result = measure(setting)
        tried.append({**setting, **result})
        if fits(result):
            ran.append((setting, result["tokens_per_s"]))
        return result

    def fits(result) -> bool:
        return result is not None and "error" not in result and result["peak_bytes"] <= limit

    def too_big(result) -> bool:
        return result is not None and ("OutOfMemoryError" in result.get("error", "") or
                                       ("error" not in result and result["peak_bytes"] > limit))

    safe = {"gradient_checkpointing": "full", "micro_batch_size": 1, "compile": False, "fused_cross_entropy": False}
    screened = []
    for candidate in attention:
        if candidate["attn_implementation"] not in COMPILED_ONLY:
            result = run({**candidate, **safe})
            if fits(result):
                screened.append((result["tokens_per_s"], candidate))
    screened = [c for _, c in sorted(screened, key=lambda s: -s[0])]
    reference = run({**screened[0], **safe, "gradient_checkpointing": "off"}) if screened else None

    def ruled_out(setting: dict) -> bool:
        """Compiled without checkpointing, too big even at the memory floor."""
        if not (setting["compile"] and setting["gradient_checkpointing"] == "off" and fits(reference)
                and "resident_bytes" in reference):
            return False
        resident = reference["resident_bytes"]
        activations = reference["peak_bytes"] - resident
        return resident + setting["micro_batch_size"] * MEMORY_FLOOR * activations > limit

    def frontier(base: dict) -> tuple[dict, float] | None:
        found, above = None, 0
        for mode in ("off", "selective", "full"):
            if above * example_tokens >= SATURATING_TOKENS:
                break
            for mb in sizes:
                if mb <= above:
                    break
                setting = {**base, "gradient_checkpointing": mode, "micro_batch_size": mb}
                if ruled_out(setting):
                    continue
                result = run(setting)
                if fits(result):
                    if found is None or result["tokens_per_s"] > found[1]:
                        found = (setting, result["tokens_per_s"])
                    above = mb
                    break
                if not too_big(result):  # time is up, or this attention cannot run here
                    return found
        return found

    compiled_order = [c for c in attention if c["attn_implementation"] in COMPILED_ONLY] + screened
    best = None
    for candidate in compiled_order:
        if best is None:
            best = frontier({**candidate, "compile": True, "fused_cross_entropy": False})
            continue
        setting = {**best[0], **candidate}
        result = run(setting)
        if fits(result) and result["tokens_per_s"] > best[1]:
            best = (setting, result["tokens_per_s"])
    if best is None and screened:
        best = frontier({**screened[0], "compile": False, "fused_cross_entropy": False})
    if best is None:  # time ran out before the frontier: the fastest that ran (the screen's, at least)
        best = max(ran, key=lambda r: r[1], default=None)
    if best is None:
        return {"decisions": None, "measurements": tried}
    if fused_cross_entropy_available():
        setting = {**best[0], "fused_cross_entropy": True}
        result = run(setting)
        if fits(result) and result["tokens_per_s"] > best[1] * 1.03:
            best = (setting, result["tokens_per_s"])
    return {"decisions": best[0], "tokens_per_s": best[1], "measurements": tried}


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


COMPUTE_BYTES = 2  # bf16, the Trainer's mixed precision: what FSDP2 gathers weights and reduces gradients in
MASTER_BYTES = 16  # a trainable parameter under FSDP2: accelerate keeps it in fp32 for mixed precision,
# with an fp32 gradient and AdamW's two fp32 moments


def parameter_counts(model, layer) -> dict:
    """Parameters of one decoder layer (`layer`; every layer is alike) and of the rest of the
    model: how many, how many trainable, and the bytes of the frozen ones as this model holds them."""
    def count(params) -> dict:
        params = list(params)
        return {"params": sum(p.numel() for p in params),
                "trainable": sum(p.numel() for p in params if p.requires_grad),
                "frozen_bytes": sum(p.numel() * p.element_size() for p in params if not p.requires_grad)}

    in_layers = {id(p) for each in decoder_layers(model) for p in each.parameters()}
    return {"layer": count(layer.parameters()), "other": count(p for p in model.parameters() if id(p) not in in_layers)}


def sharded_estimate(shallow: dict, deep: dict, layers: int, shards: int, counts: dict) -> dict:
    """One sharded process's step, from the steps of two slices DEPTHS layers deep on one GPU.
    Time and activations (a slice's peak over what it held before the step, its gradients dropped
    as they landed) grow by what one layer adds from one slice to the other (never less than
    nothing: a slice's peak may be at the loss, the same at any depth). Memory: frozen weights,
    and trainable ones at MASTER_BYTES, divided by the processes; whole at once in COMPUTE_BYTES,
    as FSDP2 gathers them, the weights outside the layers (embeddings, the head: counted whole
    throughout) and their gradients (the head's are not resharded before the backward ends), two
    layers' weights (one computing, the next prefetched) and one layer's gradients before they are
    reduce-scattered. `resident_bytes` is all of that but the activations: what does not grow with
    the micro-batch. Communication is not counted: FSDP2 overlaps it with compute."""
    k1, k2 = DEPTHS
    grow = (layers - k2) / (k2 - k1)
    seconds = deep["step_seconds"] + grow * max(0.0, deep["step_seconds"] - shallow["step_seconds"])
    activations = deep["activation_bytes"] + grow * max(0, deep["activation_bytes"] - shallow["activation_bytes"])
    layer, other = counts["layer"], counts["other"]
    state = sum(n * (part["frozen_bytes"] + MASTER_BYTES * part["trainable"])
                for n, part in ((layers, layer), (1, other))) / shards
    gathered = COMPUTE_BYTES * (other["params"] + other["trainable"] + 2 * layer["params"] + layer["trainable"])
    return {"tokens_per_s": round(deep["tokens"] / seconds, 1), "step_seconds": round(seconds, 4),
            "peak_bytes": int(state + gathered + activations), "resident_bytes": int(state + gathered)}


@contextmanager
def first_layers(model, depth: int):
    """The model cut to its first `depth` decoder layers while inside: a slice of the model that a
    sharded run's probe times (its other layers keep their weights, unused)."""
    decoder = without_peft(model).get_decoder()
    whole = decoder.layers
    decoder.layers = whole[:depth]
    try:
        yield model
    finally:
        decoder.layers = whole


def probe(config_dir, recipe, log, batch: int, shards: int = 1, deadline: float | None = None) -> dict:
    """Build the run's model on the GPU once and search micro-batches that divide `batch` (one
    process's share of the global batch) until `deadline` (time.monotonic(); default: the
    recipe's autotune.budget_seconds from now); returns search()'s result. With `shards` > 1 the
    run is sharded over that many GPUs: the model built is DEPTHS[-1] layers deep and each
    setting's figures are sharded_estimate's."""
    import os

    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    training_mode()
    config = AutoConfig.from_pretrained(config_dir)
    layers = config.num_hidden_layers
    if shards > 1:
        config.num_hidden_layers = DEPTHS[-1]
        if isinstance(getattr(config, "layer_types", None), list):
            config.layer_types = config.layer_types[:DEPTHS[-1]]
    t = recipe.train
    deadline = deadline or time.monotonic() + recipe.autotune.budget_seconds
    total = torch.cuda.get_device_properties(0).total_memory

    weights = tempfile.TemporaryDirectory(prefix="mindxtrain-probe-")  # qlora: random weights to load in 4-bit

    def build():
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
        return model

    # the one model: "graph" is what its compiled layers were last traced for, None while eager
    held = {"model": None, "fused": None, "graph": None}

    def model_for(setting):
        """The model brought to `setting`. Built again only for a fused loss (bound at build) or
        to run eagerly once compiled (the search compiles after every eager measurement);
        compiled in place the first time a setting asks. A compiled graph holds the attention,
        its SDPA backend and the micro-batch (static shapes, as training compiles them), so
        changing one drops the graphs and the next step compiles afresh."""
        os.environ.update(rocm_env(setting["rocm_fa_library"]))
        graph = tuple(setting[k] for k in ("attn_implementation", "sdpa_backend", "rocm_fa_library",
                                            "micro_batch_size")) if setting["compile"] else None
        if (held["model"] is None or held["fused"] != setting["fused_cross_entropy"]
                or (held["graph"] and not graph)):
            held.update(model=None)
            torch.cuda.empty_cache()
            torch.compiler.reset()
            model = build()
            apply_settings(model, setting)
            held.update(model=model, fused=setting["fused_cross_entropy"], graph=graph)
            return model
        model = held["model"]
        switch_settings(model, setting)
        if graph and held["graph"] is None:
            compile_regions(model)
        elif graph and held["graph"] != graph:
            torch.compiler.reset()
        held["graph"] = graph
        return model

    def steps(model, optimizer, batch, sliced: bool = False) -> dict:
        """Timed steps after a warm-up (which compiles and makes the optimizer's state): the median
        step and, for a slice, what its timed steps held over what was held before them (weights,
        optimizer state): its activations. In a slice's timed steps each gradient is dropped as it
        lands, as FSDP2 reduce-scatters a layer's gradients and frees them (sharded_estimate
        counts the kept shards and the one layer in flight), so the optimizer has nothing to step:
        a sharded process's step over its shard is small beside the layers'."""
        times, before, hooks = [], 0, []
        for step in range(1 + TIMED_STEPS):
            if step == 1 and sliced:
                hooks = [p.register_post_accumulate_grad_hook(lambda p: setattr(p, "grad", None))
                         for p in model.parameters() if p.requires_grad]
                torch.cuda.reset_peak_memory_stats()
                before = torch.cuda.memory_allocated()
            torch.cuda.synchronize()
            start = time.perf_counter()
            with torch.autocast("cuda", dtype=torch.bfloat16):  # as the Trainer runs bf16
                loss = model(**batch).loss
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            torch.cuda.synchronize()
            times.append(time.perf_counter() - start)
        for hook in hooks:
            hook.remove()
        return {"step_seconds": statistics.median(times[1:]), "tokens": batch["input_ids"].numel(),
                "activation_bytes": torch.cuda.max_memory_allocated() - before}

    def sliced(model, optimizer, batch) -> dict:
        """sharded_estimate of the slices: the model's first DEPTHS[0] layers, then all of them."""
        counts = parameter_counts(model, decoder_layers(model)[0])
        found = []
        for depth in DEPTHS:
            with first_layers(model, depth):
                found.append(steps(model, optimizer, batch, sliced=True))
        return {**sharded_estimate(*found, layers=layers, shards=shards, counts=counts),
                "slices": [{k: round(v, 4) for k, v in f.items()} for f in found]}

    def measure(setting) -> dict:
        optimizer = None
        began = time.monotonic()
        try:
            model = model_for(setting)
            optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-5, fused=True)
            batch = packed_batch(*batch_shape(recipe, setting["micro_batch_size"]), config.vocab_size)
            with step_context(model, setting):  # as training runs
                if shards > 1:
                    result = sliced(model, optimizer, batch)
                else:
                    figures = steps(model, optimizer, batch)
                    result = {"tokens_per_s": round(figures["tokens"] / figures["step_seconds"], 1),
                              "peak_bytes": torch.cuda.max_memory_allocated(),
                              "resident_bytes": torch.cuda.memory_allocated(),  # weights, optimizer state
                              "step_seconds": round(figures["step_seconds"], 4)}
        except Exception as e:  # OOM, a backend that cannot run these shapes: recorded, the search goes on
            result = {"error": f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"}
            if held["model"] is not None:
                held["model"].zero_grad(set_to_none=True)
        del optimizer
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        result["seconds"] = round(time.monotonic() - began, 1)  # what it cost: building, compiling, steps
        log.info("probe %s -> %s", setting, result)
        return result

    rows, length = batch_shape(recipe, 1)
    found = search(measure, attention_candidates({"hip": torch.version.hip}), batch, rows * length, deadline, total)
    held.update(model=None)
    weights.cleanup()
    torch.cuda.empty_cache()
    torch.compiler.reset()
    return found
