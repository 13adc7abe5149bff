"""Training throughput on 1, 2 and 4 GPUs of one host: the real checkpoint stage (doit ->
torchrun -> DDP or FSDP2, as the plan splits the model) beside TRL's SFTTrainer under
accelerate's FSDP2, on the same base, rows and GPUs, one run after the other.

Workloads (Qwen3 shapes, random weights from the base stage, bf16, sequences of 2048):
  8b_lora    Qwen3-8B shape, LoRA r16 alpha 32 on every linear layer, at 1, 2 and 4 GPUs
  14b_full   Qwen3-14B shape, full fine-tune (weights, gradients and AdamW state do not fit one
             80 GB GPU), at 2 and 4 GPUs
  32b_lora   Qwen3-32B shape, LoRA, at 4 GPUs
The global batch is 16 sequences of 2048 at every GPU count (the plan keeps a recipe's global
batch exact: 4 x 4 accumulated on one GPU, 4 x 1 on each of four). Rows: real chat text
(bench/data_prep.py's real corpus, or --rows), through Qwen3's tokenizer.

  ours   a recipe per (workload, GPUs) built with `doit checkpoint:<recipe>` in a project made
         under --work: the base stage makes the weights (on the GPU: its wall time is reported),
         the shards stage packs the rows, the plan with autotune off, so full activation
         checkpointing and SDPA, as the peer's gradient checkpointing (--tuned: the probe's plan);
         hardware.sharding auto, so a LoRA base that fits one GPU is replicated (DDP) and anything
         else is sharded with FSDP2 (stages/plan.replica_fits)
  fsdp2  ours with hardware.sharding fsdp2: the same LoRA runs sharded, for the comparison
  peer   TRL's SFTTrainer in torchrun's processes, the Trainer's accelerate FSDP2 with the same
         FSDP settings as ours (stages/train/trainer.distributed_args), TRL's fastest settings
         that need no extra library: BFD packing, padding-free batches, SDPA, its default
         gradient checkpointing; the same base weights and rows (tokenized as the shards stage
         does, loss on the assistant turns)

Both count time per optimizer step on the first process, between the step ends as the GPU reaches
them (stages/train/trainer.step_clock_callback's CUDA events), over the steps after WARMUP; the
peer logs every LOG_EVERY steps (TRL's default), as ours does. Tokens are real
(non-pad) tokens: ours, the global batch x sequence length x the shards' packing efficiency;
the peer, the first process's collated tokens x the processes. MFU: 4N FLOPs per token for
LoRA, 6N for full (bench/autotune_probe.flops_per_token) over the bf16 matmul peak measured
here on GPU 0, times the GPUs. Memory: torch's peak allocation on the first GPU. Each repeat
(--repeat) is a fresh build (train.seed = the repeat's number, so a new key) and a fresh peer
process. Also measured: the base stage's wall time (twice for 8b_lora with --twice: a second,
separate project builds it again and the digests are compared) and the store's BLAKE3 hashing
speed over the base's weights, with every core and with one.

    python -m bench.scale [--workloads 8b_lora,32b_lora] [--gpus 1,2,4] [--sides ours,fsdp2@4,peer@4]
                          [--repeat 3] [--out FILE]

--tuned: each side's fastest settings instead of the safe ones: ours with autotune on (the probe's
plan: a replicated run is what the probe measures, a sharded one is planned through the memory model
of its shards, whose expected peak per GPU is reported beside the measured one), the peer without
gradient checkpointing and with the Trainer's torch_compile (TRL's best on one GPU, bench/train_speed.py).

--sides: which sides run (ours, fsdp2, peer), each at the GPU counts after its @, joined by +
(peer@2+4; default: every count of --gpus); fsdp2 runs for LoRA workloads at 2 GPUs or more only
(a full fine-tune is sharded either way).

--tiny: the tiny recipe's model on the CPU, LoRA in 1 and 2 processes and full in 2 (gloo DDP:
accelerate shards with FSDP on accelerators only), 6 steps of sequences of 256 (a smoke test, not
a measurement).
"""
from __future__ import annotations

import argparse
import datetime
import json
import logging
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench import tiny
from bench.autotune_probe import SHAPES, flops_per_token, matmul_peak_tflops

