"""Does compiling change what bf16 training computes? train_speed's loss check compares ours
(compiled) with ours_safe (eager) over the first 20 steps on the same batches. This trains
ours's decisions compiled twice, with inductor's own fused rounding and with eager's casts
emulated (stages/train/settings.COMPILE_OPTIONS), and with --fp32 the same model in full
precision (fp32 weights and matmuls, TF32 off, the safe settings), and prints tokens/s and
each loss curve's max |difference| from ours_safe's (and fp32's).

    python -m bench.compile_precision RESULT.json [out.json] --work DIR [--rows FILE] [--tokenizer DIR] [--fp32]

RESULT.json is a train_speed output on this GPU; --rows/--tokenizer must be the workload it
ran (its rows' BLAKE3 is checked).

--tiny: on a `python -m bench.train_speed --tiny` output, its tiny model and rows on the CPU
(two inductor compiles on the CPU: a smoke test, not a measurement).
"""
from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

from bench import tiny
from bench import train_speed as bench

CASTS = {"compiled_emulated_casts": {"emulate_precision_casts": True}, "compiled_fused_casts": {}}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("result", type=Path)
    ap.add_argument("out", nargs="?", type=Path)
    ap.add_argument("--work", type=Path, required=True)
    ap.add_argument("--rows", type=Path)
    ap.add_argument("--tokenizer", type=Path, default=bench.REPO.parent / "shared" / "tokenizers" / "qwen3")
    ap.add_argument("--fp32", action="store_true", help="also the full-precision reference (about 3 minutes on an H200)")
    ap.add_argument("--tiny", action="store_true", help="on a train_speed --tiny result, on the CPU: a smoke test")
    a = ap.parse_args()
    import torch

    from stages.train import settings

    result = json.loads(a.result.read_text())
    a.work.mkdir(parents=True, exist_ok=True)
    if a.tiny:
        bench.use_tiny()
        a.rows, a.tokenizer = a.rows or tiny.CHAT, tiny.tokenizer_dir(a.work)
    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(a.work / "inductor"))
    os.environ.setdefault("TRITON_CACHE_DIR", str(a.work / "triton"))
    if bench.workload(a.work, a.rows, a.tokenizer)["rows_blake3"] != result["workload"]["rows_blake3"]:
        raise SystemExit(f"{a.rows}: not the rows {a.result} ran (BLAKE3 differs)")
    tok = bench.tokenizer(a.work)
    rows = bench.packed_rows(bench.documents(a.work, tok), tok.pad_token_id)
    decisions = {**result["ours_decisions"], "compile": True}
    runs = {}
    for name, options in CASTS.items():
        settings.COMPILE_OPTIONS = options
        runs[name] = bench.run_ours(name, rows, tok, decisions, a.work)
    if a.fp32:
        torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
        runs["fp32"] = bench.run_ours("fp32", rows, tok, bench.safe(decisions), a.work, dtype="float32")
    curves = {**{n: r["losses"] for n, r in runs.items()}, "ours_safe": result["results"]["ours_safe"]["losses"]}
    print(f"{'':24} {'tokens/s':>9} {'vs ours_safe':>13} {'vs fp32':>8}  (max |loss difference|, first 20 steps)")
    for name, losses in curves.items():
        speed = runs[name]["tokens_per_s"] if name in runs else result["results"][name]["tokens_per_s"]
        fp32 = f"{bench.loss_distance(losses, curves['fp32']):8.4f}" if "fp32" in curves else ""
        print(f"{name:24} {speed:>9.0f} {bench.loss_distance(losses, curves['ours_safe']):13.4f} {fp32}")
    if a.out:
        a.out.write_text(json.dumps({"result": str(a.result), "decisions": decisions, "runs": runs}, indent=1) + "\n")


if __name__ == "__main__":
    main()
