"""The shards stage's output: documents packed best-fit-decreasing, a window at a time (memory
stays bounded), into shards in the format of stages/data/packed.py (or kept whole, in the format
of stages/data/ragged.py, for the data kinds that are not packed), written by one worker process
per core, in a deterministic order.
"""
from __future__ import annotations

import bisect
import importlib
import os
from pathlib import Path

import numpy as np

from stages.data import packed, ragged
from stages.data.prepared import by_chunk, chunk_docs

PACK_WINDOW = 65536  # documents packed together (and held in memory) at once


def pack(lengths: list[int], capacity: int) -> list[list[int]]:
    """Best-fit-decreasing: each document goes to the fullest bin it still fits in."""
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    bins: list[list[int]] = []
    free: list[tuple[int, int]] = []  # (room left, bin index), kept sorted
    for i in order:
        at = bisect.bisect_left(free, (lengths[i], -1))
        if at == len(free):
            bins.append([i])
            room, b = capacity - lengths[i], len(bins) - 1
        else:
            room, b = free.pop(at)
            bins[b].append(i)
            room -= lengths[i]
        bisect.insort(free, (room, b))
    return bins


def write_packed(path: Path, docs: list[dict], L: int, pad_id: int) -> int:
    """Documents packed best-fit-decreasing into sequences of L tokens (stages/packed.py);
    returns how many sequences."""
    lengths = np.array([len(d["ids"]) for d in docs], dtype=np.int64)
    bins = pack(lengths.tolist(), L)
    order = np.concatenate([np.array(b, dtype=np.int64) for b in bins])
    sizes = np.array([len(b) for b in bins])
    sequence = np.repeat(np.arange(len(bins)), sizes)
    used = np.bincount(sequence, weights=lengths[order], minlength=len(bins)).astype(np.int64)
    starts = np.cumsum(lengths[order]) - lengths[order] - np.repeat(np.cumsum(used) - used, sizes)  # in its sequence
    ids, masks = [], []
    padding = np.full(L, pad_id, dtype=np.int32), np.zeros(L, dtype=np.uint8)
    for members, free in zip(bins, (L - used).tolist()):
        ids += [docs[d]["ids"] for d in members]
        masks += [docs[d]["mask"] for d in members]
        if free:
            ids.append(padding[0][:free])
            masks.append(padding[1][:free])
    input_ids, loss_mask = shard_buffers(len(bins), L)
    np.concatenate(ids, out=input_ids.reshape(-1))
    np.concatenate(masks, out=loss_mask.reshape(-1))
    documents = np.stack([sequence, starts, lengths[order]], axis=1).astype(np.int32)
    packed.write(path, input_ids, loss_mask, documents)
    return len(bins)


_buffers: dict = {}


def shard_buffers(n: int, L: int) -> tuple[np.ndarray, np.ndarray]:
    """n x L token and mask arrays, reused by a process from shard to shard: fresh ones cost a
    page fault per 4 KiB written."""
    have = _buffers.get("shard")
    if have is None or have[0].shape[0] < n or have[0].shape[1] != L:
        have = _buffers["shard"] = (np.empty((n, L), dtype=np.int32), np.empty((n, L), dtype=np.uint8))
    return have[0][:n], have[1][:n]


def write_shard(path: Path, chunks: list, at: np.ndarray, kind_module: str, L: int, pad_id: int) -> int:
    """One shard of documents, given as (chunk, row in it) and cut to L tokens; returns the
    sequences written (0 for a kind that is not packed). Runs in a worker; the data kind comes
    by its module's name (a module does not pickle)."""
    kind = importlib.import_module(kind_module)
    docs = [None] * len(at)
    for c, where in by_chunk(at[:, 0]):
        for k, doc in zip(where, chunk_docs(*chunks[c], at[where, 1], kind)):
            docs[k] = {key: v[:L] if isinstance(v, np.ndarray) else v for key, v in doc.items()}
    if kind.PACKED:
        return write_packed(path, docs, L, pad_id)
    ragged.write(path, docs, kind.SIDES, kind.LEARNS, kind.BESIDE)
    return 0


def write_shards(out: Path, prepared, docs: np.ndarray, L: int, pad_id: int, progress=lambda it, **_: it) -> tuple[int, int]:
    """The documents at rows `docs`, in order, PACK_WINDOW to a shard; shards are written by one
    worker process per core, counted by `progress` (a tqdm-like wrapper: the build's Context.progress).
    Returns (sequences, shards)."""
    from concurrent.futures import ProcessPoolExecutor
    from multiprocessing import get_context

    out.mkdir()
    windows = [docs[i: i + PACK_WINDOW] for i in range(0, len(docs), PACK_WINDOW)]
    with ProcessPoolExecutor(min(os.cpu_count() or 1, max(len(windows), 1)), mp_context=get_context("fork")) as pool:
        futures = [pool.submit(write_shard, out / f"shard-{k:05d}.safetensors", prepared.chunks,
                               np.stack([prepared.chunk_of[w], prepared.local[w]], axis=1), prepared.kind.__name__,
                               L, pad_id)
                   for k, w in enumerate(windows)]
        sequences = sum(f.result() for f in progress(futures, desc="shards", unit=" shards"))
    return sequences, len(windows)
