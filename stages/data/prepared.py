"""Prepared rows, as the first pass (stages/data/sources.py) leaves them in chunk files:
what the second pass reads, as arrays over every row of every source, and a row's record or
tokens read back only where needed (near dedupe's comparisons, held-out rows, shard writing).
"""
from __future__ import annotations

import functools
import json
from pathlib import Path

import numpy as np

from stages.data import rows


def by_chunk(chunk_of: np.ndarray):
    """(chunk, positions in chunk_of) for each chunk named in chunk_of, in chunk order."""
    for c in np.unique(chunk_of):
        yield c, np.flatnonzero(chunk_of == c)


def chunk_docs(path: Path, src, rows_at: np.ndarray, kind) -> list[dict]:
    """The tokenized documents of some rows of one prepared chunk: each of the kind's sides' ids
    and mask (both sides of a pair), and the record fields it keeps beside them (a prompt's
    reference answer)."""
    from safetensors import safe_open

    docs = [{} for _ in rows_at]
    with safe_open(str(path), "np") as f:
        for key in kind.SIDES:
            offsets, ids, mask = (f.get_tensor(k) for k in (f"{key}_offsets", key, key.replace("ids", "mask")))
            for doc, i in zip(docs, rows_at):
                lo, hi = offsets[i], offsets[i + 1]
                doc[key], doc[key.replace("ids", "mask")] = ids[lo:hi], mask[lo:hi]
    if kind.BESIDE:
        for doc, record in zip(docs, chunk_records(path, src, rows_at, kind)):
            doc.update({field: record[field] for field in kind.BESIDE})
    return docs


def chunk_records(path: Path, src, rows_at, kind) -> list[dict]:
    """The canonical records of some rows of one prepared chunk."""
    stored, bounds, from_source = chunk_rows(path)
    return [stored_record(stored[bounds[i]: bounds[i + 1] - 1], from_source, src, kind) for i in rows_at]


@functools.lru_cache(maxsize=64)
def chunk_rows(path: Path):
    """A prepared chunk's rows as stored (mapped, so reading a few rows reads only their pages),
    where each begins, and whether they are source lines; kept open while near dedupe and the
    shard writer ask for rows of the same chunks again and again."""
    import mmap

    from safetensors import safe_open

    with safe_open(str(path), "np") as f:
        from_source, bounds = f.metadata()["rows"] == "source", f.get_tensor("row_offsets")
    with open(path.with_suffix(".rows"), "rb") as f:
        return mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ), bounds, from_source


class Prepared:
    """Every prepared row of a recipe's sources, in order: what cleaning and the length rules
    read, as arrays over all rows (`lengths`: tokens of the document, or of a pair's chosen
    side; `longest`: of its longer side; `source` and `row`: which source and which row of it,
    counted from 1), and each row's record, lines or tokens read where needed. `kind` is the data
    kind's module."""

    def __init__(self, parts: list[Path], sources, kind):
        from safetensors import safe_open

        self.kind = kind
        listed = [(i, path) for i, part in enumerate(parts) for path in sorted(part.glob("chunk-*.safetensors"))]
        self.chunks = [(path, sources[i]) for i, path in listed]
        facts = {key: [] for key in ("fingerprint", "repetition", "split", "loss_tokens", "lengths", "longest",
                                     "source", "row")}
        before = {part: json.loads((part / "stats.json").read_text())["rows_before"] for part in parts}
        for i, path in listed:
            with safe_open(str(path), "np") as f:
                for key in ("fingerprint", "repetition", "split", "loss_tokens"):
                    facts[key].append(f.get_tensor(key))
                lengths = [np.diff(f.get_tensor(f"{key}_offsets")) for key in kind.SIDES]
                job = int(path.stem.split("-")[1])
                facts["row"].append(before[path.parent][job] + f.get_tensor("position") + 1)
            facts["lengths"].append(lengths[0])
            facts["longest"].append(np.max(lengths, axis=0))
            facts["source"].append(np.full(len(lengths[0]), i, dtype=np.int64))
        sizes = np.array([len(a) for a in facts["split"]], dtype=np.int64)
        (self.fingerprint, self.repetition, self.split, self.loss_tokens, self.lengths, self.longest, self.source,
         self.row) = (np.concatenate(facts[key]) if self.chunks else np.zeros(0, dtype=np.int64) for key in facts)
        self.chunk_of = np.repeat(np.arange(len(self.chunks)), sizes)
        self.local = np.arange(len(self.chunk_of)) - np.repeat(np.cumsum(sizes) - sizes, sizes)

    def drops(self, rows_at: np.ndarray, codes: np.ndarray, reasons: tuple[str, ...], of=None) -> list[tuple]:
        """(source, row, reason, the (source, row) it repeats or None) of each row of rows_at whose
        code is not 0 (1 + the index in reasons); `of` names what each one repeats (-1: nothing)."""
        place = lambda i: (int(self.source[i]), int(self.row[i]))  # noqa: E731
        return [(*place(rows_at[k]), reasons[codes[k] - 1], place(of[k]) if of is not None and of[k] >= 0 else None)
                for k in np.flatnonzero(codes).tolist()]

    def signature_chunks(self):
        from safetensors import safe_open

        for path, _ in self.chunks:
            with safe_open(str(path), "np") as f:
                yield f.get_tensor("signature")

    def records(self, rows_at: np.ndarray):
        """The records of these rows (in increasing order), a chunk at a time."""
        for c, where in by_chunk(self.chunk_of[rows_at]):
            yield from chunk_records(*self.chunks[c], self.local[rows_at[where]], self.kind)

    def lines(self, rows_at: np.ndarray):
        """The lines cleaning reads of these rows (in increasing order)."""
        return (self.kind.lines(record) for record in self.records(rows_at))

    def loss_up_to(self, rows_at: np.ndarray, cut: int) -> np.ndarray:
        """Loss tokens among the first `cut` tokens of each of these rows (both sides of a pair)."""
        out = np.zeros(len(rows_at), dtype=np.int64)
        for c, where in by_chunk(self.chunk_of[rows_at]):
            for k, doc in zip(where, chunk_docs(*self.chunks[c], self.local[rows_at[where]], self.kind)):
                out[k] = sum(int(doc[key.replace("ids", "mask")][:cut].sum()) for key in self.kind.SIDES)
        return out


def stored_record(line: bytes, from_source: bool, src, kind) -> dict:
    """A prepared row's canonical record: its source line converted again, or the stored record."""
    row = json.loads(line)
    return rows.convert(row, src.format, kind) if from_source else row
