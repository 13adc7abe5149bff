"""shards: the training data, read, cleaned, tokenized, masked and packed + stats.json.

Rows stream from each source (stages/rows.py turns any supported format into the
record the training method consumes), go through cleaning (stages/cleaning.py:
exact and near dedupe, empty-answer and repetition filters) and a stable held-out
split, then are tokenized with the model's own chat template, loss on assistant
tokens only (stages/template.py). Sequences are packed best-fit-decreasing in
windows, so memory stays bounded; position ids restart per document and document
boundaries are stored. Shards are safetensors files (memory-mapped), written in a
deterministic order. Every row read is kept or counted under a drop reason.
"""
from __future__ import annotations

import bisect
import json
from collections import Counter
from pathlib import Path

import blake3
import numpy as np

from stages import cleaning, rows, template
from stages.errors import UserError

IGNORE = -100
PACK_WINDOW = 65536  # documents packed together (and held in memory) at once
TOKENIZE_BATCH = 1024


def extra_inputs(recipe, root: Path, store) -> dict:
    """Each local source file's content digest is an input of the key (via the stat cache)."""
    digests = {}
    for i, src in enumerate(recipe.data.sources):
        if src.path is None:
            continue  # a hub source is named by id and pinned revision, both in the recipe
        p = root / src.path
        if not p.is_file():
            raise UserError(f"recipe data.sources.{i}.path: {src.path} not found; "
                            f"fix the path or create the file")
        digests[src.path] = store.stat.digest(p)
    return digests


def is_heldout(norm: str, fraction: float, seed: int) -> bool:
    """A stable split: a row's side depends on its own content alone, not on its neighbours."""
    h = int(blake3.blake3(f"{seed}\0{norm}".encode()).hexdigest()[:8], 16)
    return h < fraction * 2**32


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


def records(data, kind: str, root: Path, dropped: Counter, rows_in: Counter):
    """Canonical records from every source, in recipe order; bad rows fail (file:line) or are counted."""
    for src in data.sources:
        if src.path is not None:
            fmt = rows.file_format(src.path) if src.file_format == "auto" else src.file_format
            raw, label = rows.read_local(root / src.path, src.path, fmt), src.path
        else:
            raw, label = rows.read_hub(src.hub, src.revision, src.subset, src.split), f"{src.hub}@{src.revision}"
        for where, row in raw:
            rows_in[label] += 1
            try:
                if isinstance(row, rows.BadRow):
                    raise row
                record = rows.convert(row, src.format, kind)
            except rows.BadRow as e:
                if data.on_error == "skip" or e.reason == "blank_line":
                    dropped[e.reason] += 1
                    continue
                raise UserError(f"{where}: {e}; fix the row or set data.on_error: skip") from None
            if not all(a.strip() for a in rows.answers(record)):
                dropped["empty_answer"] += 1
                continue
            yield record


def tokenize(tok, kind: str, batch: list[dict]) -> list[dict]:
    """Token ids and loss labels of each record (two sequences for a preference pair)."""
    if kind == "chat":
        return [{"ids": ids, "mask": mask} for ids, mask in template.encode_chats(tok, [r["messages"] for r in batch])]
    if kind == "text":
        enc = tok([r["text"] for r in batch], add_special_tokens=False)["input_ids"]
        return [{"ids": ids + [tok.eos_token_id], "mask": [1] * (len(ids) + 1)} for ids in enc]
    if kind == "preference":
        chosen = template.encode_chats(tok, [r["prompt"] + r["chosen"] for r in batch])
        rejected = template.encode_chats(tok, [r["prompt"] + r["rejected"] for r in batch])
        return [{"ids": c[0], "mask": c[1], "rejected_ids": r[0], "rejected_mask": r[1]}
                for c, r in zip(chosen, rejected)]
    prompts = [template.render(tok, r["prompt"], generation_prompt=True) for r in batch]
    enc = tok(prompts, add_special_tokens=False)["input_ids"]
    return [{"ids": ids, "mask": [0] * len(ids), "reference": r["reference"]} for ids, r in zip(enc, batch)]


