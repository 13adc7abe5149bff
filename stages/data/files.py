"""Reading data files and hub datasets into raw rows, whatever file type users bring: a local
.jsonl/.json/.parquet/.csv file (optionally .gz), or a hub dataset pinned to a revision. JSON
Lines are cut into blocks the shards stage's workers parse (stages/data/sources.py); a row the
file cannot give (malformed JSON, a line over data.max_row_bytes) is a rows.BadRow with its
reason. What a raw row means is rows.py's and the data kinds' business."""
from __future__ import annotations

import csv
import gzip
import json
import os
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from stages.data.rows import BadRow
from stages.engine import jsontext
from stages.engine.errors import UserError

# A data row nests a few levels (a chat's messages, a tool call's arguments); json's parser recurses
# once a level, so a row nested deeper than this is refused before it is parsed (jsontext says why).
ROW_DEPTH = 64
# A JSON escape of half a UTF-16 surrogate pair: paired, json joins the two into one character; alone,
# it decodes to a str no encoder takes (the tokenizer fails on it).
SURROGATE_ESCAPE = re.compile(r"\\u[dD][89a-fA-F]")
LONE_SURROGATE = "a lone UTF-16 surrogate escape (such as \\ud800), which is not text"


def parsed_row(text: str) -> dict | BadRow:
    """json.loads of one row's text, or the BadRow (malformed_json) it is: not JSON, nested deeper
    than ROW_DEPTH, an integer longer than Python reads, or holding a lone surrogate escape."""
    try:
        row = jsontext.loads(text, ROW_DEPTH)
    except jsontext.TooDeep as e:
        return BadRow("malformed_json", str(e))
    except json.JSONDecodeError as e:
        return BadRow("malformed_json", f"malformed JSON ({e.msg} at column {e.colno})")
    except ValueError as e:  # an integer of more digits than Python converts
        return BadRow("malformed_json", f"malformed JSON ({str(e).split(':')[0]})")
    if SURROGATE_ESCAPE.search(text) and lone_surrogate(row):
        return BadRow("malformed_json", LONE_SURROGATE)
    return row


def lone_surrogate(value) -> bool:
    try:
        json.dumps(value, ensure_ascii=False).encode("utf-8")
    except UnicodeEncodeError:
        return True
    return False


def file_format(path: str) -> str:
    name = path[:-3] if path.endswith(".gz") else path
    for ext in ("jsonl", "json", "parquet", "csv"):
        if name.endswith("." + ext):
            return ext
    raise UserError(f"{path}: unknown file type; use .jsonl, .json, .parquet or .csv (optionally .gz), "
                    f"or set file_format in the source")


SCAN = 1 << 20  # bytes read at a time while looking for a line's end


@dataclass(frozen=True)
class Oversized:
    """A line longer than data.max_row_bytes, skipped without being read into memory."""
    length: int


LINE_END = re.compile(rb"\n|\r\n?")  # the line ends bytes.splitlines() cuts at, which the workers use


def rest_of_line(f, keep: int) -> tuple[bytes | None, int, bytes]:
    """Read on to just past the next line end (\\n, \\r\\n or a lone \\r, as a classic Mac file has
    them; or the end of the file), SCAN bytes at a time: (the bytes read, or None once they pass
    `keep` and are no longer held; how many; the bytes read past the line end, which the next
    block starts with)."""
    kept, n, past = [], 0, b""
    while piece := f.readline(SCAN):
        end = LINE_END.search(piece)
        if end is not None:
            piece, past = piece[:end.end()], piece[end.end():]
            if piece.endswith(b"\r") and not past and (after := f.read(1)):  # a CR LF cut between two reads
                piece, past = (piece + after, b"") if after == b"\n" else (piece, after)
        n += len(piece)
        if kept is not None and n <= keep:
            kept.append(piece)
        else:
            kept = None
        if end is not None:
            break
    return (b"".join(kept) if kept is not None else None), n, past


def last_line_end(block: bytes) -> int:
    """Where the last line of `block` that ends in it ends (0: none does)."""
    return max(block.rfind(b"\n"), block.rfind(b"\r")) + 1


def jsonl_blocks(path: Path, size: int, limit: int) -> Iterator[tuple[int, int] | bytes | Oversized]:
    """A JSON Lines file in blocks of about `size` bytes, each ending at a line end, for workers
    to parse: (offset, length) in a plain file, which a worker reads itself, or the bytes of a
    gzipped one, decompressed here. The line a cut falls in is read on to its end; where that
    part alone is over `limit` bytes the line is an Oversized job of its own, never held in
    memory (shorter lines over the limit are found by the worker, in a block it holds anyway)."""
    if path.name.endswith(".gz"):
        with gzip.open(path, "rb") as f:
            carry = b""
            while block := carry + f.read(size):
                tail, n, carry = rest_of_line(f, limit)
                if tail is not None:
                    yield block + tail
                    continue
                head = last_line_end(block)
                if head:
                    yield block[:head]
                yield Oversized(len(block) - head + n)
        return
    with open(path, "rb") as f:
        total, offset = os.fstat(f.fileno()).st_size, 0
        while offset < total:
            cut = min(offset + size, total)
            f.seek(cut)
            end = cut + rest_of_line(f, 0)[1]  # on to the end of the line the cut falls in
            if end - cut > limit:
                start = line_start(f, offset, cut)
                if start > offset:
                    yield offset, start - offset
                yield Oversized(end - start)
            else:
                yield offset, end - offset
            offset = end


