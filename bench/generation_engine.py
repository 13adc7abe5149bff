"""The generation engine called directly (no HTTP), on Qwen3-8B's shape in bf16 with random
weights and real questions through Qwen3's tokenizer: where a decode step's time goes and what
the engine's settings change. Written for one lent GPU; results under $OUT (default /tmp).

  --profile   the serving engine (per-request settings) at 1, 8 and 32 prompts, 128 new tokens,
              twice each; a torch profile of 8 at once (64 new tokens) by CPU and CUDA time;
              then transformers' `generate` with a static cache (compiled, CUDA graphs) at 1 and
              8 prompts, three times each (the first includes the compile)
  --variants  per-request settings, one setting for the batch (sampling=(1, 1): no logits
              processors), the same with transformers' compile level 1, per-request settings
              with compile level 1 (it fails: inductor and the top-p sampler), and per-request
              settings with the model's forward alone compiled (torch.compile, dynamic shapes; the
              logits processors stay eager inside transformers' CUDA graph: on the CPU, tiny,
              its greedy answers equal the eager engine's); 1, 8 and 32 prompts, 128 new tokens,
              twice each, and the greedy tokens of 4 prompts beside the uncompiled engine's

  --static    at 32 and 1 at once: transformers' `generate` with a static cache (compiled, CUDA
              graphs) on one padded batch, greedy, beside the engine with one sampling setting
              and compile level 1 (sampled at temperature 1); 128 new tokens, three and two runs

  --attention the engine's attention (stages/inference/attention.py) beside transformers' SDPA,
              alternating: the serving engine at 1, 8, 32 and 128 prompts (128 new tokens, a warm-up
              then two timed runs each), the same with the model's forward compiled (ours only:
              transformers' recompiles per layer, docs/serving.md), GRPO's engine (one sampling
              setting, compile level 1) at 1 and 32; a profile of 32 at once by CUDA time each way;
              the greedy tokens of 4 prompts each way

  --rollouts  GRPO's rollouts as the checkpoint stage samples them (stages/train/grpo.EngineRollouts):
              the model with LoRA r16 on every linear layer, 8 completions of 256 tokens at
              temperature 1, sampled through the adapter's side matmuls and with the adapter merged
              into the base (grpo.merged); a first rollout (the engine's compile and CUDA graphs),
              then three timed, each way

docs/serving.md reads bench/results/generation_engine_{profile,variants}_h200_2026-11-26.json.

    python -m bench.generation_engine --profile --shared ../shared
"""
from __future__ import annotations

import argparse
import json
import os
import time
import traceback
from pathlib import Path

from bench.generation_speed import QWEN3_8B, SHARED, common_prefix, make_model, real_questions, served_prompt


def rate(eng, prompts, new: int, temp: float) -> float:
    """Completion tokens per second of the engine answering all `prompts` at once."""
    import torch

    from stages.inference.batching import Sampling

    torch.cuda.synchronize()
    t = time.perf_counter()
    answers = eng.generate(prompts, Sampling(new, temperature=temp))
    torch.cuda.synchronize()
    return sum(len(x.ids) for x in answers) / (time.perf_counter() - t)


def profile(model, tok, prompts, eos, out: Path) -> dict:
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    from stages.inference.batching import Engine

    res = {}
    eng = Engine(model, tok, eos, 64 * 1024)

    def run(n, new=128, temp=0.0):
        return rate(eng, prompts[:n], new, temp)
    for n in (1, 8, 32):
        run(n, 16)
        res[f"engine_{n}"] = [run(n), run(n)]
        print(n, res[f"engine_{n}"], flush=True)
    res["engine_8_sampled"] = run(8, temp=1.0)
    with torch_profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        run(8, 64)
    (out / "engine8_cpu.txt").write_text(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=40))
    (out / "engine8_cuda.txt").write_text(prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=30))
    eng.close()
    for n in (1, 8):
        res[f"static_generate_{n}"] = static_generate_rates(model, tok, prompts[:n])
    return res


def static_generate_rates(model, tok, prompts, runs: int = 3) -> list[float]:
    """Tokens per second of transformers' generate with a static cache (its decode step compiled,
    CUDA graphs) on `prompts` as one left-padded batch, greedy, 128 new tokens each, `runs` times
    (the first includes the compile)."""
    import torch

    tok.padding_side = "left"
    batch = tok.pad({"input_ids": prompts}, return_tensors="pt").to("cuda")
    rates = []
    for _ in range(runs):
        torch.cuda.synchronize()
        t = time.perf_counter()
        model.generate(**batch, max_new_tokens=128, min_new_tokens=128, do_sample=False, cache_implementation="static")
        torch.cuda.synchronize()
        rates.append(len(prompts) * 128 / (time.perf_counter() - t))
    return rates