REPO = Path(__file__).resolve().parent.parent
SHARED = REPO.parent / "shared"
MAX_LENGTH, MICRO, GLOBAL_BATCH, STEPS, WARMUP, ROWS = 2048, 4, 16, 10, 2, 3000
SHAPES = {**SHAPES,
          "qwen3-14b": dict(hidden_size=5120, num_hidden_layers=40, num_attention_heads=40, num_key_value_heads=8,
                            head_dim=128, intermediate_size=17408, vocab_size=151936),
          "qwen3-32b": dict(hidden_size=5120, num_hidden_layers=64, num_attention_heads=64, num_key_value_heads=8,
                            head_dim=128, intermediate_size=25600, vocab_size=151936)}
WORKLOADS = {"8b_lora": ("qwen3-8b", "lora", (1, 2, 4)), "14b_full": ("qwen3-14b", "none", (2, 4)),
             "32b_lora": ("qwen3-32b", "lora", (4,))}
DEVICE = "cuda"
TUNED = False  # --tuned: each side's fastest settings instead of the safe ones


def use_tiny() -> None:
    global MAX_LENGTH, MICRO, GLOBAL_BATCH, STEPS, WARMUP, ROWS, WORKLOADS, DEVICE
    MAX_LENGTH, MICRO, GLOBAL_BATCH, STEPS, WARMUP, ROWS = 256, 2, 4, 6, 2, 200
    WORKLOADS, DEVICE = {"tiny_lora": ("tiny", "lora", (1, 2)), "tiny_full": ("tiny", "none", (2,))}, "cpu"


def model_config(shape: str) -> dict:
    """recipe model.config for a shape: Qwen3's tokenizer (the project's models/qwen3-tokenizer)
    and bf16, or for tiny the tiny recipe's model as it is."""
    if shape == "tiny":
        return {"hidden_size": 64, "intermediate_size": 192, "num_hidden_layers": 2, "num_attention_heads": 4,
                "num_key_value_heads": 2, "head_dim": 16, "max_position_embeddings": 512}
    return {**{k: v for k, v in SHAPES[shape].items()}, "max_position_embeddings": 40960,
            "tokenizer": "models/qwen3-tokenizer", "tie_word_embeddings": False, "dtype": "bfloat16", "seed": 0}


def recipe(shape: str, peft: str, gpus: int, seed: int, profile: str, sharding: str = "auto") -> dict:
    return {"model": {"config": model_config(shape)},
            "data": {"sources": [{"path": "data/rows.jsonl", "format": "chat"}], "heldout_fraction": 0.0,
                     "max_length": MAX_LENGTH},
            "train": {"method": "sft", "peft": peft, **({"lora": {"r": 16, "alpha": 32}} if peft == "lora" else {}),
                      "lr": 1e-4, "max_steps": STEPS, "micro_batch_size": MICRO, "grad_accum": GLOBAL_BATCH // MICRO,
                      "warmup_steps": 1, "save_steps": 10 * STEPS, "seed": seed},
            "hardware": {"profile": profile, "gpus": gpus, "sharding": sharding},
            "autotune": {"enabled": TUNED, "budget_seconds": 300}}


def make_project(work: Path, rows: Path, tokenizer_dir: Path | None) -> Path:
    """A project of the engine's code (copied: torchrun's processes import stages/ from the
    project), the rows and the tokenizer, where the recipes are written."""
    project = work / "project"
    if not (project / "dodo.py").exists():
        ignore = shutil.ignore_patterns("__pycache__")
        for name in ("stages", "ops"):
            shutil.copytree(REPO / name, project / name, ignore=ignore)
        shutil.copy2(REPO / "dodo.py", project / "dodo.py")
        (project / "data").mkdir()
        shutil.copyfile(rows, project / "data" / "rows.jsonl")
        if tokenizer_dir:
            shutil.copytree(tokenizer_dir, project / "models" / "qwen3-tokenizer")
        (project / "recipes").mkdir()
    return project


def doit(project: Path, target: str, log: Path) -> float:
    """Build one target; its output goes to `log`. Wall seconds."""
    start = time.perf_counter()
    with open(log, "a") as f:
        f.write(f"\n$ doit {target}\n")
        f.flush()
        p = subprocess.run([sys.executable, "-m", "doit", target], cwd=project, stdout=f, stderr=subprocess.STDOUT)
    if p.returncode:
        raise RuntimeError(f"doit {target} failed (exit {p.returncode}): see {log}")
    return time.perf_counter() - start


