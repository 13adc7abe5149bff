"""The shards stage's first pass: each source read, converted, described for cleaning and
tokenized, by one worker process per core.

A worker reads its block of the file (stages/data/files.py), converts each row to the record of
the recipe's data kind (stages/data/rows.py, stages/data/kinds/), describes it for cleaning
(stages/data/cleaning.py, from the kind's lines), tokenizes it as the kind says through the
Encoder here (the model's own chat template and loss masks: stages/data/template.py), and writes
the block's arrays and rows as a chunk (read back by stages/data/prepared.py). Outcomes are taken in file order, so the
first bad row is the one reported, and every row read is kept or counted under a reason.
"""
from __future__ import annotations

import importlib
import json
import os
from collections import Counter
from pathlib import Path

import numpy as np

from stages.data import cleaning, files, render, rows, template
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
    (which the workers parse; see files.jsonl_blocks; a line over data.max_row_bytes is an
    Oversized job, never read) or lists of (where, raw row) read here,
    for the other file types and the hub."""
    if src.path is not None:
        fmt = files.file_format(src.path) if src.file_format == "auto" else src.file_format
        if fmt == "jsonl":
            path = root / src.path
            for block in files.jsonl_blocks(path, BLOCK_BYTES, data.max_row_bytes):
                yield block if isinstance(block, (bytes, files.Oversized)) else (str(path), *block)
            return
        raw = files.read_local(root / src.path, src.path, fmt)
    else:
        raw = files.read_hub(src.hub, src.revision, src.subset, src.split)
    yield from chunks_of(raw, CHUNK_ROWS)


def job_rows(job, limit: int):
    """(where, raw row or BadRow, the line as stored or None) of each row of a job. For a block
    of JSON Lines `where` is the line's index in the block, and the line is kept as it is."""
    if isinstance(job, list):
        for where, row in job:
            yield where, row, None
        return
    if isinstance(job, files.Oversized):
        yield 0, files.oversized(job.length), None
        return
    if isinstance(job, tuple):
        path, offset, length = job
        with open(path, "rb") as f:
            f.seek(offset)
            job = f.read(length)
    for where, (line, row) in enumerate(files.jsonl_rows(job, limit)):
        yield where, row, line


def job_records(job, src, data, kind, controls=None) -> tuple[list[dict], list[bytes], list[tuple], dict]:
    """The canonical records of a job's rows (of the data kind `kind`), each row as stored (its
    JSON line, or the record as JSON where the row did not come from one) and where it was (its position in the job, and
    `where`), with what happened to the others: rows in, drops by reason and by position, and
    where on_error is fail the first bad row as (position, where, message). `controls` is the
    tokenizer's special tokens' texts (render.control_pattern), refused in a RETOKENIZED kind: its
    trainer (TRL's preference, KTO and GRPO trainers take the rendered text) would read such text
    as the token, and a row could end a turn early or open one of another role."""
    records, stored, places, dropped = [], [], [], Counter()
    outcome = {"rows_in": 0, "dropped": dropped, "drops": [], "error": None}  # drops: (position, reason)
    for position, (where, row, line) in enumerate(job_rows(job, data.max_row_bytes)):
        outcome["rows_in"] += 1
        try:
            if isinstance(row, rows.BadRow):
                raise row
            record = rows.convert(row, src.format, kind)
            view = kind.lines(record)
            size = sum(len(t) for _, t, _ in view) if line is None else 0
            if size > data.max_row_bytes:  # a row of a file read whole (JSON, Parquet, CSV, the hub)
                raise files.oversized(size)
            if kind.RETOKENIZED and (quoted := render.quoted_control(view, controls)):
                raise rows.BadRow("special_token_text", f"a field holds {quoted!r}, a special token's text, which "
                                  "this method's trainer would read as that token")
        except rows.BadRow as e:
            if data.on_error == "skip" or e.reason in COUNTED_ALWAYS:
                dropped[e.reason] += 1
                outcome["drops"].append((position, e.reason))
                continue
            outcome["error"] = (position, where, str(e))
            break
        if not all(text.strip() for _, text, answer in view if answer):
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


