"""Reading data sources into canonical rows, whatever format users bring.

A source is a local .jsonl/.json/.parquet/.csv file (optionally .gz) or a hub
dataset pinned to a revision. Each raw row is detected as one format (or the
recipe says which) and converted to what the training method consumes (its data kind, in its
row of stages/train/methods.py):

    chat        {"messages": [{"role", "content", "reasoning"?}, ...]}      sft
    text        {"text": str}                                               cpt
    preference  {"prompt": [messages], "chosen": [messages], "rejected": [messages]}  dpo, orpo, reward
    prompt      {"prompt": [messages], "reference": str}                    grpo

A row that cannot be converted raises BadRow with a reason (the drop-count key)
and a message; the caller fails with file:line or counts it (on_error: skip).
"""
from __future__ import annotations

import csv
import gzip
import json
import os
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from stages.engine.errors import UserError

ROLES = {"system", "user", "assistant"}
SHAREGPT_ROLES = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant",
                  "system": "system"}
REASONING_KEYS = ("reasoning", "reasoning_content", "thinking")
PROMPT_KEYS = ("prompt", "question", "query")
ANSWER_KEYS = ("reference", "answer", "completion", "response", "solution")
TRANSCRIPT_TURN = re.compile(r"\n\n(Human|Assistant): ")


class BadRow(Exception):
    def __init__(self, reason: str, message: str):
        super().__init__(message)
        self.reason = reason


# reading -------------------------------------------------------------------------
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


def rest_of_line(f, keep: int) -> tuple[bytes | None, int]:
    """Read on to just past the next line end (or the end of the file), SCAN bytes at a time:
    (the bytes read, or None once they pass `keep` and are no longer held; how many)."""
    kept, n = [], 0
    while piece := f.readline(SCAN):
        n += len(piece)
        if kept is not None and n <= keep:
            kept.append(piece)
        else:
            kept = None
        if piece.endswith(b"\n"):
            break
    return (b"".join(kept) if kept is not None else None), n


def jsonl_blocks(path: Path, size: int, limit: int) -> Iterator[tuple[int, int] | bytes | Oversized]:
    """A JSON Lines file in blocks of about `size` bytes, each ending at a line end, for workers
    to parse: (offset, length) in a plain file, which a worker reads itself, or the bytes of a
    gzipped one, decompressed here. The line a cut falls in is read on to its end; where that
    part alone is over `limit` bytes the line is an Oversized job of its own, never held in
    memory (shorter lines over the limit are found by the worker, in a block it holds anyway)."""
    if path.name.endswith(".gz"):
        with gzip.open(path, "rb") as f:
            while block := f.read(size):
                tail, n = rest_of_line(f, limit)
                if tail is not None:
                    yield block + tail
                    continue
                head = block.rfind(b"\n") + 1
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
        k = f.read(n).rfind(b"\n")
        if k >= 0:
            return at - n + k + 1
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
        try:
            yield line, json.loads(text)
        except json.JSONDecodeError as e:
            yield line, BadRow("malformed_json", f"malformed JSON ({e.msg} at column {e.colno})")


def oversized(length: int) -> BadRow:
    return BadRow("oversized", f"a row of at least {length:,} bytes, over data.max_row_bytes")


def read_local(path: Path, label: str, fmt: str) -> Iterator[tuple[str, dict | BadRow]]:
    """(where, raw row) pairs of a .json, .parquet or .csv file; `where` is file:row N.
    (JSON Lines are read in blocks by the workers: jsonl_blocks, jsonl_rows.)"""
    opener = gzip.open if path.name.endswith(".gz") else open
    if fmt == "json":
        with opener(path, "rt", encoding="utf-8-sig") as f:
            try:
                data = json.load(f)
            except json.JSONDecodeError as e:
                raise UserError(f"{label}:{e.lineno}: malformed JSON ({e.msg} at column {e.colno}); "
                                f"fix the file") from None
        if isinstance(data, dict) and isinstance(data.get("data"), list):
            data = data["data"]
        if not isinstance(data, list):
            raise UserError(f"{label}: a .json source is a list of rows (or {{\"data\": [...]}})")
        for i, row in enumerate(data, 1):
            yield f"{label}:row {i}", row
    else:
        from datasets import load_dataset

        kwargs = {}
        if fmt == "csv":  # every cell is text as written: "4.50" stays "4.50", an empty cell ""
            with opener(path, "rt", encoding="utf-8-sig", newline="") as f:
                columns = next(csv.reader(f), [])
            kwargs = {"converters": {c: str for c in columns}, "keep_default_na": False}
        ds = load_dataset(fmt, data_files=str(path), split="train", streaming=True, **kwargs)
        for i, row in enumerate(ds, 1):
            yield f"{label}:row {i}", row


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


# formats -------------------------------------------------------------------------
def detect(row: dict) -> str:
    if "messages" in row or "conversations" in row:
        return "chat"
    if "chosen" in row and "rejected" in row:
        return "preference"
    if "instruction" in row and "output" in row:
        return "alpaca"
    if any(k in row for k in PROMPT_KEYS) and any(k in row for k in ANSWER_KEYS):
        return "prompt"
    if "text" in row:
        return "text"
    raise BadRow("unknown_format", f"cannot tell the format from the keys {sorted(row)[:6]}; "
                                   f"set format in the source")