def artifact(project: Path, name: str, stage: str) -> tuple[Path, dict]:
    """An artifact's directory and its sidecar (inputs, run-time figures)."""
    from stages.engine.store import Store

    st = Store(project / "artifacts")
    ptr = st.pointer(name, stage)
    return st.path(stage, ptr["key"]), {**st.sidecar(stage, ptr["key"]), "digest": ptr["digest"]}


def figures(tokens: float, seconds: float, gpus: int, peak_bytes: int, flops: int, peak_tflops: float) -> dict:
    per_s = tokens / seconds
    return {"tokens_per_s": round(per_s, 1), "tokens_per_s_per_gpu": round(per_s / gpus, 1),
            "peak_gib_per_gpu": round(peak_bytes / 2**30, 1), "mfu": round(per_s * flops / (peak_tflops * 1e12 * gpus), 4)}


def run_ours(project: Path, name: str, gpus: int, log: Path, flops: int, peak_tflops: float) -> dict:
    doit(project, f"checkpoint:{name}", log)
    _, meta = artifact(project, name, "checkpoint")
    shards, _ = artifact(project, name, "shards")
    stats = json.loads((shards / "stats.json").read_text())
    plan, planned = artifact(project, name, "plan")
    decisions = json.loads((plan / "plan.json").read_text())["decisions"]
    timed = meta["run"]["step_seconds"][WARMUP - 1:]  # step_seconds starts at the second step
    tokens = len(timed) * GLOBAL_BATCH * MAX_LENGTH * stats["packing_efficiency"]
    peak = meta["run"].get("peak_gpu_memory_bytes") or 0
    found = planned["run"].get("probe")
    probed = {} if not found else {  # what the probe chose and expected, beside what the run measured
        "plan": {k: decisions[k] for k in ("attn_implementation", "sdpa_backend", "micro_batch_size",
                                           "gradient_checkpointing", "compile")},
        "probe_seconds": planned["run"]["seconds"],
        "expected_tokens_per_s_per_gpu": found["tokens_per_s"],  # every token of the probe's packed batches
        "expected_peak_gib_per_gpu": round(found["peak_bytes"] / 2**30, 1)}
    return {**figures(tokens, sum(timed), gpus, peak, flops, peak_tflops), "step_seconds_median": statistics.median(timed),
            "sharding": "fsdp2" if decisions.get("sharding") else ("ddp" if gpus > 1 else None), **probed}


def run_peer(project: Path, name: str, gpus: int, peft: str, seed: int, work: Path, log: Path, flops: int,
             peak_tflops: float) -> dict:
    """TRL in `gpus` fresh processes (torchrun), on the base and rows `name`'s build used."""
    base, _ = artifact(project, name, "base")
    spec = {"base": str(base), "rows": str(project / "data" / "rows.jsonl"), "peft": peft, "seed": seed,
            "out": str(work / f"peer_{name}.json"), "tiny": DEVICE == "cpu", "tuned": TUNED}
    (work / "peer_spec.json").write_text(json.dumps(spec))
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(gpus),
               "-m", "bench.scale", "--peer-child", str(work / "peer_spec.json")]
    with open(log, "a") as f:
        f.write(f"\n$ {' '.join(command)}\n")
        f.flush()
        p = subprocess.run(command, cwd=REPO, stdout=f, stderr=subprocess.STDOUT)
    if p.returncode:
        raise RuntimeError(f"the TRL peer on {gpus} process(es) failed (exit {p.returncode}): see {log}")
    r = json.loads(Path(spec["out"]).read_text())
    return {**figures(r["tokens"], r["seconds"], gpus, r["peak_bytes"], flops, peak_tflops),
            "step_seconds_median": r["step_seconds_median"], "sharding": "fsdp2" if gpus > 1 and DEVICE == "cuda" else
            ("ddp" if gpus > 1 else None)}


