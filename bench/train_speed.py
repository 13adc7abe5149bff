"""Training throughput on one GPU, one run, same documents: TRL's reference configurations
(its defaults, and the faster settings a TRL user can turn on) beside ours (the checkpoint
stage's trainer with the plan probe's decisions).

Workload: a Qwen3-8B-shaped model, random init with a fixed seed, LoRA r=16 alpha=32 on all
linear layers, bf16; real text with a real long tail: the first DOCS chat rows of
bench/data_prep.py's real corpus (real prompts of ../shared/datasets, real answers and
excerpts of real Python source, 1-3 turns), or of --rows FILE (chat JSONL), rendered with
Qwen3's chat template and tokenized by Qwen3's real tokenizer (../shared/tokenizers/qwen3, or
--tokenizer DIR) through the shards stage's own encoder, loss on the assistant turns, cut at
MAX_LENGTH. The rows' BLAKE3 and their token lengths are recorded with the results.

  trl_default   padded batches of 4, sdpa, gradient checkpointing (TRL's defaults)
  trl_packed    BFD packing + padding-free + Liger, 4 x 2048 per step
  trl_flex      BFD packing + flex_attention + Liger, 4 x 2048 per step
  trl_flex_nogc the same without gradient checkpointing (TRL's default is on)
  trl_flex_nogc_compile  and with the Trainer's torch_compile (the whole model)
  (a TRL configuration out of memory on this GPU is recorded as such; best TRL is the fastest
  that ran)
  ours          our BFD packing (stages/shards.pack), the plan probe's decisions
                (stages/train/autotune.probe, with qwen3_8b's budget), 4 x 2048 per step
  ours_safe     our packing with the safe settings (efficient SDPA, full checkpointing,
                no compile): the same batches as ours, for the loss check

Real tokens/s counts non-pad tokens of the timed steps (steps after WARMUP, so compilation
is not timed), timed as one window (meter says why). MFU: model FLOPs per token, 4N for LoRA
(bench/autotune_probe.flops_per_token says which terms count), over the bf16 matmul peak
measured on this GPU in this run. Ours runs the LM
head only on tokens that have a target, where MFU counts it for every token: ours's mfu_work_done
discounts the head's FLOPs it skips (TRL computes the logits of every token).
Loss check: ours vs ours_safe on the first 20 steps (same batches), max |difference|.
Each configuration runs in a fresh process (run_one says why), with the run's own cold
compile caches; the table comes at the end. With --gpus 0,1 configurations run two at a time,
one per GPU of the host (each still measures one GPU; they share the host's CPUs), so a run
takes about half as long.

    python -m bench.train_speed [out.json] [--work DIR] [--gpus 0,1] [--rows FILE] [--tokenizer DIR] [--trl NAMES]

--trl trl_flex_nogc_compile: of TRL's configurations only those named (a shorter run when device
time is short; its ratio is against the best of those, recorded as trl_run).

--tiny: the tiny recipe's model on the CPU in fp32, data/tiny's chat rows with its character
tokenizer, 4 steps of 4 x 256 tokens; ours's decisions from bench/tiny.probe (the CUDA-only
probe's search on the CPU); the TRL configurations without flex attention or Liger, which need
a GPU (a smoke test, not a measurement).
"""
from __future__ import annotations

import gc
import json
import logging
import sys
import tempfile
import time
from pathlib import Path

from bench import tiny
from bench.autotune_probe import (SHAPES, flops_per_token, lm_head_share, matmul_peak_tflops, one_gpu,
                                  recipe_probe_budget)

one_gpu()

REPO = Path(__file__).resolve().parent.parent
STEPS, WARMUP, LOSS_STEPS = 30, 10, 20
PROBE_BUDGET = recipe_probe_budget()
MAX_LENGTH, BATCH = 2048, 4
DOCS = STEPS * BATCH * 12  # conversations read: more than the packed steps take
DEVICE, DTYPE, SHAPE, LIGER = "cuda", "bfloat16", SHAPES["qwen3-8b"], True
SAFE_SDPA = "efficient_attention"  # the loss check's reference kernel
TRL = ("trl_default", "trl_packed", "trl_flex", "trl_flex_nogc", "trl_flex_nogc_compile")