class Encoder:
    """The model's tokenizer as a data kind's tokenize() uses it: conversations with their loss
    masks (or why the chat template refused one), plain texts, a conversation rendered. The kinds
    are handed this rather than importing the tokenization code, so the eval stage, which runs
    their held-out scoring, does not have that code in its key."""

    def __init__(self, tok):
        self.tok, self.eos_token_id = tok, tok.eos_token_id

    def chats(self, conversations: list[list[dict]]) -> list[tuple[np.ndarray, np.ndarray] | rows.Refused]:
        return template.encode_chats(self.tok, conversations)

    def texts(self, texts: list[str]) -> list[np.ndarray]:
        """Rendered texts: the special tokens in them are the template's."""
        return encode_texts(self.tok, texts)

    def documents(self, texts: list[str]) -> list[np.ndarray]:
        """Raw documents, their special tokens' texts encoded as text: a document that quotes
        <|endoftext|> does not end there, and the kind appends the one end-of-text token itself."""
        pattern = render.control_pattern(self.tok)
        held = [pattern is not None and pattern.search(t) is not None for t in texts]
        out = iter(encode_texts(self.tok, [t for t, h in zip(texts, held) if not h]))
        plain = render.text_tokenizer(self.tok) if any(held) else None  # a copy, made only where needed
        return [np.array(plain.encode(t, add_special_tokens=False).ids, dtype=np.int32) if h else next(out)
                for t, h in zip(texts, held)]

    def render(self, messages: list[dict], generation_prompt: bool = False) -> str | rows.Refused:
        return template.render_or_refuse(self.tok, messages, generation_prompt)


def prepare_chunk(records: list[dict], docs: list[dict], data, kind) -> dict[str, np.ndarray]:
    """Cleaning facts and tokens of a chunk of rows, as arrays (runs in a worker process)."""
    arrays = cleaning.describe([kind.lines(r) for r in records], data.dedupe)
    arrays["split"] = np.array([split_hash(f.tobytes(), data.seed) for f in arrays["fingerprint"]], dtype=np.uint32)
    arrays["loss_tokens"] = np.zeros(len(docs), dtype=np.int64)
    for key in kind.SIDES:
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


def prepare_job(index: int, job, src, kind_module: str, data, out: Path) -> dict:
    """A worker's whole share of one job: read, convert, describe, tokenize, and write
    chunk-<index> (arrays, and the rows as stored) into `out`. Returns job_records' outcome.
    The kind comes by its module's name (a module does not pickle)."""
    from safetensors.numpy import save_file

    kind = importlib.import_module(kind_module)
    records, stored, places, outcome = job_records(job, src, data, kind, render.control_pattern(_worker["tok"]))
    enc = Encoder(_worker["tok"])
    docs = [doc for i in range(0, len(records), TOKENIZE_BATCH)
            for doc in kind.tokenize(enc, records[i: i + TOKENIZE_BATCH])]
    refused = [k for k, doc in enumerate(docs) if isinstance(doc, rows.Refused)]
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


def prepare_source(ctx, src, kind, out: Path) -> None:
    """Everything per row of one source that does not depend on other rows: read, convert,
    describe for cleaning, tokenize. Jobs go to one worker process per core, at most two each
    in flight, so memory stays bounded on large files; each worker writes its own chunk files,
    and outcomes are taken in file order, so the first bad row is the one reported."""
    from collections import deque
    from concurrent.futures import ProcessPoolExecutor
    from multiprocessing import get_context

    count = SourceCount(src)
    progress = ctx.progress(desc=label_of(src), unit=" rows", mininterval=2)

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
                pending.append(pool.submit(prepare_job, index, job, src, kind.__name__, ctx.recipe.data, out))
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