def peer_child(spec_path: str) -> None:
    """One of the peer's processes: TRL's SFTTrainer as a TRL user sets it up for FSDP2."""
    import numpy as np
    import torch
    from datasets import Dataset
    from peft import LoraConfig
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import SFTConfig, SFTTrainer

    from stages.data.rows import Refused
    from stages.data.template import encode_chats
    from stages.train.settings import sharding
    from stages.train.trainer import LOG_EVERY, distributed_args, step_clock_callback

    spec = json.loads(Path(spec_path).read_text())
    if spec["tiny"]:
        use_tiny()
    rank, world = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    if DEVICE == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    tok = AutoTokenizer.from_pretrained(spec["base"])
    with open(spec["rows"], encoding="utf-8") as f:
        chats = [json.loads(line)["messages"] for line in f]
    docs = [{"input_ids": np.asarray(ids)[:MAX_LENGTH].tolist(), "completion_mask": np.asarray(mask)[:MAX_LENGTH].astype(int).tolist()}
            for ids, mask in (e for e in encode_chats(tok, chats) if not isinstance(e, Refused))]
    dtype = torch.float32 if DEVICE == "cpu" else torch.bfloat16
    model = AutoModelForCausalLM.from_pretrained(spec["base"], dtype=dtype)
    model.config.use_cache = False
    args = SFTConfig(output_dir=str(Path(spec["out"]).with_suffix("")), max_steps=STEPS, per_device_train_batch_size=MICRO,
                     gradient_accumulation_steps=GLOBAL_BATCH // MICRO // world, max_length=MAX_LENGTH, packing=True,
                     padding_free=True, bf16=DEVICE == "cuda", use_cpu=DEVICE == "cpu", learning_rate=1e-4,
                     warmup_steps=1, logging_steps=LOG_EVERY, report_to="none", save_strategy="no", seed=spec["seed"],
                     data_seed=spec["seed"], dataloader_num_workers=0, gradient_checkpointing=not spec["tuned"],
                     torch_compile=spec["tuned"] and DEVICE == "cuda",
                     **distributed_args({"sharding": sharding(world, DEVICE)}))
    lora = LoraConfig(r=16, lora_alpha=32, target_modules="all-linear", task_type="CAUSAL_LM")
    trainer = SFTTrainer(model=model, args=args, train_dataset=Dataset.from_list(docs), processing_class=tok,
                         peft_config=lora if spec["peft"] == "lora" else None)
    counts, seconds = [], []
    collate = trainer.data_collator

    def counting(examples):
        batch = collate(examples)
        counts.append(int((batch["input_ids"] != tok.pad_token_id).sum()))
        return batch

    trainer.data_collator = counting
    trainer.add_callback(step_clock_callback(seconds))
    trainer.train()
    if rank == 0:
        accum = args.gradient_accumulation_steps
        timed = seconds[WARMUP - 1:]
        peak = torch.cuda.max_memory_allocated() if DEVICE == "cuda" else tiny.peak_bytes()
        Path(spec["out"]).write_text(json.dumps({
            "tokens": sum(counts[WARMUP * accum: STEPS * accum]) * world, "seconds": sum(timed),
            "step_seconds_median": statistics.median(timed), "peak_bytes": peak}))


def hashing_speed(weights: list[Path]) -> dict:
    """The store's BLAKE3 over the base's weights (read once first, so the page cache holds them
    where it can): GB/s with every core (the store's setting) and with one."""
    import blake3

    from stages.engine.store import hash_file

    size = sum(p.stat().st_size for p in weights)
    for p in weights:
        hash_file(p)
    start = time.perf_counter()
    for p in weights:
        hash_file(p)
    every = time.perf_counter() - start
    start = time.perf_counter()
    for p in weights:
        h = blake3.blake3()
        with open(p, "rb") as f:
            while chunk := f.read(1 << 24):
                h.update(chunk)
    one = time.perf_counter() - start
    return {"bytes": size, "cores": os.cpu_count(), "gb_per_s_all_cores": round(size / every / 1e9, 2),
            "gb_per_s_one_core": round(size / one / 1e9, 2)}


def machine() -> tuple[str, str, int]:
    """(kind for the file name, GPU name, GPUs visible), e.g. ("h100x4", "NVIDIA H100 80GB HBM3", 4)."""
    if DEVICE == "cpu":
        return "cpu", "cpu", 2
    import torch

    name = torch.cuda.get_device_name(0)
    short = next((k for k in ("h200", "h100", "a100", "mi300x") if k in name.lower()), "gpu")
    return f"{short}x{torch.cuda.device_count()}", name, torch.cuda.device_count()