class Writer:
    """Accepts tokenized documents, applies length rules, and writes shards window by window."""

    def __init__(self, out: Path, kind: str, data, pad_id: int, dropped: Counter):
        self.out, self.kind, self.data, self.pad_id, self.dropped = out / "train", kind, data, pad_id, dropped
        self.out.mkdir()
        self.window: list[dict] = []
        self.shards = 0
        self.counts = Counter()

    def add(self, doc: dict) -> None:
        f, L = self.data.filters, self.data.max_length
        n = max(len(doc["ids"]), len(doc.get("rejected_ids", ())))
        if n < f.min_tokens:
            self.dropped["too_short"] += 1
            return
        if (f.max_tokens and n > f.max_tokens) or (n > L and self.data.truncation == "drop"):
            self.dropped["too_long"] += 1
            return
        if n > L:
            doc = {k: v[:L] if isinstance(v, list) else v for k, v in doc.items()}
            self.counts["truncated_kept"] += 1
        if self.kind != "prompt" and not any(doc["mask"]):
            self.dropped["no_loss_tokens"] += 1
            return
        self.counts["documents"] += 1
        self.counts["tokens"] += len(doc["ids"])
        self.counts["loss_tokens"] += sum(doc["mask"]) + sum(doc.get("rejected_mask", ()))
        self.window.append(doc)
        if len(self.window) == PACK_WINDOW:
            self.flush()

    def flush(self) -> None:
        if not self.window:
            return
        path = self.out / f"shard-{self.shards:05d}.safetensors"
        if self.kind in ("chat", "text"):
            self.write_packed(path)
        else:
            self.write_ragged(path)
        self.shards += 1
        self.window = []

    def write_packed(self, path: Path) -> None:
        from safetensors.numpy import save_file

        L, docs = self.data.max_length, self.window
        bins = pack([len(d["ids"]) for d in docs], L)
        n = len(bins)
        input_ids = np.full((n, L), self.pad_id, dtype=np.int32)
        labels = np.full((n, L), IGNORE, dtype=np.int32)
        position_ids = np.zeros((n, L), dtype=np.int32)
        boundaries = []  # (sequence, start, length) of every document
        for s, members in enumerate(bins):
            at = 0
            for d in members:
                ids = np.array(docs[d]["ids"], dtype=np.int32)
                k = len(ids)
                input_ids[s, at: at + k] = ids
                labels[s, at: at + k] = np.where(np.array(docs[d]["mask"], dtype=bool), ids, IGNORE)
                position_ids[s, at: at + k] = np.arange(k)
                boundaries.append((s, at, k))
                at += k
            position_ids[s, at:] = np.arange(L - at)  # padding is its own document, with no loss
        save_file({"input_ids": input_ids, "labels": labels, "position_ids": position_ids,
                   "documents": np.array(boundaries, dtype=np.int32).reshape(-1, 3)},
                  str(path), metadata={"max_length": str(L)})
        self.counts["sequences"] += n

    def write_ragged(self, path: Path) -> None:
        """Unpacked documents as flat arrays plus offsets (preference pairs, prompts)."""
        from safetensors.numpy import save_file

        def flat(key, mask_key=None):
            seqs = [d[key] for d in self.window]
            arrays = {f"{key}": np.concatenate([np.array(s, dtype=np.int32) for s in seqs]),
                      f"{key}_offsets": np.cumsum([0] + [len(s) for s in seqs]).astype(np.int64)}
            if mask_key:
                arrays[f"{key}_labels"] = np.concatenate([np.where(np.array(d[mask_key], dtype=bool),
                                                                   np.array(d[key], dtype=np.int32), IGNORE)
                                                          for d in self.window]).astype(np.int32)
            return arrays

        if self.kind == "preference":
            tensors = {**flat("ids", "mask"), **flat("rejected_ids", "rejected_mask")}
        else:
            tensors = flat("ids")
            with open(path.with_suffix(".references.jsonl"), "w") as f:
                for d in self.window:
                    f.write(json.dumps(d["reference"], ensure_ascii=False) + "\n")
        save_file(tensors, str(path))


def build(ctx, out: Path) -> None:
    from tqdm import tqdm
    from transformers import AutoTokenizer

    data, kind = ctx.recipe.data, rows.KIND_OF_METHOD[ctx.recipe.train.method]
    tok = AutoTokenizer.from_pretrained(ctx.upstream["base"])
    dropped, rows_in = Counter(), Counter()
    cleaner = cleaning.Cleaner(data.dedupe, data.filters)
    writer = Writer(out, kind, data, tok.pad_token_id, dropped)
    (out / "heldout").mkdir()
    heldout = open(out / "heldout" / "heldout.jsonl", "w", encoding="utf-8")
    kept_heldout, batch = 0, []
    progress = tqdm(desc="rows", unit=" rows", mininterval=2)

    def flush_batch():
        for doc in tokenize(tok, kind, batch):
            writer.add(doc)
        batch.clear()

    for record in records(data, kind, ctx.root, dropped, rows_in):
        progress.update()
        norm = cleaning.normalized(record)
        reason = cleaner.drop_reason(norm, rows.answers(record))
        if reason:
            dropped[reason] += 1
            continue
        if is_heldout(norm, data.heldout_fraction, data.seed):
            heldout.write(json.dumps(record, ensure_ascii=False, sort_keys=True) + "\n")
            kept_heldout += 1
            continue
        batch.append(record)
        if len(batch) == TOKENIZE_BATCH:
            flush_batch()
    flush_batch()
    writer.flush()
    heldout.close()
    progress.close()
    if not writer.shards:
        raise UserError(f"data: no training rows left after cleaning (dropped {dict(dropped)}); "
                        f"check the sources and filters")

    c = writer.counts
    stats = {
        "kind": kind,
        "rows_in": dict(sorted(rows_in.items())),
        "rows_in_total": sum(rows_in.values()),
        "kept": {"train": c["documents"], "heldout": kept_heldout},
        "dropped": dict(sorted(dropped.items())),
        "truncated_kept": c["truncated_kept"],
        "tokens": c["tokens"],
        "loss_tokens": c["loss_tokens"],
        "shards": writer.shards,
    }
    if kind in ("chat", "text"):
        stats.update(sequences=c["sequences"], sequence_length=data.max_length,
                     packing_efficiency=round(c["tokens"] / (c["sequences"] * data.max_length), 6))
    assert stats["rows_in_total"] == c["documents"] + kept_heldout + sum(dropped.values()), stats
    (out / "stats.json").write_text(json.dumps(stats, indent=1, sort_keys=True) + "\n")
    ctx.log.info("%d rows in: %d train, %d held out, dropped %s", stats["rows_in_total"], c["documents"],
                 kept_heldout, stats["dropped"])
    if "packing_efficiency" in stats:
        ctx.log.info("packed %d documents (%d tokens) into %d sequences of %d: efficiency %.3f",
                     c["documents"], c["tokens"], c["sequences"], data.max_length, stats["packing_efficiency"])
