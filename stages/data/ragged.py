"""The ragged shard format: rows kept whole, one after another, for the data kinds that are not
packed (preference pairs, prompts): what the shards stage writes and training reads
(stages/train/pairs.py).

A shard is a safetensors file holding, for each side of a row (`ids`; a pair's `rejected_ids`
too), the flat int32 token ids, int64 `<side>_offsets` (row i is ids[offsets[i]:offsets[i + 1]])
and, for a kind that learns, int32 `<side>_labels` (the id where the loss mask is 1, else
IGNORE). A record field kept beside each row (a prompt's reference answer) is one JSON line a row
in a file beside the shard, named by the kind (shard-00000.references.jsonl).
"""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from stages.data.packed import IGNORE


def write(path: Path, docs: list[dict], sides: tuple[str, ...], labeled: bool, beside: dict[str, str]) -> None:
    """The documents (each side's ids and mask, and the fields kept beside) as one shard."""
    from safetensors.numpy import save_file

    tensors = {}
    for key in sides:
        tensors[key] = np.concatenate([d[key] for d in docs]).astype(np.int32)
        tensors[f"{key}_offsets"] = np.cumsum([0] + [len(d[key]) for d in docs]).astype(np.int64)
        if labeled:
            mask = key.replace("ids", "mask")
            tensors[f"{key}_labels"] = np.concatenate([np.where(d[mask].view(bool), d[key], IGNORE)
                                                       for d in docs]).astype(np.int32)
    for field, suffix in beside.items():
        with open(path.with_suffix("." + suffix), "w") as f:
            for d in docs:
                f.write(json.dumps(d[field], ensure_ascii=False) + "\n")
    save_file(tensors, str(path))


def shard_files(shards: Path) -> list[Path]:
    """The training shards of a shards artifact, in order."""
    return sorted((shards / "train").glob("shard-*.safetensors"))


def read(path: Path) -> dict[str, np.ndarray]:
    from safetensors.numpy import load_file

    return load_file(str(path))


def beside(path: Path, suffix: str) -> list:
    """The field kept beside each row of the shard at `path`, in order."""
    return [json.loads(line) for line in path.with_suffix("." + suffix).read_text().splitlines()]