def variants(model, tok, prompts, eos, out: Path) -> dict:
    import torch

    from stages.inference.batching import Engine, Sampling

    res = {}

    def measure(name, eng, n, temp):
        t = time.perf_counter()
        rate(eng, prompts[:n], 16, temp)
        first = time.perf_counter() - t
        res[name] = {"first_s": round(first, 1), "tok_s": [round(rate(eng, prompts[:n], 128, temp)) for _ in range(2)]}
        print(name, res[name], flush=True)
    greedy = {}
    for name, opts, sampling in (("perreq", {}, None), ("fixed", {}, (1.0, 1.0)),
                                 ("fixed_c1", {"default_compile_level": 1}, (1.0, 1.0)),
                                 ("perreq_c1", {"default_compile_level": 1}, None),
                                 ("perreq_forward_compiled", {}, None)):
        try:
            if name == "perreq_forward_compiled":
                model.forward = torch.compile(model.forward, dynamic=True)
            eng = Engine(model, tok, eos, 64 * 1024, opts, sampling=sampling)
            try:
                for n, temp in ((1, 0.0 if sampling is None else 1.0), (8, 1.0), (32, 1.0)):
                    measure(f"{name}_{n}", eng, n, temp)
                if sampling is None:
                    greedy[name] = [a.ids for a in eng.generate(prompts[:4], Sampling(64))]
            finally:
                eng.close()
        except Exception as e:  # a setting that fails is a result
            res[name] = {"error": repr(e)[:500]}
            traceback.print_exc()
        finally:
            vars(model).pop("forward", None)  # the class's forward again
        torch.cuda.empty_cache()
    if "perreq" in greedy and "perreq_forward_compiled" in greedy:  # tokens equal up to where bf16 sums differ
        res["perreq_forward_compiled_greedy_common_prefix"] = [
            common_prefix(a, b) for a, b in zip(greedy["perreq"], greedy["perreq_forward_compiled"])]
    return res


def attention(model, tok, prompts, eos, out: Path) -> dict:
    import torch
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile
    from transformers import AttentionInterface
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    from stages.inference import attention as ours
    from stages.inference.batching import Engine, Sampling

    res, greedy = {}, {}

    def use(which):
        AttentionInterface.register("sdpa", ours.sdpa if which == "ours" else sdpa_attention_forward)

    def keep(name, value):
        res[name] = value
        (out / "attention.json").write_text(json.dumps(res, indent=1))
        print(name, value, flush=True)

    def measure(name, which, levels, opts=None, sampling=None, compiled=False, prof=False):
        if compiled:
            model.forward = torch.compile(model.forward, dynamic=True)
        temp = 0.0 if sampling is None else 1.0
        eng = Engine(model, tok, eos, 64 * 1024, opts, sampling=sampling)
        use(which)  # after the Engine, which installs ours; each forward looks its attention up anew
        try:
            for n in levels:
                t = time.perf_counter()
                rate(eng, prompts[:n], 16, temp)
                keep(f"{name}_{n}", {"first_s": round(time.perf_counter() - t, 1),
                                     "tok_s": [round(rate(eng, prompts[:n], 128, temp), 1) for _ in range(2)]})
            if sampling is None:
                greedy[name] = [a.ids for a in eng.generate(prompts[:4], Sampling(64))]
            if prof:
                with torch_profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as p:
                    rate(eng, prompts[:32], 32, temp)
                (out / f"{name}_32_cuda.txt").write_text(p.key_averages().table(sort_by="self_cuda_time_total",
                                                                                row_limit=25))
        finally:
            eng.close()
            vars(model).pop("forward", None)
            torch.compiler.reset()  # each setting compiles from nothing, as a fresh server would
            torch.cuda.empty_cache()
    for which in ("transformers", "ours"):
        measure(f"serving_{which}", which, (1, 8, 32, 128), prof=True)
    measure("serving_ours_forward_compiled", "ours", (1, 8, 32, 128), compiled=True)
    for which in ("transformers", "ours"):
        measure(f"grpo_{which}", which, (1, 32), {"default_compile_level": 1}, sampling=(1.0, 1.0))
    for name in ("serving_ours", "serving_ours_forward_compiled"):
        if name in greedy and "serving_transformers" in greedy:
            res[f"{name}_greedy_common_prefix"] = [common_prefix(a, b) for a, b in
                                                   zip(greedy["serving_transformers"], greedy[name])]
    keep("gpu", torch.cuda.get_device_name())
    return res


