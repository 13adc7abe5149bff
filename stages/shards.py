"""shards: the training data, read, cleaned, tokenized, masked and packed + stats.json.

First pass, per source, by one worker process per core: a worker reads its block of
the file (stages/rows.py turns any supported format into the record the training
method consumes), describes each row for cleaning (stages/cleaning.py), tokenizes it
with the model's own chat template, loss on assistant tokens only (stages/template.py),
and writes the chunk's arrays. A source's chunks are kept in the store under their own
key, so an edit to one file of several prepares only that file again.

Second pass, over every row of every source in order, on arrays: exact and near
dedupe and the repetition filter, a stable held-out split, the length rules; then
documents are packed best-fit-decreasing, a window at a time (memory stays bounded),
into shards written by the workers in the format of stages/packed.py (position ids
restart per document; document boundaries are stored), in a deterministic order.
Every row read is kept or counted under a drop reason.
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

from stages import cleaning, packed, rows, template
from stages.errors import UserError
from stages.packed import IGNORE
from stages.word_cache import encode_texts

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


def sides(kind: str) -> tuple[str, ...]:
    """The token sequences of a row: a preference pair has two."""
    return ("ids", "rejected_ids") if kind == "preference" else ("ids",)


def by_chunk(chunk_of: np.ndarray):
    """(chunk, positions in chunk_of) for each chunk named in chunk_of, in chunk order."""
    for c in np.unique(chunk_of):
        yield c, np.flatnonzero(chunk_of == c)


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


def job_records(job, src, data, kind: str) -> tuple[list[dict], list[bytes], list[tuple], dict]:
    """The canonical records of a job's rows, each row as stored (its JSON line, or the record as
    JSON where the row did not come from one) and where it was (its position in the job, and
    `where`), with what happened to the others: rows in, drops by reason, and where on_error is
    fail the first bad row as (position, where, message)."""
    records, stored, places, dropped = [], [], [], Counter()
    outcome = {"rows_in": 0, "dropped": dropped, "error": None}
    for position, (where, row, line) in enumerate(job_rows(job)):
        outcome["rows_in"] += 1
        try:
            if isinstance(row, rows.BadRow):
                raise row
            record = rows.convert(row, src.format, kind)
        except rows.BadRow as e:
            if data.on_error == "skip" or e.reason == "blank_line":
                dropped[e.reason] += 1
                continue
            outcome["error"] = (position, where, str(e))
            break
        if not all(a.strip() for a in rows.answers(record)):
            dropped["empty_answer"] += 1
            continue
        records.append(record)
        stored.append(line if line is not None else json.dumps(record, ensure_ascii=False, sort_keys=True).encode())
        places.append((position, where))
    return records, stored, places, outcome


class SourceCount:
    """The outcomes of one source's jobs, taken in file order: rows in, drops by reason, and the
    first bad row (on_error: fail) raised as a one-line error naming its file:line."""

    def __init__(self, src):
        self.label, self.rows_in, self.dropped = label_of(src), 0, Counter()

    def take(self, outcome: dict) -> None:
        if outcome["error"]:
            _, where, message = outcome["error"]
            if isinstance(where, int):  # a line of a JSON Lines block: all lines before it are counted
                where = f"{self.label}:{self.rows_in + where + 1}"
            raise UserError(f"{where}: {message}; fix the row or set data.on_error: skip")
        self.rows_in += outcome["rows_in"]
        self.dropped.update(outcome["dropped"])


def tokenize(tok, kind: str, batch: list[dict]) -> list[dict | template.Refused]:
    """Token ids and loss labels of each record (two sequences for a preference pair), or why
    the model's chat template refused it."""
    if kind == "chat":
        return [done if isinstance(done, template.Refused) else {"ids": done[0], "mask": done[1]}
                for done in template.encode_chats(tok, [r["messages"] for r in batch])]
    if kind == "text":
        enc = encode_texts(tok, [r["text"] for r in batch])
        return [{"ids": np.append(ids, tok.eos_token_id), "mask": np.ones(len(ids) + 1, dtype=np.uint8)} for ids in enc]
    if kind == "preference":
        chosen = template.encode_chats(tok, [r["prompt"] + r["chosen"] for r in batch])
        rejected = template.encode_chats(tok, [r["prompt"] + r["rejected"] for r in batch])
        return [c if isinstance(c, template.Refused) else r if isinstance(r, template.Refused) else
                {"ids": c[0], "mask": c[1], "rejected_ids": r[0], "rejected_mask": r[1]} for c, r in zip(chosen, rejected)]
    prompts = [template.render_or_refuse(tok, r["prompt"], generation_prompt=True) for r in batch]
    texts = [p for p in prompts if isinstance(p, str)]
    encoded = iter(encode_texts(tok, texts))
    return [p if isinstance(p, template.Refused) else
            {"ids": (ids := next(encoded)), "mask": np.zeros(len(ids), dtype=np.uint8), "reference": r["reference"]}
            for p, r in zip(prompts, batch)]


