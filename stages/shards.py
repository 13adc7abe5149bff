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
import functools
import json
import os
from collections import Counter
from pathlib import Path

import blake3
import numpy as np

from stages import cleaning, rows, template
from stages.errors import UserError
from stages.word_cache import encode_texts

IGNORE = -100
PACK_WINDOW = 65536  # documents packed together (and held in memory) at once
BLOCK_BYTES = 1 << 22  # JSON Lines a worker reads and prepares at once (~1,500 chat rows)
CHUNK_ROWS = 4096  # rows of other file types the main process reads and hands to a worker at once
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


def split_hash(fingerprint: bytes, seed: int) -> int:
    """A stable split: a row's side depends on its own (normalized) content alone, not on its
    neighbours. The row is held out when this 32-bit hash is below fraction * 2**32."""
    return int.from_bytes(blake3.blake3(f"{seed}\0".encode() + fingerprint).digest(length=4), "big")


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


def label_of(src) -> str:
    return src.path if src.path is not None else f"{src.hub}@{src.revision}"


def source_jobs(src, root: Path):
    """One source's reading work for the workers, in file order: blocks of a JSON Lines file
    (which the workers parse; see rows.jsonl_blocks) or lists of (where, raw row) read here,
    for the other file types and the hub."""
    if src.path is not None:
        fmt = rows.file_format(src.path) if src.file_format == "auto" else src.file_format
        if fmt == "jsonl":
            path = root / src.path
            for block in rows.jsonl_blocks(path, BLOCK_BYTES):
                yield block if isinstance(block, bytes) else (str(path), *block)
            return
        raw = rows.read_local(root / src.path, src.path, fmt)
    else:
        raw = rows.read_hub(src.hub, src.revision, src.subset, src.split)
    yield from chunks_of(raw, CHUNK_ROWS)


def job_rows(job):
    """(where, raw row or BadRow, the line as stored or None) of each row of a job. For a block
    of JSON Lines `where` is the line's index in the block, and the line is kept as it is."""
    if isinstance(job, list):
        for where, row in job:
            yield where, row, None
        return
    if isinstance(job, tuple):
        path, offset, length = job
        with open(path, "rb") as f:
            f.seek(offset)
            job = f.read(length)
    for where, (line, row) in enumerate(rows.jsonl_rows(job)):
        yield where, row, line


def job_records(job, src, data, kind: str) -> tuple[list[dict], list[bytes], dict]:
    """The canonical records of a job's rows and each row as stored (its JSON line, or the record
    as JSON where the row did not come from one), with what happened to the others: rows in,
    drops by reason, and where on_error is fail the first bad row as (where, message)."""
    records, stored, dropped = [], [], Counter()
    outcome = {"rows_in": 0, "dropped": dropped, "error": None}
    for where, row, line in job_rows(job):
        outcome["rows_in"] += 1
        try:
            if isinstance(row, rows.BadRow):
                raise row
            record = rows.convert(row, src.format, kind)
        except rows.BadRow as e:
            if data.on_error == "skip" or e.reason == "blank_line":
                dropped[e.reason] += 1
                continue
            outcome["error"] = (where, str(e))
            break
        if not all(a.strip() for a in rows.answers(record)):
            dropped["empty_answer"] += 1
            continue
        records.append(record)
        stored.append(line if line is not None else json.dumps(record, ensure_ascii=False, sort_keys=True).encode())
    return records, stored, outcome


class SourceCount:
    """The outcomes of one source's jobs, taken in file order: rows in, drops by reason, and the
    first bad row (on_error: fail) raised as a one-line error naming its file:line."""

    def __init__(self, src):
        self.label, self.rows_in, self.dropped = label_of(src), 0, Counter()

    def take(self, outcome: dict) -> None:
        if outcome["error"]:
            where, message = outcome["error"]
            if isinstance(where, int):  # a line of a JSON Lines block: all lines before it are counted
                where = f"{self.label}:{self.rows_in + where + 1}"
            raise UserError(f"{where}: {message}; fix the row or set data.on_error: skip")
        self.rows_in += outcome["rows_in"]
        self.dropped.update(outcome["dropped"])