def main() -> None:
    if len(sys.argv) > 2 and sys.argv[1] == "--peer-child":
        return peer_child(sys.argv[2])
    ap = argparse.ArgumentParser(description="ours (doit -> torchrun -> FSDP2) and TRL + accelerate FSDP2 at 1-4 GPUs")
    ap.add_argument("--workloads", help="default 8b_lora,14b_full,32b_lora (--tiny: tiny_lora,tiny_full)")
    ap.add_argument("--gpus", help="GPU counts to run, default 1,2,4 (--tiny: 1,2); each workload runs those of its "
                                   "own it lists")
    ap.add_argument("--tuned", action="store_true", help="each side's fastest settings: ours planned by the probe, "
                                                         "the peer without gradient checkpointing and compiled")
    ap.add_argument("--repeat", type=int, default=1, help="fresh runs of each configuration")
    ap.add_argument("--sides", default="ours,fsdp2,peer", help="ours, fsdp2, peer, each with @counts to run it at "
                                                                "those GPU counts only, e.g. ours,fsdp2@4,peer@4")
    ap.add_argument("--twice", action="store_true", help="build 8b_lora's base a second time in another project "
                                                         "and compare the digests")
    ap.add_argument("--work", type=Path, help="work directory (a project is made there; kept between calls)")
    ap.add_argument("--rows", type=Path, help="chat JSONL; default: bench/data_prep.py's real corpus (../shared)")
    ap.add_argument("--tokenizer", type=Path, default=SHARED / "tokenizers" / "qwen3")
    ap.add_argument("--out", type=Path)
    ap.add_argument("--tiny", action="store_true", help="the tiny model on the CPU: a smoke test, not a measurement")
    a = ap.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    global TUNED
    TUNED = a.tuned
    if a.tiny:
        use_tiny()
        a.workloads, a.gpus = a.workloads or "tiny_lora,tiny_full", a.gpus or "1,2"
        a.rows, a.tokenizer = a.rows or tiny.CHAT, None
        a.sides = "ours,peer"  # on the CPU every several-process run is DDP over gloo
    a.workloads, a.gpus = a.workloads or "8b_lora,14b_full,32b_lora", a.gpus or "1,2,4"
    work = a.work or Path(tempfile.mkdtemp(prefix="scale-"))
    work.mkdir(parents=True, exist_ok=True)
    log = work / "builds.log"
    rows = a.rows or work / "rows.jsonl"
    if not rows.exists():
        from bench.data_prep import make_real_rows

        make_real_rows(rows, ROWS)
    kind, gpu_name, visible = machine()
    date = datetime.date.today().isoformat()
    out = a.out or (tiny.results_path("scale.json") if a.tiny else REPO / "bench" / "results" / f"scale_{kind}_{date}.json")
    profile = "cpu" if DEVICE == "cpu" else ("h200" if "H200" in gpu_name else "h100")
    project = make_project(work, rows, a.tokenizer)
    peak_tflops = matmul_peak_tflops(DEVICE)
    results = json.loads(out.read_text()) if out.exists() else {"runs": []}  # a call cut short goes on
    results.update(gpu=gpu_name, gpus_visible=visible, matmul_peak_tflops=round(peak_tflops, 1),
                   max_length=MAX_LENGTH, global_batch=GLOBAL_BATCH, steps=STEPS, warmup=WARMUP, rows=str(a.rows or
                   "bench/data_prep.py real corpus"), settings=(
                       "tuned: ours planned by the probe, the peer without gradient checkpointing and compiled; "
                       if TUNED else "autotune off: full activation checkpointing, SDPA; ") +
                   "ours: hardware.sharding auto (DDP where a LoRA base fits one GPU), fsdp2: FSDP2"
                   if DEVICE == "cuda" else "the CPU's plan")
    results.setdefault("base", {})
    wanted = [int(g) for g in a.gpus.split(",")]
    sides = {}
    for spec in a.sides.split(","):
        side, _, counts = spec.partition("@")
        if side not in ("ours", "fsdp2", "peer"):
            ap.error(f"--sides: {side!r} is not one of ours, fsdp2, peer")
        sides[side] = [int(g) for g in counts.split("+")] if counts else wanted

    def save():
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(results, indent=1) + "\n")

    for workload in a.workloads.split(","):
        shape, peft, counts = WORKLOADS[workload]
        model = f"{shape.replace('-', '_').replace('.', '_')}_shape"
        flops = flops_per_token(SHAPES[shape], peft)
        for repeat in range(a.repeat):
            for gpus in [g for g in counts if g in wanted and g <= visible]:
                name = f"scale_{workload}_g{gpus}_s{repeat}" + ("_tuned" if TUNED else "")
                (project / "recipes" / f"{name}.yaml").write_text(json.dumps(recipe(shape, peft, gpus, repeat, profile)))
                if workload not in results["base"]:
                    seconds = doit(project, f"base:{name}", log)
                    base, meta = artifact(project, name, "base")
                    results["base"][workload] = {"seconds": round(seconds, 1), "digest": meta["digest"],
                                                 "hashing": hashing_speed(sorted(base.glob("*.safetensors")))}
                    if a.twice and repeat == 0:
                        other = make_project(work / "again", rows, a.tokenizer)
                        (other / "recipes" / f"{name}.yaml").write_text((project / "recipes" / f"{name}.yaml").read_text())
                        again = doit(other, f"base:{name}", log)
                        results["base"][workload].update(second_seconds=round(again, 1),
                                                         same_bytes=artifact(other, name, "base")[1]["digest"] == meta["digest"])
                    logging.info("base %s: %s", workload, results["base"][workload])
                    save()
                common = {"model": model, "method": "lora" if peft == "lora" else "full", "gpus": gpus, "repeat": repeat}
                for side in [s for s in ("ours", "fsdp2", "peer") if gpus in sides.get(s, [])]:
                    if side == "fsdp2" and (peft != "lora" or gpus == 1):
                        continue
                    done = [r for r in results["runs"] if {**common, "side": side}.items() <= r.items()]
                    if any("error" not in r for r in done):
                        continue  # done in an earlier call
                    results["runs"] = [r for r in results["runs"] if r not in done]  # a failed try is tried again
                    try:
                        if side == "ours":
                            r = run_ours(project, name, gpus, log, flops, peak_tflops)
                        elif side == "fsdp2":
                            (project / "recipes" / f"{name}_fsdp2.yaml").write_text(
                                json.dumps(recipe(shape, peft, gpus, repeat, profile, "fsdp2")))
                            r = run_ours(project, f"{name}_fsdp2", gpus, log, flops, peak_tflops)
                        else:
                            doit(project, f"base:{name}", log)
                            r = run_peer(project, name, gpus, peft, repeat, work, log, flops, peak_tflops)
                    except RuntimeError as e:
                        r = {"error": str(e), "log_tail": log.read_text()[-1500:]}
                    results["runs"].append({**common, **r, "side": side, "peer": side == "peer"})
                    logging.info("%s %s", side, results["runs"][-1])
                    save()
    print(table(results))