LENGTH_REASONS = ("too_short", "too_long", "no_loss_tokens")


def counted(codes: np.ndarray, reasons: tuple[str, ...]) -> dict[str, int]:
    """Drop counts by reason, from codes (0 kept, else 1 + the reason's index)."""
    return {r: int(n) for r, n in zip(reasons, np.bincount(codes, minlength=len(reasons) + 1)[1:]) if n}


def length_rules(longest: np.ndarray, loss: np.ndarray, loss_when_cut, data, kind: str):
    """The length rules, for documents whose longer side has `longest` tokens and `loss` tokens
    of loss: (codes, 0 kept else 1 + the index in LENGTH_REASONS; which are kept cut to
    max_length; loss tokens of each once cut). loss_when_cut(at) counts again the loss of the
    documents at `at` that are cut: some of it may lie past max_length."""
    f, L = data.filters, data.max_length
    codes = np.zeros(len(longest), dtype=np.int8)
    codes[longest < f.min_tokens] = 1
    too_long = (longest > L) if data.truncation == "drop" else np.zeros(len(longest), dtype=bool)
    if f.max_tokens:
        too_long |= longest > f.max_tokens
    codes[(codes == 0) & too_long] = 2
    cut = np.flatnonzero((codes == 0) & (longest > L))
    loss = loss.astype(np.int64)
    loss[cut] = loss_when_cut(cut)
    if kind != "prompt":
        codes[(codes == 0) & (loss == 0)] = 3
    return codes, cut[codes[cut] == 0], loss


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


def shard_buffers(n: int, L: int) -> tuple[np.ndarray, np.ndarray]:
    """n x L token and mask arrays, reused by a process from shard to shard: fresh ones cost a
    page fault per 4 KiB written."""
    have = _worker.get("buffers")
    if have is None or have[0].shape[0] < n or have[0].shape[1] != L:
        have = _worker["buffers"] = (np.empty((n, L), dtype=np.int32), np.empty((n, L), dtype=np.uint8))
    return have[0][:n], have[1][:n]


def write_ragged(path: Path, docs: list[dict], kind: str) -> None:
    """Unpacked documents as flat arrays plus offsets (preference pairs, prompts)."""
    from safetensors.numpy import save_file

    def flat(key, mask_key=None):
        arrays = {key: np.concatenate([d[key] for d in docs]).astype(np.int32),
                  f"{key}_offsets": np.cumsum([0] + [len(d[key]) for d in docs]).astype(np.int64)}
        if mask_key:
            arrays[f"{key}_labels"] = np.concatenate([np.where(d[mask_key].view(bool), d[key], IGNORE)
                                                      for d in docs]).astype(np.int32)
        return arrays

    if kind == "preference":
        tensors = {**flat("ids", "mask"), **flat("rejected_ids", "rejected_mask")}
    else:
        tensors = flat("ids")
        with open(path.with_suffix(".references.jsonl"), "w") as f:
            for d in docs:
                f.write(json.dumps(d["reference"], ensure_ascii=False) + "\n")
    save_file(tensors, str(path))