def tokenize(tok, kind: str, batch: list[dict]) -> list[dict]:
    """Token ids and loss labels of each record (two sequences for a preference pair)."""
    if kind == "chat":
        return [{"ids": ids, "mask": mask} for ids, mask in template.encode_chats(tok, [r["messages"] for r in batch])]
    if kind == "text":
        enc = encode_texts(tok, [r["text"] for r in batch])
        return [{"ids": np.append(ids, tok.eos_token_id), "mask": np.ones(len(ids) + 1, dtype=np.uint8)} for ids in enc]
    if kind == "preference":
        chosen = template.encode_chats(tok, [r["prompt"] + r["chosen"] for r in batch])
        rejected = template.encode_chats(tok, [r["prompt"] + r["rejected"] for r in batch])
        return [{"ids": c[0], "mask": c[1], "rejected_ids": r[0], "rejected_mask": r[1]}
                for c, r in zip(chosen, rejected)]
    prompts = [template.render(tok, r["prompt"], generation_prompt=True) for r in batch]
    return [{"ids": ids, "mask": np.zeros(len(ids), dtype=np.uint8), "reference": r["reference"]}
            for ids, r in zip(encode_texts(tok, prompts), batch)]


class Writer:
    """Accepts tokenized documents (arrays of ids and masks), applies length rules, and writes
    shards window by window."""

    def __init__(self, out: Path, kind: str, data, pad_id: int, dropped: Counter):
        self.out, self.kind, self.data, self.pad_id, self.dropped = out / "train", kind, data, pad_id, dropped
        self.out.mkdir()
        self.window: list[dict] = []
        self._buffers = [np.empty((0, data.max_length), dtype=np.int32)] * 3
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
            doc = {k: v if isinstance(v, str) else v[:L] for k, v in doc.items()}
            self.counts["truncated_kept"] += 1
        loss_tokens = int(doc["mask"].sum()) + int(doc["rejected_mask"].sum() if "rejected_mask" in doc else 0)
        if self.kind != "prompt" and not loss_tokens:
            self.dropped["no_loss_tokens"] += 1
            return
        self.counts["documents"] += 1
        self.counts["tokens"] += len(doc["ids"])
        self.counts["loss_tokens"] += loss_tokens
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
        input_ids, labels, position_ids = self.buffers(n)
        input_ids.fill(self.pad_id)
        labels.fill(IGNORE)
        counting = np.arange(L, dtype=np.int32)
        boundaries = []  # (sequence, start, length) of every document
        for s, members in enumerate(bins):
            at = 0
            for d in members:
                ids, k = docs[d]["ids"], len(docs[d]["ids"])
                input_ids[s, at: at + k] = ids
                labels[s, at: at + k] = np.where(docs[d]["mask"].view(bool), ids, IGNORE)
                position_ids[s, at: at + k] = counting[:k]
                boundaries.append((s, at, k))
                at += k
            position_ids[s, at:] = counting[: L - at]  # padding is its own document, with no loss
        save_file({"input_ids": input_ids, "labels": labels, "position_ids": position_ids,
                   "documents": np.array(boundaries, dtype=np.int32).reshape(-1, 3)},
                  str(path), metadata={"max_length": str(L)})
        self.counts["sequences"] += n

    def buffers(self, n: int) -> list[np.ndarray]:
        """Three n x max_length int32 arrays, reused from window to window: fresh ones cost a
        page fault per 4 KiB written."""
        if len(self._buffers[0]) < n:
            self._buffers = [np.empty((n, self.data.max_length), dtype=np.int32) for _ in range(3)]
        return [b[:n] for b in self._buffers]

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


