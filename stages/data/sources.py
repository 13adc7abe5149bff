"""The shards stage's first pass: each source read, converted, described for cleaning and
tokenized, by one worker process per core.

A worker reads its block of the file (stages/data/rows.py turns any supported format into
the record the training method consumes), describes each row for cleaning
(stages/data/cleaning.py), tokenizes it with the model's own chat template, loss on
assistant tokens only (stages/data/template.py), and writes the block's arrays and rows as
a chunk (read back by stages/data/prepared.py). Outcomes are taken in file order, so the
first bad row is the one reported, and every row read is kept or counted under a reason.
"""
from __future__ import annotations

import json
import os
from collections import Counter
from pathlib import Path

import numpy as np

from stages.data import cleaning, rows, template
from stages.data.prepared import sides
from stages.data.selection import split_hash
from stages.data.tiktoken_encoder import encode_texts, encoder_of
from stages.engine.errors import UserError

BLOCK_BYTES = 1 << 22  # JSON Lines a worker reads and prepares at once (~1,500 chat rows)
CHUNK_ROWS = 4096  # rows of other file types the main process reads and hands to a worker at once
TOKENIZE_BATCH = 1024
COUNTED_ALWAYS = ("blank_line", "oversized")  # drops, never errors, whatever on_error says


def label_of(src) -> str:
    return src.path if src.path is not None else f"{src.hub}@{src.revision}"


def source_jobs(src, root: Path, data):
    """One source's reading work for the workers, in file order: blocks of a JSON Lines file
    (which the workers parse; see rows.jsonl_blocks; a line over data.max_row_bytes is an
    Oversized job, never read) or lists of (where, raw row) read here,
    for the other file types and the hub."""
    if src.path is not None:
        fmt = rows.file_format(src.path) if src.file_format == "auto" else src.file_format
        if fmt == "jsonl":
            path = root / src.path
            for block in rows.jsonl_blocks(path, BLOCK_BYTES, data.max_row_bytes):
                yield block if isinstance(block, (bytes, rows.Oversized)) else (str(path), *block)
            return
        raw = rows.read_local(root / src.path, src.path, fmt)
    else:
        raw = rows.read_hub(src.hub, src.revision, src.subset, src.split)
    yield from chunks_of(raw, CHUNK_ROWS)


def job_rows(job, limit: int):
    """(where, raw row or BadRow, the line as stored or None) of each row of a job. For a block
    of JSON Lines `where` is the line's index in the block, and the line is kept as it is."""
    if isinstance(job, list):
        for where, row in job:
            yield where, row, None
        return
    if isinstance(job, rows.Oversized):
        yield 0, rows.oversized(job.length), None
        return
    if isinstance(job, tuple):
        path, offset, length = job
        with open(path, "rb") as f:
            f.seek(offset)
            job = f.read(length)
    for where, (line, row) in enumerate(rows.jsonl_rows(job, limit)):
        yield where, row, line


def job_records(job, src, data, kind: str) -> tuple[list[dict], list[bytes], list[tuple], dict]:
    """The canonical records of a job's rows, each row as stored (its JSON line, or the record as
    JSON where the row did not come from one) and where it was (its position in the job, and
    `where`), with what happened to the others: rows in, drops by reason and by position, and
    where on_error is fail the first bad row as (position, where, message)."""
    records, stored, places, dropped = [], [], [], Counter()
    outcome = {"rows_in": 0, "dropped": dropped, "drops": [], "error": None}  # drops: (position, reason)
    for position, (where, row, line) in enumerate(job_rows(job, data.max_row_bytes)):
        outcome["rows_in"] += 1
        try:
            if isinstance(row, rows.BadRow):
                raise row
            record = rows.convert(row, src.format, kind)
            text = sum(len(t) for _, t, _ in cleaning.lines_of(record)) if line is None else 0
            if text > data.max_row_bytes:  # a row of a file read whole (JSON, Parquet, CSV, the hub)
                raise rows.oversized(text)
        except rows.BadRow as e:
            if data.on_error == "skip" or e.reason in COUNTED_ALWAYS:
                dropped[e.reason] += 1
                outcome["drops"].append((position, e.reason))
                continue
            outcome["error"] = (position, where, str(e))
            break
        if not all(a.strip() for a in rows.answers(record)):
            dropped["empty_answer"] += 1
            outcome["drops"].append((position, "empty_answer"))
            continue
        records.append(record)
        stored.append(line if line is not None else json.dumps(record, ensure_ascii=False, sort_keys=True).encode())
        places.append((position, where))
    return records, stored, places, outcome