def text_field(row: dict, key: str) -> str:
    value = row.get(key)
    if not isinstance(value, str):
        raise BadRow("missing_field", f'"{key}" must be a string')
    return value


def first_field(row: dict, keys: tuple[str, ...]) -> str:
    return text_field(row, next((k for k in keys if k in row), keys[0]))


def message(m) -> dict:
    if not isinstance(m, dict):
        raise BadRow("invalid_message", "a message is an object with role and content")
    role = m.get("role", m.get("from"))
    content = m.get("content", m.get("value"))
    if role not in SHAREGPT_ROLES:
        raise BadRow("unknown_role", f"unknown role {role!r} (use one of {sorted(ROLES)})")
    if not isinstance(content, str):
        raise BadRow("missing_field", "a message without string content")
    out = {"role": SHAREGPT_ROLES[role], "content": content}
    reasoning = next((m[k] for k in REASONING_KEYS if isinstance(m.get(k), str) and m[k]), None)
    if reasoning is not None:
        out["reasoning"] = reasoning
    return out


def messages(value) -> list[dict]:
    if not isinstance(value, list) or not value:
        raise BadRow("missing_field", "messages must be a non-empty list")
    return [message(m) for m in value]


def transcript(text: str) -> list[dict]:
    """'\\n\\nHuman: ...\\n\\nAssistant: ...' (the HH-RLHF layout) as messages."""
    parts = TRANSCRIPT_TURN.split(text)
    if len(parts) < 3 or parts[0].strip():
        raise BadRow("invalid_row", "a transcript string starts with '\\n\\nHuman: '")
    return [{"role": "user" if who == "Human" else "assistant", "content": said}
            for who, said in zip(parts[1::2], parts[2::2])]


def as_chat(row: dict, fmt: str) -> list[dict]:
    if fmt == "chat":
        return messages(row.get("messages", row.get("conversations")))
    if fmt == "alpaca":
        instruction, extra = text_field(row, "instruction"), row.get("input") or ""
        if not isinstance(extra, str):
            raise BadRow("missing_field", '"input" must be a string')
        chat = [{"role": "system", "content": row["system"]}] if isinstance(row.get("system"), str) else []
        chat.append({"role": "user", "content": instruction + ("\n\n" + extra if extra.strip() else "")})
        return chat + [{"role": "assistant", "content": text_field(row, "output")}]
    if fmt == "prompt":
        return [{"role": "user", "content": first_field(row, PROMPT_KEYS)},
                {"role": "assistant", "content": first_field(row, ANSWER_KEYS)}]
    raise BadRow("wrong_format", f"a {fmt} row cannot be a chat example")


def side(value) -> list[dict]:
    """One side of a preference pair: a string, a transcript, or a list of messages."""
    if isinstance(value, str):
        return transcript(value) if value.startswith("\n\nHuman: ") else [{"role": "assistant", "content": value}]
    return messages(value)


def as_preference(row: dict) -> dict:
    chosen, rejected = side(row.get("chosen")), side(row.get("rejected"))
    if "prompt" in row:
        prompt = side(row["prompt"]) if not isinstance(row["prompt"], str) else \
            [{"role": "user", "content": row["prompt"]}]
    else:  # implicit prompt: the turns both sides share
        n = 0
        while n < min(len(chosen), len(rejected)) - 1 and chosen[n] == rejected[n]:
            n += 1
        prompt, chosen, rejected = chosen[:n], chosen[n:], rejected[n:]
    if not prompt or prompt[-1]["role"] != "user":
        raise BadRow("invalid_row", "a preference pair needs a prompt ending in a user turn")
    for name, answer in (("chosen", chosen), ("rejected", rejected)):
        if not answer or any(m["role"] != "assistant" for m in answer):
            raise BadRow("invalid_row", f"{name} must be assistant turns after the prompt")
    return {"prompt": prompt, "chosen": chosen, "rejected": rejected}


def convert(row, fmt: str, kind: str) -> dict:
    """The raw row as the canonical record of `kind` (see the module docstring)."""
    if not isinstance(row, dict):
        raise BadRow("invalid_row", "a row is a JSON object")
    fmt = detect(row) if fmt == "auto" else fmt
    if kind == "chat":
        chat = as_chat(row, fmt)
        if not any(m["role"] == "assistant" for m in chat):
            raise BadRow("no_assistant_turn", "no assistant turn to learn from")
        return {"messages": chat}
    if kind == "text":
        if fmt != "text":
            raise BadRow("wrong_format", f"a {fmt} row cannot feed continued pretraining (needs text)")
        return {"text": text_field(row, "text")}
    if kind == "preference":
        if fmt != "preference":
            raise BadRow("wrong_format", f"a {fmt} row cannot feed preference training")
        return as_preference(row)
    chat = as_chat(row, fmt)
    last = max((i for i, m in enumerate(chat) if m["role"] == "assistant"), default=None)
    if last is None or last == 0:
        raise BadRow("invalid_row", "a prompt row needs a prompt and a reference answer")
    return {"prompt": chat[:last], "reference": chat[last]["content"]}


def answers(record: dict) -> list[str]:
    """The texts a model learns to produce from this record (for the empty-answer filter)."""
    if "messages" in record:
        return [m["content"] for m in record["messages"] if m["role"] == "assistant"]
    if "text" in record:
        return [record["text"]]
    if "reference" in record:
        return [record["reference"]]
    return [m["content"] for m in record["chosen"] + record["rejected"]]