def table(results: dict) -> str:
    """The runs as a table, with scaling efficiency (tokens/s over GPUs x one GPU's of the same
    repeat: ours for fsdp2, which has no one-GPU run) and each of ours over the peer at its GPU count:
    by tokens/s over the timed steps, and by median step time (the same global batch a step), which
    leaves out the steps a compiled peer spends compiling again as its batch shapes change."""
    lines = [f"{results['gpu']}: {results['matmul_peak_tflops']} TFLOP/s bf16 matmul peak; "
             f"{results['global_batch']} x {results['max_length']} per step, {results['settings']}",
             f"{'model':18} {'method':6} {'GPUs':>4} {'side':5} {'split':5} {'tokens/s':>9} {'per GPU':>8} {'MFU':>6} "
             f"{'GiB/GPU':>8} {'scaling':>8} {'vs peer':>8} {'median step vs peer':>20}"]
    runs = [{"side": "peer" if r["peer"] else "ours", "sharding": None, **r} for r in results["runs"]]  # files
    # written before the fsdp2 side have neither field

    def find(r, side, gpus):
        return next((o for o in runs if "error" not in o and o["side"] == side and o["gpus"] == gpus
                     and all(o[k] == r[k] for k in ("model", "method", "repeat"))), None)

    for r in runs:
        if "error" in r:
            lines.append(f"{r['model']:18} {r['method']:6} {r['gpus']:>4} {r['side']:5} {r['error']}")
            continue
        one = find(r, "ours" if r["side"] == "fsdp2" else r["side"], 1)
        scaling = f"{r['tokens_per_s'] / (r['gpus'] * one['tokens_per_s']):.0%}" if one and r["gpus"] > 1 else ""
        peer = find(r, "peer", r["gpus"]) if r["side"] != "peer" else None
        versus = f"{r['tokens_per_s'] / peer['tokens_per_s']:.2f}x" if peer else ""
        stepwise = f"{peer['step_seconds_median'] / r['step_seconds_median']:.2f}x" if peer else ""
        lines.append(f"{r['model']:18} {r['method']:6} {r['gpus']:>4} {r['side']:5} {r['sharding'] or '':5} "
                     f"{r['tokens_per_s']:>9.0f} {r['tokens_per_s_per_gpu']:>8.0f} {r['mfu']:>6.1%} "
                     f"{r['peak_gib_per_gpu']:>8.1f} {scaling:>8} {versus:>8} {stepwise:>20}")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
