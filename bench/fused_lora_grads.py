"""An experiment for issue 39, item 2: LoRA's two backward products of an output gradient in one
pass over it.

lora_accumulate's backward (stages/train/lora_scale.py) computes, for each projection's output
gradient g (tokens x out features), dh = g B (its low-rank input's gradient) and dB = g^T h (B's
gradient) as two cuBLAS matmuls. Both are thin (r = 16 columns) and bound by memory, so each
reads all of g: a Qwen3-8B layer's seven output gradients are 638 MB at 4 x 2,048 tokens, read
twice where once would do (about 0.19 ms a layer at an H100's 3.35 TB/s, 7 ms of its ~500 ms step).
lora_grads() reads g once: each program takes a block of rows and a block of columns of g, keeps
its columns' dB partial sum in registers over its rows, and adds its rows' dh partial sums into a
buffer of its own (in L2); the partial sums of programs are added by torch (a fixed order: the same
bits every run, unlike atomic adds).

Not in the product: `python -m bench.fused_lora_grads` on a GPU times it beside cuBLAS's two
products on the 8B layer's shapes for each tile config (ratios printed), and
bench/step_profile.py's trainer_mb4_fused_lora_grads runs the trainer with the best one;
bench/gpu_fused_lora_grads.sh does both in one call. Landing it waits on that measurement (no
machine could be started on 2026-12-07). TRITON_INTERPRET=1 runs the kernel on the CPU
(tests/test_bench.py checks its values there).
"""
from __future__ import annotations

import json
import sys

import torch
import triton
import triton.language as tl

# block_rows x block_cols: the tile of g a program multiplies at a time; chunk_rows: the rows a
# program sums dB over (its partial sums are 2r/chunk_rows of g's bytes); programs: about two per
# SM of an H100 (132), enough loads in flight to keep memory busy. main() tries CONFIGS on the GPU.
CONFIG = {"block_rows": 64, "block_cols": 64, "chunk_rows": 512, "programs": 264, "num_warps": 4}
CONFIGS = [dict(CONFIG), {**CONFIG, "block_cols": 128}, {**CONFIG, "block_rows": 128, "num_warps": 8},
           {**CONFIG, "chunk_rows": 1024}, {**CONFIG, "programs": 528}, {**CONFIG, "block_rows": 32, "block_cols": 128},
           {"block_rows": 128, "block_cols": 128, "chunk_rows": 1024, "programs": 264, "num_warps": 8}]


@triton.jit
def _lora_grads(G, H, B, DH, DB, N, O, R, sg_n, sg_o, sh_n, sh_r, sb_o, sb_r, COLS,
                ROWS: tl.constexpr, BN: tl.constexpr, BO: tl.constexpr, BR: tl.constexpr):
    chunk, split = tl.program_id(0), tl.program_id(1)
    rr = tl.arange(0, BR)
    r_in = rr < R
    n_lo = chunk * ROWS
    o_lo = split * COLS
    o_hi = tl.minimum(o_lo + COLS, O)
    for o0 in range(o_lo, o_hi, BO):
        oo = o0 + tl.arange(0, BO)
        o_in = oo < o_hi
        b = tl.load(B + oo[:, None] * sb_o + rr[None, :] * sb_r, mask=o_in[:, None] & r_in[None, :], other=0.0)
        db = tl.zeros((BO, BR), dtype=tl.float32)
        for n0 in range(n_lo, n_lo + ROWS, BN):
            nn = n0 + tl.arange(0, BN)
            n_in = nn < N
            g = tl.load(G + nn[:, None] * sg_n + oo[None, :] * sg_o, mask=n_in[:, None] & o_in[None, :], other=0.0)
            h = tl.load(H + nn[:, None] * sh_n + rr[None, :] * sh_r, mask=n_in[:, None] & r_in[None, :], other=0.0)
            db += tl.dot(tl.trans(g), h)
            dh = DH + split * N * BR + nn[:, None] * BR + rr[None, :]
            tl.store(dh, tl.load(dh, mask=n_in[:, None], other=0.0) + tl.dot(g, b), mask=n_in[:, None])
        tl.store(DB + chunk * O * BR + oo[:, None] * BR + rr[None, :], db, mask=o_in[:, None])


