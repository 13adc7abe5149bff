"""Attention over each request's own keys, for the generation engine's batch on a GPU: a Triton
kernel (Triton ships with torch's CUDA builds).

Why: without flash-attention (not on the lent GPUs, and no wheel for torch 2.11) the batch's
attention is one SDPA call over every request's keys under a block-diagonal mask, so each query
attends to every request's keys and most of the work is masked away; cuDNN's kernel for it also
runs one block per key/value head (8 for Qwen3-8B), walking all the keys. At 32 requests it was a
third of a step's GPU time on an H200. Here a program takes a few query tokens of one request (one
token in a decode step, where every request has one) and one key/value head, with the query heads
that share it as rows (no copy of keys or values), and reads that request's keys alone, causal
at the bottom right (a prefill chunk's tokens see the history and the chunk up to themselves),
exactly what the mask expressed. The grid follows the step's tokens, not its padded requests
(transformers pads a step of 2,048 tokens to 1,024 requests), and a program finds its request by
a binary search of `cu_q`. torch's public alternatives were measured and lose (docs/serving.md):
jagged-tensor SDPA wants equal query and key heads, so keys and values are copied per query head;
FlexAttention's decoding was slower than the masked SDPA.

Runs under transformers' CUDA graph: shapes are the step's padded ones, lengths are read on the
device (`cu_q`, `cu_k`: cumulative query and key lengths per request, padded requests empty).
"""
from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # a CPU build of torch has no Triton: the batch keeps the masked SDPA there
    triton = None

SEARCH_STEPS = 11  # a binary search over at most 2**11 - 1 requests a step (transformers' cap is 1,024)


def available(query: torch.Tensor) -> bool:
    """On a GPU with Triton (or Triton's interpreter, which the tests run on the CPU), and a head
    dimension its matrix products take (16 or more)."""
    return triton is not None and (query.is_cuda or _interpreted()) and query.shape[-1] >= 16


def _interpreted() -> bool:
    import os

    return os.environ.get("TRITON_INTERPRET") == "1"


if triton is not None:
    @triton.jit
    def _kernel(Q, K, V, O, cu_q, cu_k, requests, scale,
                sq_t, sq_h, sk_t, sk_h, sv_t, sv_h, so_t, so_h,
                G: tl.constexpr, D: tl.constexpr, BLOCK_D: tl.constexpr, TOKENS: tl.constexpr,
                BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, PRECISION: tl.constexpr, STEPS: tl.constexpr):
        """One program: TOKENS consecutive query tokens of the step (each request's in turn) and
        one key/value head, their query heads as rows; a request at a time where they span several."""
        kv_head = tl.program_id(1)
        first = tl.program_id(0) * TOKENS
        end = first + TOKENS
        # the request holding `first`: the last whose start is at or before it (padded ones are empty)
        lo, hi = first * 0, first * 0 + requests  # int32 from the start: loop-carried values keep their type
        for _ in range(STEPS):
            mid = (lo + hi) // 2
            searching = hi - lo > 1
            right = searching & (tl.load(cu_q + mid) <= first)
            lo = tl.where(right, mid, lo)
            hi = tl.where(searching & ~right, mid, hi)
        dims = tl.arange(0, BLOCK_D)
        in_dim = dims < D
        r = tl.arange(0, BLOCK_M)
        stop = tl.minimum(end, tl.load(cu_q + requests))  # past the last real token: the padded requests
        seq = lo
        q_start = tl.load(cu_q + seq)
        while q_start < stop:
            q_end = tl.load(cu_q + seq + 1)
            top_token, low_token = tl.minimum(q_end, end), tl.maximum(q_start, first)
            if low_token < top_token:
                k_start, k_end = tl.load(cu_k + seq), tl.load(cu_k + seq + 1)
                q_len, k_len = q_end - q_start, k_end - k_start
                live = r < (top_token - low_token) * G  # row r: token low_token + r // G, head kv_head * G + r % G
                token, head = low_token + r // G, kv_head * G + r % G
                q = tl.load(Q + token[:, None] * sq_t + head[:, None] * sq_h + dims[None, :],
                            mask=live[:, None] & in_dim[None, :], other=0.0)
                seen = k_len - q_len + (token - q_start) + 1  # the history and its chunk up to itself
                high = k_len - q_len + (top_token - 1 - q_start) + 1
                top = tl.full([BLOCK_M], -1.0e30, tl.float32)
                total = tl.zeros([BLOCK_M], tl.float32)
                acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
                for n in range(0, high, BLOCK_N):
                    cols = n + tl.arange(0, BLOCK_N)
                    inside = cols < k_len
                    k = tl.load(K + (k_start + cols)[:, None] * sk_t + kv_head * sk_h + dims[None, :],
                                mask=inside[:, None] & in_dim[None, :], other=0.0)
                    s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale
                    s = tl.where(cols[None, :] < seen[:, None], s, float("-inf"))
                    new_top = tl.maximum(top, tl.max(s, 1))
                    p = tl.exp(s - new_top[:, None])
                    shrink = tl.exp(top - new_top)
                    total = total * shrink + tl.sum(p, 1)
                    v = tl.load(V + (k_start + cols)[:, None] * sv_t + kv_head * sv_h + dims[None, :],
                                mask=inside[:, None] & in_dim[None, :], other=0.0)
                    acc = acc * shrink[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
                    top = new_top
                out = acc / total[:, None]
                tl.store(O + token[:, None] * so_t + head[:, None] * so_h + dims[None, :],
                         out.to(O.dtype.element_ty), mask=live[:, None] & in_dim[None, :])
            seq += 1
            q_start = q_end


def attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, cu_q: torch.Tensor,
              cu_k: torch.Tensor, scale: float) -> torch.Tensor:
    """query [1, heads, tokens, dim], key/value [1, kv_heads, keys, dim] (each request's keys in
    turn, as `cu_k` counts them) -> [1, tokens, heads, dim]; rows of no request (padding) are 0."""
    _, heads, tokens, dim = query.shape
    kv_heads = key.shape[1]
    q, k, v = query[0].transpose(0, 1), key[0].transpose(0, 1), value[0].transpose(0, 1)  # [tokens, heads, dim]
    q, k, v = (x if x.stride(-1) == 1 else x.contiguous() for x in (q, k, v))
    out = torch.zeros(tokens, heads, dim, dtype=query.dtype, device=query.device)
    groups = heads // kv_heads
    # a program a token up to 512 (a decode step's requests, a short chunk's tokens sharing their keys
    # in the cache); past that, prefill chunks: 64 query rows a program
    per_program = 1 if tokens <= 512 else max(1, 64 // groups)
    requests = cu_q.shape[0] - 1
    if requests >= 2 ** SEARCH_STEPS:
        raise ValueError(f"{requests} requests in a step: the kernel searches at most {2 ** SEARCH_STEPS - 1}")
    grid = (triton.cdiv(tokens, per_program), kv_heads)
    _kernel[grid](q, k, v, out, cu_q, cu_k, requests, scale, q.stride(0), q.stride(1), k.stride(0), k.stride(1),
                  v.stride(0), v.stride(1), out.stride(0), out.stride(1), G=groups, D=dim,
                  BLOCK_D=triton.next_power_of_2(dim), TOKENS=per_program,
                  BLOCK_M=max(16, triton.next_power_of_2(per_program * groups)), BLOCK_N=64, STEPS=SEARCH_STEPS,
                  PRECISION="ieee" if query.dtype == torch.float32 else None)  # fp32 stays fp32 (no TF32)
    return out.unsqueeze(0)