def use_tiny() -> None:
    """--tiny (the docstring says what it runs): set before anything is built, in every process."""
    global STEPS, WARMUP, LOSS_STEPS, PROBE_BUDGET, MAX_LENGTH, DOCS, DEVICE, DTYPE, SHAPE, LIGER, SAFE_SDPA, TRL
    STEPS, WARMUP, LOSS_STEPS, PROBE_BUDGET, MAX_LENGTH = 4, 1, 3, tiny.BUDGET, 256
    DOCS = STEPS * BATCH * 12
    DEVICE, DTYPE, SHAPE, LIGER, SAFE_SDPA = "cpu", "float32", tiny.SHAPE, False, "math"
    TRL = ("trl_default", "trl_packed")


def sync() -> None:
    import torch

    if DEVICE == "cuda":
        torch.cuda.synchronize()


def reset_peak() -> None:
    import torch

    if DEVICE == "cuda":
        torch.cuda.reset_peak_memory_stats()


def peak_gib() -> float:
    """torch's peak allocation on the GPU (on the CPU, for --tiny, the process's peak RSS)."""
    import torch

    return round((torch.cuda.max_memory_allocated() if DEVICE == "cuda" else tiny.peak_bytes()) / 2**30, 1)


def host() -> dict:
    """The machine the figures came from: TRL's step has differed by 9% between two H100s of one kind
    while ours moved by 1% (bench/results/train_speed_h100_2026-12-07_one_machine/), so each run
    records its GPU and its host's CPU."""
    import platform

    import torch

    from stages.engine.preload import usable_cpus

    info = Path("/proc/cpuinfo")
    models = [line.split(":", 1)[1].strip() for line in (info.read_text().splitlines() if info.exists() else [])
              if line.startswith("model name")]
    return {"gpu": torch.cuda.get_device_name(0) if DEVICE == "cuda" else None,
            "cpu": models[0] if models else platform.processor(),
            "cpus": usable_cpus()}


def free_memory() -> None:
    import torch

    gc.collect()
    if DEVICE == "cuda":
        torch.cuda.empty_cache()


def documents(work: Path, tok) -> list[dict]:
    """The workload's conversations as ids and loss masks. A conversation holding the pad id (a
    literal <|endoftext|> in the source text) is left out: real tokens are counted as non-pad."""
    import numpy as np

    from stages.data.rows import Refused
    from stages.data.template import encode_chats

    with open(work / "rows.jsonl", encoding="utf-8") as f:
        chats = [json.loads(line)["messages"] for line, _ in zip(f, range(DOCS))]
    docs = []
    for encoded in encode_chats(tok, chats):
        if isinstance(encoded, Refused):
            raise SystemExit(f"{work / 'rows.jsonl'}: the chat template refused a row: {encoded}")
        ids, mask = (np.asarray(a)[:MAX_LENGTH].tolist() for a in encoded)
        if tok.pad_token_id not in ids:
            docs.append({"input_ids": ids, "completion_mask": [int(m) for m in mask]})
    return docs