def part_inputs(ctx, src, kind: str) -> dict:
    """What one source's prepared rows depend on: its content and the per-row settings only,
    so editing one file (or a global setting such as max_length) leaves other files' work reusable."""
    d = ctx.recipe.data
    return {"code": ctx.inputs["code"], "tokenizer": ctx.inputs["upstream"]["base"],
            "source": src.model_dump(mode="json"), "content": ctx.inputs["extra"].get(src.path),
            "kind": kind, "on_error": d.on_error, "seed": d.seed,
            "near": [d.dedupe.ngram, d.dedupe.num_perm] if d.dedupe.near_threshold else None}


def prepare_chunk(chunk: list[dict], kind: str, tok, data) -> dict[str, np.ndarray]:
    """Cleaning facts and tokens of a chunk of rows, as arrays (runs in a worker process)."""
    arrays = cleaning.describe(chunk, data.dedupe)
    arrays["split"] = np.array([split_hash(f.tobytes(), data.seed) for f in arrays["fingerprint"]], dtype=np.uint32)
    docs = [doc for i in range(0, len(chunk), TOKENIZE_BATCH) for doc in tokenize(tok, kind, chunk[i: i + TOKENIZE_BATCH])]
    for key in ("ids", "rejected_ids") if kind == "preference" else ("ids",):
        mask_key = key.replace("ids", "mask")
        arrays[key] = np.concatenate([np.asarray(doc[key], dtype=np.int32) for doc in docs])
        arrays[f"{key}_offsets"] = np.cumsum([0] + [len(doc[key]) for doc in docs]).astype(np.int64)
        arrays[mask_key] = np.concatenate([np.asarray(doc[mask_key], dtype=np.uint8) for doc in docs])
    return arrays


_worker: dict = {}


def _start_worker(base: str) -> None:
    from transformers import AutoTokenizer

    _worker["tok"] = AutoTokenizer.from_pretrained(base)


def prepare_job(index: int, job, src, kind: str, data, out: Path) -> dict:
    """A worker's whole share of one job: read, convert, describe, tokenize, and write
    chunk-<index> (arrays, and the rows as stored) into `out`. Returns job_records' outcome."""
    from safetensors.numpy import save_file

    records, stored, outcome = job_records(job, src, data, kind)
    if records and not outcome["error"]:
        arrays = prepare_chunk(records, kind, _worker["tok"], data)
        arrays["row_offsets"] = np.cumsum([0] + [len(line) + 1 for line in stored], dtype=np.int64)
        save_file(arrays, str(out / f"chunk-{index:05d}.safetensors"),
                  metadata={"rows": "records" if isinstance(job, list) else "source"})
        (out / f"chunk-{index:05d}.rows").write_bytes(b"".join(line + b"\n" for line in stored))
    return outcome


def chunks_of(iterable, size: int):
    chunk = []
    for item in iterable:
        chunk.append(item)
        if len(chunk) == size:
            yield chunk
            chunk = []
    if chunk:
        yield chunk


def prepare_source(ctx, src, kind: str, out: Path) -> None:
    """Everything per row of one source that does not depend on other rows: read, convert,
    describe for cleaning, tokenize. Jobs go to one worker process per core, at most two each
    in flight, so memory stays bounded on large files; each worker writes its own chunk files,
    and outcomes are taken in file order, so the first bad row is the one reported."""
    from collections import deque
    from concurrent.futures import ProcessPoolExecutor
    from multiprocessing import get_context

    from tqdm import tqdm

    count = SourceCount(src)
    progress = tqdm(desc=label_of(src), unit=" rows", mininterval=2)

    def take(future) -> None:
        count.take(future.result())
        progress.update(future.result()["rows_in"])

    workers = os.cpu_count() or 1
    with ProcessPoolExecutor(workers, mp_context=get_context("fork"), initializer=_start_worker,
                             initargs=(str(ctx.upstream["base"]),)) as pool:
        pending = deque()
        try:
            for index, job in enumerate(source_jobs(src, ctx.root)):
                pending.append(pool.submit(prepare_job, index, job, src, kind, ctx.recipe.data, out))
                while len(pending) > 2 * workers or (pending and pending[0].done()):
                    take(pending.popleft())
            while pending:
                take(pending.popleft())
        except BaseException:
            pool.shutdown(cancel_futures=True)
            raise
    progress.close()
    (out / "stats.json").write_text(json.dumps({"rows_in": count.rows_in, "dropped": dict(sorted(count.dropped.items()))},
                                               indent=1, sort_keys=True) + "\n")