def line_start(f, lo: int, at: int) -> int:
    """Where the line that holds byte `at` begins (not before `lo`), read backwards SCAN at a time."""
    while at > lo:
        n = min(SCAN, at - lo)
        f.seek(at - n)
        k = last_line_end(f.read(n))
        if k:
            return at - n + k
        at -= n
    return lo


def jsonl_rows(block: bytes, limit: int) -> Iterator[tuple[bytes, dict | BadRow]]:
    """(line, raw row) for each line of a block, split at universal newlines as text files are.
    A UTF-8 byte-order mark (as Windows tools write at the start of a file) is not part of the row."""
    for line in block.splitlines():
        if len(line) > limit:
            yield line, oversized(len(line))
            continue
        try:
            text = line.decode("utf-8").removeprefix("\ufeff")
        except UnicodeDecodeError as e:
            yield line, BadRow("malformed_json", f"not UTF-8 ({e.reason} at byte {e.start + 1})")
            continue
        if not text.strip():
            yield line, BadRow("blank_line", "blank line")
            continue
        yield line, parsed_row(text)


def oversized(length: int) -> BadRow:
    return BadRow("oversized", f"a row of at least {length:,} bytes, over data.max_row_bytes")


def read_local(path: Path, label: str, fmt: str) -> Iterator[tuple[str, dict | BadRow]]:
    """(where, raw row) pairs of a .json, .parquet or .csv file; `where` is file:row N.
    (JSON Lines are read in blocks by the workers: jsonl_blocks, jsonl_rows.)"""
    opener = gzip.open if path.name.endswith(".gz") else open
    if fmt == "json":
        try:
            with opener(path, "rt", encoding="utf-8-sig") as f:
                text = f.read()
        except UnicodeDecodeError as e:
            raise UserError(f"{label}: not UTF-8 ({e.reason} at byte {e.start + 1}); save the file as UTF-8") from None
        except (OSError, EOFError) as e:  # a gzip file cut short or not gzip
            raise UserError(f"{label}: cannot read it ({e or type(e).__name__}); fix the file") from None
        try:
            data = jsontext.loads(text, ROW_DEPTH + 2)  # the list, {"data": ...} and the rows
        except jsontext.TooDeep:
            raise UserError(f"{label}: nested deeper than {ROW_DEPTH} levels in a row; fix the file") from None
        except json.JSONDecodeError as e:
            raise UserError(f"{label}:{e.lineno}: malformed JSON ({e.msg} at column {e.colno}); "
                            f"fix the file") from None
        except ValueError as e:  # an integer of more digits than Python converts
            raise UserError(f"{label}: malformed JSON ({str(e).split(':')[0]}); fix the file") from None
        if isinstance(data, dict) and isinstance(data.get("data"), list):
            data = data["data"]
        if not isinstance(data, list):
            raise UserError(f"{label}: a .json source is a list of rows (or {{\"data\": [...]}})")
        surrogates = bool(SURROGATE_ESCAPE.search(text))
        for i, row in enumerate(data, 1):
            if surrogates and lone_surrogate(row):
                row = BadRow("malformed_json", LONE_SURROGATE)
            yield f"{label}:row {i}", row
    else:
        from datasets import load_dataset
        from pandas.errors import EmptyDataError

        kwargs = {}
        try:
            if fmt == "csv":  # every cell is text as written: "4.50" stays "4.50", an empty cell ""
                with opener(path, "rt", encoding="utf-8-sig", newline="") as f:
                    columns = next(csv.reader(f), [])
                kwargs = {"converters": {c: str for c in columns}, "keep_default_na": False}
            ds = load_dataset(fmt, data_files=str(path), split="train", streaming=True, **kwargs)
            for i, row in enumerate(ds, 1):
                yield f"{label}:row {i}", row
        except EmptyDataError:  # not even a header: no rows, which the shards stage names
            return
        except (ValueError, OSError, EOFError) as e:  # not UTF-8, a row of more fields than the header, bad gzip
            raise UserError(f"{label}: cannot read it as {fmt} ({' '.join(str(e).split())[:200]}); fix the "
                            f"file") from None


def read_hub(hub: str, revision: str, subset: str | None, split: str) -> Iterator[tuple[str, dict]]:
    """Stream a hub dataset at a pinned revision (a local dataset directory takes the same path)."""
    from datasets import load_dataset

    try:
        ds = load_dataset(hub, subset, revision=revision, split=split, streaming=True)
    except Exception as e:  # the hub client raises many types; the user needs the one line
        raise UserError(f"data source {hub}@{revision}: cannot load ({type(e).__name__}: {e}); "
                        f"check the id, revision and split") from None
    for i, row in enumerate(ds, 1):
        yield f"{hub}@{revision}:{split}:row {i}", row
