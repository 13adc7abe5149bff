"""The packed shard format: what the shards stage writes and training reads.

A shard is a safetensors file of sequences of max_length tokens: `input_ids` (int32,
padded with the pad id), `loss_mask` (uint8, 1 on the tokens the model learns) and
`documents` (int32 rows of sequence, start, length: one per document). Labels and
position ids are not stored, they follow from these: a label is the token where the mask
is 1, else IGNORE; positions restart at each document, and the padding after a
sequence's last document counts from 0 as a document of its own. So a token costs 5
bytes on disk instead of 12 with labels and positions written out.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np

IGNORE = -100


def write(path: Path, input_ids: np.ndarray, loss_mask: np.ndarray, documents: np.ndarray) -> None:
    from safetensors.numpy import save_file

    save_file({"input_ids": input_ids, "loss_mask": loss_mask, "documents": documents}, str(path),
              metadata={"max_length": str(input_ids.shape[1])})


def columns(input_ids: np.ndarray, loss_mask: np.ndarray, documents: np.ndarray) -> dict[str, np.ndarray]:
    """input_ids, labels and position_ids (int32, n x max_length) of packed sequences, as
    training feeds them; `documents` name sequences by their row in these arrays."""
    n, length = input_ids.shape
    restarts = np.zeros((n, length + 1), dtype=bool)  # (a last column for sequences with no padding)
    restarts[:, 0] = True
    restarts[documents[:, 0], documents[:, 1]] = True
    ends = np.zeros(n, dtype=np.int64)
    np.maximum.at(ends, documents[:, 0], documents[:, 1] + documents[:, 2])
    restarts[np.arange(n), ends] = True  # the padding after the last document
    at = np.arange(length)
    starts = np.maximum.accumulate(np.where(restarts[:, :length], at, 0), axis=1)
    return {"input_ids": input_ids.astype(np.int32),
            "labels": np.where(loss_mask.astype(bool), input_ids, IGNORE).astype(np.int32),
            "position_ids": (at - starts).astype(np.int32)}


def read(path: Path, first: int = 0, count: int | None = None) -> dict[str, np.ndarray]:
    """columns() of a shard's sequences first .. first + count (all by default)."""
    from safetensors import safe_open

    with safe_open(str(path), "np") as f:
        n = f.get_slice("input_ids").get_shape()[0]
        first = min(first, n)
        stop = n if count is None else min(first + count, n)
        documents = f.get_tensor("documents")
        documents = documents[(documents[:, 0] >= first) & (documents[:, 0] < stop)] - [first, 0, 0]

        def rows(name):  # safetensors refuses an empty slice ([n:n]); none asked for is rare, so read all, keep none
            return f.get_slice(name)[first:stop] if stop > first else f.get_tensor(name)[:0]

        return columns(rows("input_ids"), rows("loss_mask"), documents)