def prepared_rows(part: Path, src, kind: str):
    """(cleaning facts, split hash, tokenized doc, record) for each row of a prepared source, in
    order; `record` returns the row's canonical record (parsed only where it is needed)."""
    from safetensors import safe_open
    from safetensors.numpy import load_file

    for path in sorted(part.glob("chunk-*.safetensors")):
        a = load_file(str(path))
        with safe_open(str(path), "np") as f:
            from_source = f.metadata()["rows"] == "source"
        stored, bounds = path.with_suffix(".rows").read_bytes(), a["row_offsets"].tolist()
        sides = ("ids", "rejected_ids") if kind == "preference" else ("ids",)
        offsets = {key: a[f"{key}_offsets"].tolist() for key in sides}
        fingerprints, repetition, split = a["fingerprint"], a["repetition"].tolist(), a["split"].tolist()
        for i in range(len(bounds) - 1):
            line = stored[bounds[i]: bounds[i + 1] - 1]
            record = functools.partial(stored_record, line, from_source, src, kind)
            doc = {}
            for key in sides:
                lo, hi = offsets[key][i], offsets[key][i + 1]
                doc[key], doc[key.replace("ids", "mask")] = a[key][lo:hi], a[key.replace("ids", "mask")][lo:hi]
            if kind == "prompt":
                doc["reference"] = record()["reference"]
            yield {"fingerprint": fingerprints[i].tobytes(), "repetition": repetition[i]}, split[i], doc, record


def stored_record(line: bytes, from_source: bool, src, kind: str) -> dict:
    """A prepared row's canonical record: its source line converted again, or the stored record."""
    row = json.loads(line)
    return rows.convert(row, src.format, kind) if from_source else row


def build(ctx, out: Path) -> None:
    from safetensors import safe_open
    from transformers import AutoTokenizer

    data, kind = ctx.recipe.data, rows.KIND_OF_METHOD[ctx.recipe.train.method]
    tok = AutoTokenizer.from_pretrained(ctx.upstream["base"])
    dropped, rows_in, parts = Counter(), {}, []
    for src in data.sources:
        part, reused = ctx.cached("source", part_inputs(ctx, src, kind),
                                  lambda tmp, src=src: prepare_source(ctx, src, kind, tmp))
        ctx.log.info("%s: %s", label_of(src), "prepared rows reused from the store" if reused
                     else "read, cleaned and tokenized")
        part_stats = json.loads((part / "stats.json").read_text())
        rows_in[label_of(src)] = part_stats["rows_in"]
        dropped.update(part_stats["dropped"])
        parts.append(part)
    signatures = (safe_open(str(chunk), "np").get_tensor("signature")
                  for part in parts for chunk in sorted(part.glob("chunk-*.safetensors")))
    cleaner = cleaning.Cleaner(data.dedupe, data.filters, signatures if data.dedupe.near_threshold else ())
    writer = Writer(out, kind, data, tok.pad_token_id, dropped)
    (out / "heldout").mkdir()
    kept_heldout, cutoff = 0, data.heldout_fraction * 2**32
    with open(out / "heldout" / "heldout.jsonl", "w", encoding="utf-8") as heldout:
        for part, src in zip(parts, data.sources):
            for facts, split, doc, record in prepared_rows(part, src, kind):
                reason = cleaner.drop_reason(**facts, record=record)
                if reason:
                    dropped[reason] += 1
                elif split < cutoff:
                    heldout.write(json.dumps(record(), ensure_ascii=False, sort_keys=True) + "\n")
                    kept_heldout += 1
                else:
                    writer.add(doc)
    writer.flush()
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