def tokenizer(work: Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(json.loads((work / "workload.json").read_text())["tokenizer"])


def workload(work: Path, rows: Path | None, tokenizer_dir: Path) -> dict:
    """The rows every configuration reads (work/rows.jsonl: --rows, or data_prep's real corpus
    made here), and what they are: digest, documents, token lengths."""
    import shutil

    import numpy as np
    from blake3 import blake3

    from bench.data_prep import make_real_rows

    if not (tokenizer_dir / "tokenizer.json").is_file():
        raise SystemExit(f"{tokenizer_dir}: no tokenizer.json; pass --tokenizer DIR (Qwen3's tokenizer)")
    target = work / "rows.jsonl"
    if not target.exists():
        if rows:
            shutil.copyfile(rows, target)
        elif (REPO.parent / "shared" / "datasets").is_dir():
            make_real_rows(target, DOCS)
        else:
            raise SystemExit(f"{REPO.parent / 'shared' / 'datasets'}: not here; the real corpus is made from it. "
                             "Pass --rows FILE (chat JSONL) instead")
    (work / "workload.json").write_text(json.dumps({"tokenizer": str(tokenizer_dir.resolve()),
                                                    "tiny": DEVICE == "cpu"}))
    docs = documents(work, tokenizer(work))
    lengths = np.array([len(d["input_ids"]) for d in docs])
    return {"rows": str(rows or "bench/data_prep.py real corpus"), "rows_blake3": blake3(target.read_bytes()).hexdigest(),
            "tokenizer": str(tokenizer_dir), "documents": len(lengths), "tokens": int(lengths.sum()),
            "completion_tokens": sum(sum(d["completion_mask"]) for d in docs),
            "length_median": int(np.median(lengths)), "length_p90": int(np.percentile(lengths, 90)),
            "at_max_length": int((lengths == MAX_LENGTH).sum())}


def packed_rows(docs: list[dict], pad_id: int) -> dict:
    """Our shards' layout: BFD bins of MAX_LENGTH, labels only on completions, positions restart."""
    from stages.data.packed import IGNORE
    from stages.data.shard_writer import pack

    rows = {"input_ids": [], "labels": [], "position_ids": []}
    for members in pack([len(d["input_ids"]) for d in docs], MAX_LENGTH):
        ids, labels, pos = [], [], []
        for i in members:
            d = docs[i]
            ids += d["input_ids"]
            labels += [t if m else IGNORE for t, m in zip(d["input_ids"], d["completion_mask"])]
            pos += list(range(len(d["input_ids"])))
        pad = MAX_LENGTH - len(ids)
        rows["input_ids"].append(ids + [pad_id] * pad)
        rows["labels"].append(labels + [IGNORE] * pad)
        rows["position_ids"].append(pos + list(range(pad)))
    return rows


def new_model(attn: str, dtype: str | None = None):
    import torch
    from transformers import AutoModelForCausalLM, Qwen3Config

    torch.manual_seed(0)
    with torch.device(DEVICE):
        model = AutoModelForCausalLM.from_config(Qwen3Config(**SHAPE), dtype=getattr(torch, dtype or DTYPE),
                                                 attn_implementation=attn)
    model.config.use_cache = False
    return model


def meter(window: list[float]):
    """The wall time of the steps after WARMUP as one window, the GPU drained only at its two
    ends: what a run gets, the host's work between steps (fetching, collating, launching the
    next) counted where the GPU waits for it, for TRL's configurations and ours alike. A sync
    at every step's ends would drain the GPU each step and time a run that no longer overlaps
    the host's work with the GPU's (stages/train/trainer.StepRecords)."""
    from transformers import TrainerCallback

    class Meter(TrainerCallback):
        def on_step_begin(self, args, state, control, **kwargs):
            if state.global_step == WARMUP:
                sync()
                self.start = time.perf_counter()

        def on_step_end(self, args, state, control, **kwargs):
            if state.global_step == STEPS:
                sync()
                window.append(time.perf_counter() - self.start)

    return Meter()


def counting(collator, counts: list[int], pad_id: int):
    """The trainer's own collator, counting the real tokens of each batch (documents never
    hold the pad id, so whatever the layout, padded or packed, real = not pad)."""
    def collate(examples):
        batch = collator(examples)
        counts.append(int((batch["input_ids"] != pad_id).sum()))
        return batch
    return collate


def finish(name: str, trainer, counts, window, accum: int = 1) -> dict:
    trainer.train()
    # ours: each step's loss (StepRecords); TRL's: its log's mean over each LOG_EVERY steps
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    tokens = sum(counts[WARMUP * accum: STEPS * accum])  # one count per micro-batch
    seconds = window[0]
    result = {"tokens_per_s": round(tokens / seconds, 1), "peak_gib": peak_gib(),
              "step_seconds": round(seconds / (STEPS - WARMUP), 4), "losses": losses[:LOSS_STEPS]}
    logging.info("%s: %s", name, result)
    return result


def run_trl(name: str, docs, tok, attn: str, work: Path, **overrides) -> dict:
    import torch
    from datasets import Dataset
    from peft import LoraConfig
    from trl import SFTConfig, SFTTrainer

    from stages.train.trainer import LOG_EVERY  # TRL's default too: its log reads the loss, a host sync

    reset_peak()
    model = new_model(attn)
    args = SFTConfig(output_dir=str(work / name), max_steps=STEPS, per_device_train_batch_size=BATCH,
                     max_length=MAX_LENGTH, bf16=DTYPE == "bfloat16", use_cpu=DEVICE == "cpu", learning_rate=1e-4,
                     logging_steps=LOG_EVERY, report_to="none", save_strategy="no", seed=0, data_seed=0,
                     dataloader_num_workers=0, accelerator_config={"non_blocking": DEVICE != "cpu"}, **overrides)
    trainer = SFTTrainer(model=model, args=args, train_dataset=Dataset.from_list(docs), processing_class=tok,
                         peft_config=LoraConfig(r=16, lora_alpha=32, target_modules="all-linear",
                                                task_type="CAUSAL_LM"))
    counts, window = [], []
    trainer.data_collator = counting(trainer.data_collator, counts, tok.pad_token_id)
    trainer.add_callback(meter(window))
    try:
        result = finish(name, trainer, counts, window)
    except torch.OutOfMemoryError:  # a micro-batch too large for this setting: recorded, not a failed run
        result = {"error": "out of memory"}
    del trainer, model
    free_memory()
    return result


def safe(decisions: dict) -> dict:
    """The same micro-batch with the safe settings: the loss check's reference."""
    return {**decisions, "attn_implementation": "sdpa", "sdpa_backend": SAFE_SDPA,
            "gradient_checkpointing": "full", "compile": False, "fused_cross_entropy": False}


def loss_distance(a: list[float], b: list[float]) -> float:
    """The loss check's measure: the largest step-by-step difference of two loss curves."""
    return max(abs(x - y) for x, y in zip(a, b))


def run_ours(name: str, rows: dict, tok, decisions: dict, work: Path, dtype: str | None = None) -> dict:
    import torch
    from datasets import Dataset

    from stages.model import numerics
    from stages.train import settings
    from stages.train.settings import training_context
    from stages.train.methods import METHODS
    from stages.train.sft import make_trainer
    from stages.train.trainer import StepRecords
    from stages.engine.recipe import TrainSection

    reset_peak()
    dtype = dtype or DTYPE
    numerics.training_mode()
    model = new_model("sdpa", dtype)
    settings.apply_settings(model, decisions)
    t = TrainSection(peft="lora", lora={"r": 16, "alpha": 32, "target_modules": "all-linear"}, lr=1e-4,
                     max_steps=STEPS, micro_batch_size=BATCH, save_steps=10**6)
    plan = {**decisions, "device": DEVICE, "dtype": dtype, "processes": 1, "grad_accum": BATCH // decisions["micro_batch_size"]}
    trainer = make_trainer(METHODS["sft"], model, Dataset.from_dict(rows), tok, plan, t, work / name)
    StepRecords(trainer)  # each step's loss in the log history, as the checkpoint stage keeps them
    counts, window = [], []
    trainer.data_collator = counting(trainer.data_collator, counts, tok.pad_token_id)
    trainer.add_callback(meter(window))
    with training_context(trainer, plan):
        result = finish(name, trainer, counts, window, plan["grad_accum"])
    del trainer, model
    free_memory()
    torch.compiler.reset()
    return result


def run_one(name: str, work: Path) -> dict:
    """One configuration, in a process of its own: Liger patches transformers' Qwen3 classes
    for the whole process and training_mode() makes torch deterministic for the whole
    process, so neither may leak into the runs after it."""
    from stages.train import autotune
    from stages.engine.recipe import Recipe
    from transformers import Qwen3Config

    tok = tokenizer(work)
    docs = documents(work, tok)
    if name == "trl_default":
        return run_trl(name, docs, tok, "sdpa", work)
    if name == "trl_packed":
        return run_trl(name, docs, tok, "sdpa", work, packing=True, padding_free=True, use_liger_kernel=LIGER)
    if name == "trl_flex":
        return run_trl(name, docs, tok, "flex_attention", work, packing=True, use_liger_kernel=LIGER)
    if name.startswith("trl_flex_nogc"):  # what a TRL user with memory to spare turns off, and on
        return run_trl(name, docs, tok, "flex_attention", work, packing=True, use_liger_kernel=LIGER,
                       gradient_checkpointing=False, torch_compile=name.endswith("compile"))
    rows = packed_rows(docs, tok.pad_token_id)
    if name == "ours_safe":  # the probe's micro-batch with the safe settings
        found = json.loads((work / "ours.json").read_text())["found"]
        return run_ours(name, rows, tok, safe(found["decisions"]), work)
    config_dir = work / "config"
    Qwen3Config(**SHAPE).save_pretrained(config_dir)
    recipe = Recipe.model_validate({
        "model": {"path": "unused"},  # (the probe reads config_dir)
        "data": {"sources": [{"path": "unused.jsonl"}], "max_length": MAX_LENGTH},
        "train": {"peft": "lora", "lora": {"r": 16, "alpha": 32}, "micro_batch_size": BATCH},
        "hardware": {"profile": "h100"}, "autotune": {"budget_seconds": PROBE_BUDGET}})
    start = time.perf_counter()
    probe = autotune.probe if DEVICE == "cuda" else tiny.probe
    found = probe(config_dir, recipe, logging.getLogger("probe"), recipe.train.global_batch)
    found = {"decisions": found["decisions"], "probe_seconds": round(time.perf_counter() - start, 1)}
    return {**run_ours(name, rows, tok, found["decisions"], work), "found": found}


def run_configs(work: Path, gpus: list[str]) -> dict:
    """Every configuration in a child process of its own, one at a time on each GPU: the first
    runs ours then ours_safe (which reuses ours's decisions), then joins the others in taking
    TRL's configurations, slowest to compile first. A configuration already in `work` is kept."""
    import os
    import subprocess
    from concurrent.futures import ThreadPoolExecutor
    from queue import Empty, SimpleQueue

    trl = SimpleQueue()
    for name in reversed(TRL):
        trl.put(name)

    def lane(gpu: str, first: bool) -> None:
        names = ["ours", "ours_safe"] if first else []
        while True:
            if not names:
                try:
                    names = [trl.get_nowait()]
                except Empty:
                    return
            name = names.pop(0)
            if not (work / f"{name}.json").exists():
                subprocess.run([sys.executable, "-m", "bench.train_speed", "--one", name, str(work)], check=True,
                               env={**os.environ, "CUDA_VISIBLE_DEVICES": gpu})
            logging.info("%s done on GPU %s", name, gpu)

    with ThreadPoolExecutor(len(gpus)) as pool:
        for lane_done in [pool.submit(lane, gpu, i == 0) for i, gpu in enumerate(gpus)]:
            lane_done.result()  # a child that failed fails the run
    return {name: json.loads((work / f"{name}.json").read_text()) for name in ("ours", "ours_safe", *TRL)}


def main() -> None:
    global TRL
    import argparse
    import os

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    if len(sys.argv) > 2 and sys.argv[1] == "--one":  # a child: one configuration
        name, work = sys.argv[2], Path(sys.argv[3])
        if json.loads((work / "workload.json").read_text()).get("tiny"):
            use_tiny()
        (work / f"{name}.json").write_text(json.dumps(run_one(name, work)))
        return
    ap = argparse.ArgumentParser(description="TRL's configurations and ours, one GPU each")
    ap.add_argument("out", nargs="?", type=Path, help="default bench/results/train_speed.json")
    ap.add_argument("--work", type=Path, help="a run cut short (a time limit) goes on where it stopped: "
                    "its work directory again, same machine")
    ap.add_argument("--gpus", default=os.environ.get("CUDA_VISIBLE_DEVICES", "0"),
                    help="GPUs of this host to run configurations on, one per GPU at a time (e.g. 0,1; "
                         "default CUDA_VISIBLE_DEVICES, else 0)")
    ap.add_argument("--rows", type=Path, help="chat JSONL ({\"messages\": [...]} per line) instead of "
                    "bench/data_prep.py's real corpus (which reads ../shared/datasets)")
    ap.add_argument("--tokenizer", type=Path, default=REPO.parent / "shared" / "tokenizers" / "qwen3")
    ap.add_argument("--trl", help="only these of TRL's configurations (comma-separated; default all): a "
                    "shorter run, whose 'best TRL' is the best of these")
    ap.add_argument("--tiny", action="store_true", help="the tiny model on the CPU: a smoke test, not a measurement")
    args = ap.parse_args()
    work = args.work or Path(tempfile.mkdtemp())
    work.mkdir(parents=True, exist_ok=True)
    if args.tiny:
        use_tiny()
        args.rows, args.tokenizer = args.rows or tiny.CHAT, tiny.tokenizer_dir(work)
    if args.trl:
        named = args.trl.split(",")
        unknown = set(named) - set(TRL)
        if unknown:
            ap.error(f"--trl: no TRL configuration {', '.join(sorted(unknown))} here (there are {', '.join(TRL)})")
        TRL = tuple(name for name in TRL if name in named)
    args.out = args.out or (tiny.results_path("train_speed.json") if args.tiny else
                            REPO / "bench" / "results" / "train_speed.json")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    # each run compiles cold, as on a fresh machine (a later run would otherwise reuse the kernels
    # an earlier one compiled, and the probe, on a time budget, would reach further)
    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(work / "inductor"))
    os.environ.setdefault("TRITON_CACHE_DIR", str(work / "triton"))
    logging.info("work directory %s", work)
    data = workload(work, args.rows, args.tokenizer)
    logging.info("workload %s", data)
    results = run_configs(work, args.gpus.split(","))
    found = results["ours"].pop("found")
    peak = matmul_peak_tflops(DEVICE)
    flops = flops_per_token(SHAPE, "lora")
    ran = [name for name in TRL if "error" not in results[name]]
    best_trl = max(ran, key=lambda k: results[k]["tokens_per_s"])
    print(f"\nQwen3-8B shape, LoRA r16, seq {MAX_LENGTH}, batch {BATCH}, {STEPS} steps ({WARMUP} untimed); "
          f"MFU: {flops / 1e9:.1f} GFLOP/token over the measured bf16 matmul peak, {peak:.0f} TFLOP/s")
    print(f"workload: {data['documents']} real conversations, Qwen3's tokenizer, median {data['length_median']} "
          f"tokens, p90 {data['length_p90']}, {data['at_max_length']} cut at {MAX_LENGTH} (rows {data['rows_blake3'][:12]})")
    print(f"{'':21} {'tokens/s':>9} {'MFU':>6} {'peak GiB':>9} {'vs best TRL':>12}")
    for name in (*TRL, "ours", "ours_safe"):
        r = results[name]
        if "error" in r:
            print(f"{name:21} {r['error']}")
            continue
        r["mfu"] = round(r["tokens_per_s"] * flops / (peak * 1e12), 4)
        r["vs_best_trl"] = round(r["tokens_per_s"] / results[best_trl]["tokens_per_s"], 3)  # 1.2987 is not 1.3
        print(f"{name:21} {r['tokens_per_s']:>9.0f} {r['mfu']:>6.1%} {r['peak_gib']:>9.1f} {r['vs_best_trl']:>11.3f}x")
    if "error" not in results["ours"]:
        # ours runs the LM head only where a token has a target (sft.TargetRowsHead), MFU counts it for every
        # token; the workload's share of such tokens stands for the timed steps'
        targets = data["completion_tokens"] / data["tokens"]
        skipped = (1 - targets) * lm_head_share(SHAPE)
        results["ours"]["mfu_work_done"] = round(results["ours"]["mfu"] * (1 - skipped), 4)
        print(f"ours runs the LM head on the {targets:.0%} of tokens that have a "
              f"target: {skipped:.1%} of the FLOPs MFU counts are not done, {results['ours']['mfu_work_done']:.1%} "
              "on the work done")
    diff = loss_distance(results["ours"]["losses"], results["ours_safe"]["losses"])
    print(f"ours decisions: {found['decisions']} (probe {found['probe_seconds']:.0f} s)")
    print(f"loss check, first {LOSS_STEPS} steps, ours vs ours_safe (same batches): max |diff| {diff:.4f} "
          f"({'within' if diff <= 0.05 else 'OUTSIDE'} bf16 tolerance 0.05); "
          f"ours {results['ours']['losses'][0]:.3f} -> {results['ours']['losses'][-1]:.3f}")
    args.out.write_text(json.dumps({"shape": SHAPE, "max_length": MAX_LENGTH, "batch": BATCH, "steps": STEPS,
                                    "warmup": WARMUP, "workload": data, "host": host(), "gpus": args.gpus,
                                    "trl_run": list(TRL),
                                    "flops_per_token": flops,
                                    "matmul_peak_tflops": round(peak, 1), "best_trl": best_trl,
                                    "ours_decisions": found["decisions"], "probe_seconds": found["probe_seconds"],
                                    "loss_max_abs_diff": diff, "results": results}, indent=1) + "\n")


if __name__ == "__main__":
    main()