class SourceCount:
    """The outcomes of one source's jobs, taken in file order: rows in, drops by reason and by
    row (its number in the source: a JSON Lines file's line, or the row of another file type),
    the rows before each job, and the first bad row (on_error: fail) raised as a one-line error
    naming its file:line."""

    def __init__(self, src):
        self.label, self.rows_in, self.dropped = label_of(src), 0, Counter()
        self.drops: list[tuple[int, str]] = []  # (row number, reason)
        self.rows_before: list[int] = []  # per job, in order

    def take(self, outcome: dict) -> None:
        if outcome["error"]:
            _, where, message = outcome["error"]
            if isinstance(where, int):  # a line of a JSON Lines block: all lines before it are counted
                where = f"{self.label}:{self.rows_in + where + 1}"
            raise UserError(f"{where}: {message}; fix the row or set data.on_error: skip")
        self.rows_before.append(self.rows_in)
        self.drops += [(self.rows_in + position + 1, reason) for position, reason in outcome["drops"]]
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


_worker: dict = {}  # the tokenizer and its fast encoder, made here and inherited by the forked workers


def load_tokenizer(base: str) -> None:
    """The model's tokenizer and its fast encoder (tiktoken's tables take about a second to
    build), made once in this process before the workers fork, so none of them builds its own."""
    from transformers import AutoTokenizer

    if _worker.get("base") != base:
        _worker.update(base=base, tok=AutoTokenizer.from_pretrained(base))
        encoder_of(_worker["tok"])


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
        outcome["drops"] = sorted(outcome["drops"] + [(places[k][0], "template_refused") for k in refused])
        kept = sorted(set(range(len(docs))) - set(refused))
        records, stored, docs, places = ([x[k] for k in kept] for x in (records, stored, docs, places))
    elif refused and (outcome["error"] is None or places[refused[0]][0] < outcome["error"][0]):
        outcome["error"] = (*places[refused[0]], f"the model's chat template refused it ({docs[refused[0]]})")
    if records and not outcome["error"]:
        arrays = prepare_chunk(records, docs, data, kind)
        arrays["row_offsets"] = np.cumsum([0] + [len(line) + 1 for line in stored], dtype=np.int64)
        arrays["position"] = np.array([position for position, _ in places], dtype=np.int64)  # in the job
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
    load_tokenizer(str(ctx.upstream["base"]))
    with ProcessPoolExecutor(workers, mp_context=get_context("fork")) as pool:
        pending = deque()
        try:
            for index, job in enumerate(source_jobs(src, ctx.root, ctx.recipe.data)):
                pending.append(pool.submit(prepare_job, index, job, src, kind, ctx.recipe.data, out))
                while len(pending) > 2 * workers or (pending and pending[0].done()):
                    take(pending.popleft())
            while pending:
                take(pending.popleft())
        except BaseException:
            pool.shutdown(cancel_futures=True)
            raise
    progress.close()
    (out / "stats.json").write_text(json.dumps({"rows_in": count.rows_in, "dropped": dict(sorted(count.dropped.items())),
                                                "rows_before": count.rows_before, "drops": count.drops},
                                               indent=1, sort_keys=True) + "\n")