def write_shard(path: Path, chunks: list, at: np.ndarray, kind: str, L: int, pad_id: int) -> int:
    """One shard of documents, given as (chunk, row in it) and cut to L tokens; returns the
    sequences written (0 for the unpacked kinds). Runs in a worker."""
    docs = [None] * len(at)
    for c, where in by_chunk(at[:, 0]):
        for k, doc in zip(where, chunk_docs(*chunks[c], at[where, 1], kind)):
            docs[k] = {key: v if isinstance(v, str) else v[:L] for key, v in doc.items()}
    if kind in ("chat", "text"):
        return write_packed(path, docs, L, pad_id)
    write_ragged(path, docs, kind)
    return 0


def write_shards(out: Path, prepared, docs: np.ndarray, kind: str, L: int, pad_id: int) -> tuple[int, int]:
    """The documents at rows `docs`, in order, PACK_WINDOW to a shard; shards are written by one
    worker process per core. Returns (sequences, shards)."""
    from concurrent.futures import ProcessPoolExecutor
    from multiprocessing import get_context

    from tqdm import tqdm

    out.mkdir()
    windows = [docs[i: i + PACK_WINDOW] for i in range(0, len(docs), PACK_WINDOW)]
    with ProcessPoolExecutor(min(os.cpu_count() or 1, max(len(windows), 1)), mp_context=get_context("fork")) as pool:
        futures = [pool.submit(write_shard, out / f"shard-{k:05d}.safetensors", prepared.chunks,
                               np.stack([prepared.chunk_of[w], prepared.local[w]], axis=1), kind, L, pad_id)
                   for k, w in enumerate(windows)]
        sequences = sum(f.result() for f in tqdm(futures, desc="shards", unit=" shards"))
    return sequences, len(windows)


def part_inputs(ctx, src, kind: str) -> dict:
    """What one source's prepared rows depend on: its content and the per-row settings only,
    so editing one file (or a global setting such as max_length) leaves other files' work reusable."""
    d = ctx.recipe.data
    return {"code": ctx.inputs["code"], "tokenizer": ctx.inputs["upstream"]["base"],
            "source": src.model_dump(mode="json"), "content": ctx.inputs["extra"].get(src.path),
            "kind": kind, "on_error": d.on_error, "seed": d.seed,
            "near": [d.dedupe.ngram, d.dedupe.num_perm] if d.dedupe.near_threshold else None}


def prepare_chunk(records: list[dict], docs: list[dict], data, kind: str) -> dict[str, np.ndarray]:
    """Cleaning facts and tokens of a chunk of rows, as arrays (runs in a worker process)."""
    arrays = cleaning.describe(records, data.dedupe)
    arrays["split"] = np.array([split_hash(f.tobytes(), data.seed) for f in arrays["fingerprint"]], dtype=np.uint32)
    arrays["loss_tokens"] = np.zeros(len(docs), dtype=np.int64)
    for key in sides(kind):
        mask_key = key.replace("ids", "mask")
        arrays[key] = np.concatenate([np.asarray(doc[key], dtype=np.int32) for doc in docs])
        arrays[f"{key}_offsets"] = np.cumsum([0] + [len(doc[key]) for doc in docs]).astype(np.int64)
        arrays[mask_key] = np.concatenate([np.asarray(doc[mask_key], dtype=np.uint8) for doc in docs])
        arrays["loss_tokens"] += [int(doc[mask_key].sum()) for doc in docs]
    return arrays


_worker: dict = {}


def _start_worker(base: str) -> None:
    from transformers import AutoTokenizer

    _worker["tok"] = AutoTokenizer.from_pretrained(base)