def rollouts(model, tok, prompts, eos, out: Path) -> dict:
    import statistics
    from types import SimpleNamespace

    import torch
    from peft import LoraConfig, get_peft_model

    from stages.train import grpo

    lora = get_peft_model(model, LoraConfig(r=16, lora_alpha=32, target_modules="all-linear"))
    for name, p in lora.named_parameters():
        if "lora_B" in name:  # PEFT starts B at zero, where merging would change nothing
            torch.nn.init.normal_(p, std=1e-3)
    lora.eval()
    texts = [tok.decode(p) for p in prompts[:8]]
    new = 256
    kv = grpo.rollout_kv_tokens(8, max(map(len, prompts[:8])) + new)
    trainer = SimpleNamespace(model=lora, top_k=0, min_p=None, repetition_penalty=1.0, temperature=1.0, top_p=1.0,
                              eos_token_ids=list(eos), max_completion_length=new)
    plan = {"device": "cuda", "dtype": "bfloat16", "attn_implementation": "sdpa"}
    res = {"completions": 8, "max_new_tokens": new, "lora": "r16 alpha 32, every linear layer, fp32 adapters"}
    for name, merge in (("through_the_adapter", False), ("merged", True)):
        r = grpo.EngineRollouts(tok, plan, kv)
        if not merge:
            r.base_copy = []
        seconds, tokens = [], []
        try:
            for _ in range(4):
                torch.cuda.synchronize()
                t = time.perf_counter()
                o = r(texts, trainer)
                torch.cuda.synchronize()
                seconds.append(time.perf_counter() - t)
                tokens.append(sum(map(len, o["completion_ids"])))
        finally:
            if r.engine is not None:
                r.engine.close()
        res[name] = {"first_s": round(seconds[0], 1), "seconds": [round(x, 3) for x in seconds[1:]],
                     "tokens": tokens[1:], "tokens_per_s": [round(n / x, 1) for n, x in zip(tokens[1:], seconds[1:])],
                     "base_copy_gib": round(sum(c.numel() * c.element_size() for _, c in r.base_copy) / 2**30, 2)}
        print(name, res[name], flush=True)
        del r
        torch.cuda.empty_cache()
    res["merged_over_adapter_median"] = round(statistics.median(res["merged"]["tokens_per_s"]) /
                                              statistics.median(res["through_the_adapter"]["tokens_per_s"]), 2)
    res["peak_gib"] = round(torch.cuda.max_memory_allocated() / 2**30, 1)
    return res


def static(model, tok, prompts, eos, out: Path) -> dict:
    """32 and 1 at once: transformers' generate with a static cache (its decode step compiled,
    CUDA graphs) on one padded batch, beside the engine with one sampling setting and compile
    level 1 (variants' fastest). Greedy, 128 new tokens, the first run (the compile) apart; the
    results file is rewritten after each measurement, so a run cut short keeps what it measured."""
    from stages.inference.batching import Engine

    res = {"new_tokens": 128}

    def keep(name, value):
        res[name] = value
        (out / "static.json").write_text(json.dumps(res, indent=1))
        print(name, value, flush=True)
    for n in (32, 1):
        runs = [round(r, 1) for r in static_generate_rates(model, tok, prompts[:n])]
        keep(f"static_generate_{n}", {"first_tok_s": runs[0], "tok_s": runs[1:]})
    eng = Engine(model, tok, eos, 64 * 1024, {"default_compile_level": 1}, sampling=(1.0, 1.0))
    try:
        for n in (32, 1):
            t = time.perf_counter()
            rate(eng, prompts[:n], 16, 1.0)
            keep(f"engine_fixed_c1_{n}", {"first_s": round(time.perf_counter() - t, 1),
                                          "tok_s": [round(rate(eng, prompts[:n], 128, 1.0), 1) for _ in range(2)]})
    finally:
        eng.close()
    return res


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--profile", action="store_true")
    ap.add_argument("--variants", action="store_true")
    ap.add_argument("--attention", action="store_true")
    ap.add_argument("--rollouts", action="store_true")
    ap.add_argument("--static", action="store_true")
    ap.add_argument("--shared", type=Path, default=SHARED)
    args = ap.parse_args()
    out = Path(os.environ.get("OUT", "/tmp"))
    model, tok = make_model(QWEN3_8B, "cuda", "bfloat16", args.shared / "tokenizers" / "qwen3")
    prompts = [served_prompt(tok, q) for q in real_questions(args.shared, 64)]
    eos = {tok.convert_tokens_to_ids("<|im_end|>")}
    for flag, fn in (("profile", profile), ("variants", variants), ("attention", attention), ("rollouts", rollouts), ("static", static)):
        if getattr(args, flag):
            (out / f"{flag}.json").write_text(json.dumps(fn(model, tok, prompts, eos, out), indent=1))


if __name__ == "__main__":
    main()