def lora_grads(g: torch.Tensor, h: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(g b, g^T h) in g's dtype, g read once: g tokens x out, h tokens x r (a strided slice is
    fine), b out x r."""
    c = CONFIG
    n, o = g.shape
    r = b.shape[1]
    br = max(16, triton.next_power_of_2(r))  # tl.dot's least size
    chunks = triton.cdiv(n, c["chunk_rows"])
    splits = max(1, min(triton.cdiv(o, c["block_cols"]), c["programs"] // chunks))
    cols = triton.cdiv(triton.cdiv(o, splits), c["block_cols"]) * c["block_cols"]
    splits = triton.cdiv(o, cols)
    dh = torch.zeros(splits, n, br, dtype=torch.float32, device=g.device)
    db = torch.empty(chunks, o, br, dtype=torch.float32, device=g.device)
    _lora_grads[(chunks, splits)](g, h, b, dh, db, n, o, r, g.stride(0), g.stride(1), h.stride(0), h.stride(1),
                                  b.stride(0), b.stride(1), cols, ROWS=c["chunk_rows"], BN=c["block_rows"],
                                  BO=c["block_cols"], BR=br, num_warps=c["num_warps"])
    return dh.sum(0)[:, :r].to(g.dtype), db.sum(0)[:, :r].to(g.dtype)


def fused_backward(grads, x, h, weights, a, bs):
    """lora_accumulate_backward with each member's two low-rank products from lora_grads (the
    rest as stages/train/lora_scale.py computes it)."""
    dhs, dbs, start = [], [], 0
    for g, b in zip(grads, bs):
        dh, db = lora_grads(g, h[:, start:start + b.shape[1]], b)
        dhs.append(dh)
        dbs.append(db)
        start += b.shape[1]
    dh = torch.cat(dhs, dim=1)
    dx = dh @ a
    for g, w in zip(grads, weights):
        dx.addmm_(g, w)
    return [dx, dh.t() @ x] + dbs


def use() -> None:
    """The trainer's lora_accumulate backward on CUDA through fused_backward, for this process
    (through the custom op's public register_kernel: the CPU keeps the op's own), with the
    config main() found best where FUSED_LORA_GRADS names its result."""
    import os

    from stages.train import lora_scale

    found = os.environ.get("FUSED_LORA_GRADS")
    if found and os.path.exists(found):
        with open(found) as f:
            best = json.load(f)["best_config"]
        CONFIG.update({key: int(best[key]) for key in CONFIG})  # the config's own keys, as numbers

    lora_scale.lora_accumulate_backward.register_kernel("cuda")(fused_backward)


# One Qwen3-8B decoder layer's LoRA projections at 4 x 2,048 tokens: (name, out features)
LAYER = (("q", 4096), ("k", 1024), ("v", 1024), ("o", 4096), ("gate", 12288), ("up", 12288), ("down", 4096))


def timed(fn, repeats: int) -> float:
    """Median ms of `repeats` calls, each between CUDA events, after two warm-ups."""
    for _ in range(2):
        fn()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return sorted(times)[len(times) // 2]


def layer(config: dict, repeats: int) -> dict:
    """One layer's projections with `config`: each projection's ms beside cuBLAS's two products."""
    CONFIG.update(config)
    tokens, r = 8192, 16
    gen = torch.Generator(device="cuda").manual_seed(0)
    rows = []
    for name, out in LAYER:
        g = torch.randn(tokens, out, device="cuda", dtype=torch.bfloat16, generator=gen)
        h = torch.randn(tokens, 3 * r, device="cuda", dtype=torch.bfloat16, generator=gen)[:, r:2 * r]
        b = torch.randn(out, r, device="cuda", dtype=torch.bfloat16, generator=gen)
        want = (g @ b, g.t() @ h)
        got = lora_grads(g, h, b)
        error = max(((x.float() - y.float()).norm() / y.float().norm()).item() for x, y in zip(got, want))
        cublas = timed(lambda: (g @ b, g.t() @ h), repeats)
        fused = timed(lambda: lora_grads(g, h, b), repeats)
        rows.append({"projection": name, "out": out, "cublas_ms": round(cublas, 4), "fused_ms": round(fused, 4),
                     "fused_over_cublas": round(fused / cublas, 3),
                     "fused_read_tb_s": round(g.numel() * 2 / fused / 1e9, 2), "relative_error": round(error, 5)})
    cublas, fused = sum(p["cublas_ms"] for p in rows), sum(p["fused_ms"] for p in rows)
    return {"config": dict(config), "layer_cublas_ms": round(cublas, 3), "layer_fused_ms": round(fused, 3),
            "layer_ratio": round(fused / cublas, 3), "projections": rows}


def main() -> None:
    """Every config of CONFIGS on one Qwen3-8B layer's shapes at 4 x 2,048 tokens, r = 16, median
    of 50 calls each way; the best config again at the end (the first call of a config compiles)."""
    runs = []
    for config in CONFIGS:
        runs.append(layer(config, 50))
        print(json.dumps({k: v for k, v in runs[-1].items() if k != "projections"}), flush=True)
    best = min(runs, key=lambda run: run["layer_fused_ms"])["config"]
    again = layer(best, 100)
    for p in again["projections"]:
        print(json.dumps(p), flush=True)
    result = {"device": torch.cuda.get_device_name(), "tokens": 8192, "r": 16, "best_config": best, "best": again,
              "configs": runs}
    print(json.dumps({k: v for k, v in again.items() if k != "projections"}), flush=True)
    if len(sys.argv) > 1:
        with open(sys.argv[1], "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