def prepare_job(index: int, job, src, kind: str, data, out: Path) -> dict:
    """A worker's whole share of one job: read, convert, describe, tokenize, and write
    chunk-<index> (arrays, and the rows as stored) into `out`. Returns job_records' outcome."""
    from safetensors.numpy import save_file

    records, stored, places, outcome = job_records(job, src, data, kind)
    docs = [doc for i in range(0, len(records), TOKENIZE_BATCH)
            for doc in tokenize(_worker["tok"], kind, records[i: i + TOKENIZE_BATCH])]
    refused = [k for k, doc in enumerate(docs) if isinstance(doc, template.Refused)]
    if refused and data.on_error == "skip":
        outcome["dropped"]["template_refused"] += len(refused)
        kept = sorted(set(range(len(docs))) - set(refused))
        records, stored, docs = ([x[k] for k in kept] for x in (records, stored, docs))
    elif refused and (outcome["error"] is None or places[refused[0]][0] < outcome["error"][0]):
        outcome["error"] = (*places[refused[0]], f"the model's chat template refused it ({docs[refused[0]]})")
    if records and not outcome["error"]:
        arrays = prepare_chunk(records, docs, data, kind)
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
        outcome = future.result()
        count.take(outcome)
        progress.update(outcome["rows_in"])

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


def chunk_docs(path: Path, src, rows_at: np.ndarray, kind: str) -> list[dict]:
    """The tokenized documents of some rows of one prepared chunk (ids and masks, both sides of
    a pair, and a prompt's reference answer)."""
    from safetensors import safe_open

    docs = [{} for _ in rows_at]
    with safe_open(str(path), "np") as f:
        for key in sides(kind):
            offsets, ids, mask = (f.get_tensor(k) for k in (f"{key}_offsets", key, key.replace("ids", "mask")))
            for doc, i in zip(docs, rows_at):
                lo, hi = offsets[i], offsets[i + 1]
                doc[key], doc[key.replace("ids", "mask")] = ids[lo:hi], mask[lo:hi]
    if kind == "prompt":
        for doc, record in zip(docs, chunk_records(path, src, rows_at, kind)):
            doc["reference"] = record["reference"]
    return docs


def chunk_records(path: Path, src, rows_at, kind: str) -> list[dict]:
    """The canonical records of some rows of one prepared chunk."""
    stored, bounds, from_source = chunk_rows(path)
    return [stored_record(stored[bounds[i]: bounds[i + 1] - 1], from_source, src, kind) for i in rows_at]


@functools.lru_cache(maxsize=2)
def chunk_rows(path: Path) -> tuple[bytes, np.ndarray, bool]:
    """A prepared chunk's rows as stored, where each begins, and whether they are source lines
    (kept while near dedupe asks for records of the same chunk, row after row)."""
    from safetensors import safe_open

    with safe_open(str(path), "np") as f:
        from_source, bounds = f.metadata()["rows"] == "source", f.get_tensor("row_offsets")
    return path.with_suffix(".rows").read_bytes(), bounds, from_source


class Prepared:
    """Every prepared row of a recipe's sources, in order: what cleaning and the length rules
    read, as arrays over all rows (`lengths`: tokens of the document, or of a pair's chosen
    side; `longest`: of its longer side), and each row's record or tokens read where needed."""

    def __init__(self, parts: list[Path], sources, kind: str):
        from safetensors import safe_open

        self.kind = kind
        self.chunks = [(path, src) for part, src in zip(parts, sources) for path in sorted(part.glob("chunk-*.safetensors"))]
        facts = {key: [] for key in ("fingerprint", "repetition", "split", "loss_tokens", "lengths", "longest")}
        for path, _ in self.chunks:
            with safe_open(str(path), "np") as f:
                for key in ("fingerprint", "repetition", "split", "loss_tokens"):
                    facts[key].append(f.get_tensor(key))
                lengths = [np.diff(f.get_tensor(f"{key}_offsets")) for key in sides(kind)]
            facts["lengths"].append(lengths[0])
            facts["longest"].append(np.max(lengths, axis=0))
        sizes = np.array([len(a) for a in facts["split"]], dtype=np.int64)
        self.fingerprint, self.repetition, self.split, self.loss_tokens, self.lengths, self.longest = (
            np.concatenate(facts[key]) if self.chunks else np.zeros(0, dtype=np.int64) for key in facts)
        self.chunk_of = np.repeat(np.arange(len(self.chunks)), sizes)
        self.local = np.arange(len(self.chunk_of)) - np.repeat(np.cumsum(sizes) - sizes, sizes)

    def signature_chunks(self):
        from safetensors import safe_open

        for path, _ in self.chunks:
            with safe_open(str(path), "np") as f:
                yield f.get_tensor("signature")

    def records(self, rows_at: np.ndarray):
        """The records of these rows (in increasing order), a chunk at a time."""
        for c, where in by_chunk(self.chunk_of[rows_at]):
            yield from chunk_records(*self.chunks[c], self.local[rows_at[where]], self.kind)

    def record(self, i: int) -> dict:
        return chunk_records(*self.chunks[self.chunk_of[i]], self.local[i: i + 1], self.kind)[0]

    def loss_up_to(self, rows_at: np.ndarray, cut: int) -> np.ndarray:
        """Loss tokens among the first `cut` tokens of each of these rows (both sides of a pair)."""
        out = np.zeros(len(rows_at), dtype=np.int64)
        for c, where in by_chunk(self.chunk_of[rows_at]):
            for k, doc in zip(where, chunk_docs(*self.chunks[c], self.local[rows_at[where]], self.kind)):
                out[k] = sum(int(doc[key.replace("ids", "mask")][:cut].sum()) for key in sides(self.kind))
        return out


