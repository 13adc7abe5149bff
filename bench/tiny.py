"""What the benches' --tiny smoke modes share: the tiny recipe's model shape, its character
tokenizer and data/tiny, so a smoke run needs neither a GPU nor ../shared. A smoke run goes
through a bench's own code and the project's stages/ functions it measures, in a minute or
two (tests/test_bench.py runs each); its figures measure nothing.

stages/train/autotune.py's probe and packed_batch run on CUDA only. `probe` and `packed_batch`
here are their CPU counterparts: the probe's own search (autotune.search over
autotune.attention_candidates, applying each setting with stages/train/settings.py) timing real
steps on the CPU, and a batch of the same layout left on the CPU."""
from __future__ import annotations

import logging
import os
import resource
import statistics
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
CHAT = REPO / "data" / "tiny" / "chat.jsonl"  # {"messages": [...]} rows
PROMPTS = REPO / "data" / "tiny" / "prompts.jsonl"  # {"question", "answer"} rows, as GSM8K's
# recipes/tiny.yaml's model; the vocabulary is the character tokenizer's 99 tokens padded to 128
SHAPE = dict(hidden_size=64, intermediate_size=192, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, head_dim=16, vocab_size=128)
BUDGET = 5.0  # seconds of probing


def tokenizer_dir(work: Path) -> Path:
    """The tiny model's character tokenizer, saved where a bench loads a tokenizer from."""
    from stages.model.tiny import char_tokenizer

    out = work / "tiny-tokenizer"
    char_tokenizer().save_pretrained(out)
    return out


def results_path(name: str) -> Path:
    """Where a smoke run writes its results unless told: a fresh temporary directory, never
    bench/results/ (which holds measurements)."""
    out = Path(tempfile.mkdtemp(prefix="bench-tiny-")) / name
    logging.getLogger(__name__).warning("--tiny: results in %s", out)
    return out


def peak_bytes() -> int:
    """This process's peak resident memory: the CPU's stand-in for torch.cuda.max_memory_allocated."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def packed_batch(micro_batch: int, length: int, vocab: int, seed: int = 0) -> dict:
    """autotune.packed_batch's layout on the CPU: random ids, documents of an eighth of the
    sequence whose positions restart."""
    import torch

    ids = torch.randint(0, vocab, (micro_batch, length), generator=torch.Generator().manual_seed(seed))
    positions = torch.arange(length).remainder(max(length // 8, 1)).expand(micro_batch, length).clone()
    return {"input_ids": ids, "labels": ids, "position_ids": positions}


def slow_on_cpu(setting: dict) -> str | None:
    """Why the CPU cannot run a setting in seconds, or None where it can."""
    if setting["attn_implementation"] == "flex_attention":
        return "flex attention has no backward pass on the CPU"
    if setting["compile"]:
        return "an inductor compile takes a minute on the CPU"
    return None


def on_cpu(setting: dict) -> dict:
    """A setting as the CPU runs it in seconds: SDPA for flex attention, uncompiled."""
    if setting["attn_implementation"] == "flex_attention":
        setting = {**setting, "attn_implementation": "sdpa", "sdpa_backend": None}
    return {**setting, "compile": False}


def probe(config_dir, recipe, log, batch: int) -> dict:
    """autotune.probe's search on the CPU: each setting applied as training applies it, timed
    over real steps (the median after one warm-up); settings the CPU cannot run in seconds are
    recorded as not measured, as the probe records a candidate that fails."""
    import torch
    from peft import get_peft_model
    from transformers import AutoConfig, AutoModelForCausalLM

    from stages.train import autotune
    from stages.train.methods import METHODS
    from stages.model.numerics import training_mode
    from stages.train.settings import apply_settings, lora_config, step_context

    training_mode()
    config = AutoConfig.from_pretrained(config_dir)
    t = recipe.train
    sequences, length = METHODS[t.method].step_shape(t, recipe.data.max_length)

    def measure(setting: dict) -> dict:
        why = slow_on_cpu(setting)
        if why:
            return {"error": f"not measured in --tiny: {why}"}
        try:
            torch.manual_seed(0)
            model = AutoModelForCausalLM.from_config(config)
            model.config.use_cache = False
            if t.peft != "none":
                model = get_peft_model(model, lora_config(t))
            model.train()
            apply_settings(model, setting)
            optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-5)
            steps = packed_batch(setting["micro_batch_size"] * sequences, length, config.vocab_size)
            times = []
            with step_context(model, setting, bf16=False):  # fp32 on the CPU: no autocast
                for _ in range(1 + autotune.TIMED_STEPS):
                    start = time.perf_counter()
                    model(**steps).loss.backward()
                    optimizer.step()
                    optimizer.zero_grad(set_to_none=True)
                    times.append(time.perf_counter() - start)
            seconds = statistics.median(times[1:])
            result = {"tokens_per_s": round(steps["input_ids"].numel() / seconds, 1), "peak_bytes": peak_bytes(),
                      "step_seconds": round(seconds, 4)}
        except Exception as e:  # a backend the CPU lacks: recorded, the search goes on
            result = {"error": f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"}
        log.info("probe %s -> %s", setting, result)
        return result

    memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return autotune.search(measure, autotune.attention_candidates({"hip": None}), batch, sequences * length,
                           time.monotonic() + recipe.autotune.budget_seconds, memory)
