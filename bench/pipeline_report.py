"""What one `doit manifest:<recipe>` cost, read back from its artifacts: each stage's wall time
(its sidecar's run.seconds), training tokens/s, MFU and peak GPU memory, GPU-hours and the
price at a stated on-demand rate, beside the seed's targets.

Training tokens are the steps' sequences times the shards' mean real tokens per packed
sequence (stats.json: tokens / sequences), over the Trainer's train_runtime (which includes
compilation in the first steps). MFU counts model FLOPs only (autotune_probe.flops_per_token:
6N full, 4N LoRA) over the GPU's dense bf16 peak from its datasheet and, where a GPU is
present, over the matmul peak measured here.

    python -m bench.pipeline_report RECIPE [--price USD_PER_GPU_HOUR] [--out report.json]

--tiny: RECIPE is tiny, built here first where it is not (`doit manifest:tiny`, CPU, about a
minute): the same figures of a CPU build (no GPU, no datasheet peak; a smoke test).
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

from bench.autotune_probe import flops_per_token, matmul_peak_tflops

REPO = Path(__file__).resolve().parent.parent

DATASHEET_BF16_TFLOPS = {"H100": 989.4, "H200": 989.4}  # dense, SXM
TARGETS = {"tokens_per_s": 15000, "mfu": 0.40, "minutes": 90, "usd": 3.0}


def artifact(recipe: str, stage: str) -> tuple[Path, dict]:
    key = json.loads((REPO / "artifacts" / recipe / f"{stage}.json").read_text())["key"]
    store = REPO / "artifacts" / "store" / stage
    return store / key, json.loads((store / f"{key}.json").read_text())


def main() -> None:
    from stages.engine.recipe import load
    from stages.table import STAGES

    ap = argparse.ArgumentParser()
    ap.add_argument("recipe", nargs="?")
    ap.add_argument("--price", type=float, default=3.00, help="USD per GPU-hour, on demand")
    ap.add_argument("--out")
    ap.add_argument("--tiny", action="store_true", help="the tiny recipe, built first if need be: a smoke test")
    a = ap.parse_args()
    if a.tiny:
        a.recipe = "tiny"
        subprocess.run([sys.executable, "-m", "doit", "manifest:tiny"], cwd=REPO, check=True)
    elif not a.recipe:
        ap.error("name a recipe (or --tiny)")
    recipe = load(REPO / "recipes" / f"{a.recipe}.yaml")

    # what `doit manifest:<recipe>` builds: the manifest and the stages it covers (not anchor, report)
    manifest, _ = artifact(a.recipe, "manifest")
    covered = {*json.loads((manifest / "manifest.json").read_text())["artifacts"], "manifest"}
    stages = {}
    for name in (n for n in STAGES if n in covered):
        path, side = artifact(a.recipe, name)
        stages[name] = {"seconds": side["run"].get("seconds"), "path": path, "run": side["run"]}
    total = sum(s["seconds"] or 0 for s in stages.values())

    stats = json.loads((stages["shards"]["path"] / "stats.json").read_text())
    config = json.loads((stages["base"]["path"] / "config.json").read_text())
    run = stages["checkpoint"]["run"]
    t = recipe.train
    tokens = t.max_steps * t.micro_batch_size * t.grad_accum * stats["tokens"] / stats["sequences"]
    tokens_per_s = tokens / run["train_runtime"]
    model_tflops = flops_per_token(config, t.peft) * tokens_per_s / 1e12
    facts = json.loads((stages["plan"]["path"] / "plan.json").read_text()).get("facts", {})
    gpu = facts.get("name", "")
    sheet = next((v for k, v in DATASHEET_BF16_TFLOPS.items() if k in gpu), None)
    measured = None
    try:
        import torch

        measured = matmul_peak_tflops() if torch.cuda.is_available() else None
    except ImportError:
        pass
    gpus = recipe.hardware.gpus
    report = {
        "recipe": a.recipe, "gpu": gpu, "gpus": gpus,
        "stage_seconds": {k: s["seconds"] for k, s in stages.items()},
        "total_minutes": round(total / 60, 2),
        "train": {"steps": t.max_steps, "tokens": round(tokens), "train_runtime_s": run["train_runtime"],
                  "tokens_per_s": round(tokens_per_s), "model_tflops": round(model_tflops, 1),
                  "mfu_datasheet": round(model_tflops / sheet, 3) if sheet else None,
                  "mfu_measured_peak": round(model_tflops / measured, 3) if measured else None,
                  "measured_matmul_peak_tflops": round(measured, 1) if measured else None,
                  "peak_gpu_memory_gib": round(run["peak_gpu_memory_bytes"] / 2**30, 2)
                  if "peak_gpu_memory_bytes" in run else None},
        "probe": stages["plan"]["run"].get("probe", {}).get("decisions"),
        "gpu_hours": round(total / 3600 * gpus, 3),
        "usd": round(total / 3600 * gpus * a.price, 2), "usd_per_gpu_hour": a.price,
        "targets": TARGETS,
    }
    text = json.dumps(report, indent=1)
    print(text)
    if a.out:
        Path(a.out).write_text(text + "\n")


if __name__ == "__main__":
    main()