def stored_record(line: bytes, from_source: bool, src, kind: str) -> dict:
    """A prepared row's canonical record: its source line converted again, or the stored record."""
    row = json.loads(line)
    return rows.convert(row, src.format, kind) if from_source else row


def build(ctx, out: Path) -> None:
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
    prepared = Prepared(parts, data.sources, kind)
    codes = cleaning.drop_reasons(prepared.fingerprint, prepared.repetition, data.dedupe, data.filters,
                                  prepared.signature_chunks, prepared.record)
    dropped.update(counted(codes, cleaning.REASONS))
    kept = np.flatnonzero(codes == 0)
    cutoff = data.heldout_fraction * 2**32
    held, train = kept[prepared.split[kept] < cutoff], kept[prepared.split[kept] >= cutoff]
    (out / "heldout").mkdir()
    with open(out / "heldout" / "heldout.jsonl", "w", encoding="utf-8") as f:
        for record in prepared.records(held):
            f.write(json.dumps(record, ensure_ascii=False, sort_keys=True) + "\n")

    L = data.max_length
    codes, cut, loss = length_rules(prepared.longest[train], prepared.loss_tokens[train],
                                    lambda at: prepared.loss_up_to(train[at], L), data, kind)
    dropped.update(counted(codes, LENGTH_REASONS))
    docs = train[codes == 0]
    if not len(docs):
        raise UserError(f"data: no training rows left after cleaning (dropped {dict(dropped)}); "
                        f"check the sources and filters")
    sequences, shards = write_shards(out / "train", prepared, docs, kind, L, tok.pad_token_id)
    stats = {
        "kind": kind,
        "rows_in": dict(sorted(rows_in.items())),
        "rows_in_total": sum(rows_in.values()),
        "kept": {"train": len(docs), "heldout": len(held)},
        "dropped": dict(sorted(dropped.items())),
        "truncated_kept": len(cut),
        "tokens": int(np.minimum(prepared.lengths[docs], L).sum()),
        "loss_tokens": int(loss[codes == 0].sum()),
        "shards": shards,
    }
    if kind in ("chat", "text"):
        stats.update(sequences=sequences, sequence_length=L,
                     packing_efficiency=round(stats["tokens"] / (sequences * L), 6))
    assert stats["rows_in_total"] == len(docs) + len(held) + sum(dropped.values()), stats
    (out / "stats.json").write_text(json.dumps(stats, indent=1, sort_keys=True) + "\n")
    ctx.log.info("%d rows in: %d train, %d held out, dropped %s", stats["rows_in_total"], len(docs),
                 len(held), stats["dropped"])
    if "packing_efficiency" in stats:
        ctx.log.info("packed %d documents (%d tokens) into %d sequences of %d: efficiency %.3f",
                     len(docs), stats["tokens"], sequences, L, stats["packing_efficiency"])
