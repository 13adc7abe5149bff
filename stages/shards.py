"""shards: tokenized, masked, packed training sequences + the held-out split + stats.json.

Rows are read line by line so a bad line is reported as file:line; kept rows go
through datasets.map with the tokenizer's own chat template; loss falls on
assistant tokens (and their end-of-turn token) only. Sequences are packed
best-fit-decreasing, position ids restart per document, and the shard is a
safetensors file (memory-mapped, byte-deterministic). Every row read is either
kept or counted under a drop reason.
"""
from __future__ import annotations

import bisect
import json
import re
from collections import Counter
from pathlib import Path

import blake3
import numpy as np

from stages.errors import UserError

ROLES = {"system", "user", "assistant"}
IGNORE = -100
SPACE = re.compile(r"\s+")


def extra_inputs(recipe, root: Path, store) -> dict:
    """Each source file's content digest is an input of the key (via the stat cache)."""
    digests = {}
    for i, src in enumerate(recipe.data.sources):
        p = root / src.path
        if not p.is_file():
            raise UserError(f"recipe data.sources.{i}.path: {src.path} not found; "
                            f"fix the path or create the file")
        digests[src.path] = store.stat.digest(p)
    return digests


def check_row(row) -> str | None:
    """Why a row is not a usable chat row, or None."""
    if not isinstance(row, dict) or not isinstance(row.get("messages"), list) or not row["messages"]:
        return 'no "messages" list'
    for m in row["messages"]:
        if not isinstance(m, dict) or not isinstance(m.get("content"), str):
            return "a message without string content"
        if m.get("role") not in ROLES:
            return f"unknown role {m.get('role')!r} (use one of {sorted(ROLES)})"
    if not any(m["role"] == "assistant" for m in row["messages"]):
        return "no assistant turn to learn from"
    if not any(m["content"].strip() for m in row["messages"] if m["role"] == "assistant"):
        return "empty assistant answer"
    return None


def read_rows(path: Path, label: str, on_error: str, dropped: Counter):
    """Yield chat rows of one JSONL file; bad lines fail (file:line) or are counted."""
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                dropped["blank_line"] += 1
                continue
            try:
                row = json.loads(line)
                problem = check_row(row)
                reason = "invalid_row"
            except json.JSONDecodeError as e:
                problem, reason = f"malformed JSON ({e.msg} at column {e.colno})", "malformed_json"
            if problem:
                if on_error == "skip":
                    dropped[reason] += 1
                    continue
                raise UserError(f"{label}:{lineno}: {problem}; fix the line or set data.on_error: skip")
            yield {"messages": [{"role": m["role"], "content": m["content"]} for m in row["messages"]]}


def normalized(row) -> str:
    """Text for exact dedupe: roles + contents, case and whitespace folded."""
    return "\n".join(m["role"] + ":" + SPACE.sub(" ", m["content"]).strip().lower()
                     for m in row["messages"])


def is_heldout(norm: str, fraction: float, seed: int) -> bool:
    """A stable split: a row's side depends on its own content alone, not on its neighbours."""
    h = int(blake3.blake3(f"{seed}\0{norm}".encode()).hexdigest()[:8], 16)
    return h < fraction * 2**32


def assistant_spans(tok, messages) -> list[tuple[int, int]]:
    """Character spans of each assistant turn (content + end-of-turn) in the rendered text.

    Found by rendering growing prefixes, so it works for templates without
    generation markers; a template that rewrites earlier turns is refused."""
    full = tok.apply_chat_template(messages, tokenize=False)
    spans = []
    for i, m in enumerate(messages):
        if m["role"] != "assistant":
            continue
        head = tok.apply_chat_template(messages[:i], tokenize=False, add_generation_prompt=True)
        upto = tok.apply_chat_template(messages[: i + 1], tokenize=False)
        if not (full.startswith(head) and full.startswith(upto) and upto.startswith(head)):
            raise UserError("the chat template renders earlier turns differently as the conversation "
                            "grows; loss masks cannot be derived from it")
        spans.append((len(head), len(head) + len(upto[len(head):].rstrip())))
    return spans


def encode(tok, messages):
    """input_ids and a 0/1 loss mask that is 1 exactly on assistant tokens."""
    text = tok.apply_chat_template(messages, tokenize=False)
    spans = assistant_spans(tok, messages)
    enc = tok(text, add_special_tokens=False, return_offsets_mapping=True)
    mask = [int(any(s <= a and b <= e for s, e in spans) and b > a) for a, b in enc["offset_mapping"]]
    return enc["input_ids"], mask


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


def build(ctx, out: Path) -> None:
    from datasets import Dataset
    from safetensors.numpy import save_file
    from transformers import AutoTokenizer

    data = ctx.recipe.data
    tok = AutoTokenizer.from_pretrained(ctx.upstream["base"])
    dropped: Counter = Counter()
    rows_in: dict[str, int] = {}
    seen, train, heldout = set(), [], []
    for src in data.sources:
        before = sum(dropped.values()) + len(train) + len(heldout)
        for row in read_rows(ctx.root / src.path, src.path, data.on_error, dropped):
            norm = normalized(row)
            if norm in seen:
                dropped["exact_duplicate"] += 1
                continue
            seen.add(norm)
            (heldout if is_heldout(norm, data.heldout_fraction, data.seed) else train).append(row)
        rows_in[src.path] = sum(dropped.values()) + len(train) + len(heldout) - before
    ctx.log.info("read %d rows: %d train, %d held out, dropped %s",
                 sum(rows_in.values()), len(train), len(heldout), dict(dropped))
    if not train:
        raise UserError("data: no training rows left after cleaning; see the drop counts above")

    def tokenize(row):
        try:
            ids, mask = encode(tok, row["messages"])
        except UserError as e:
            raise UserError(f"data: {e}") from None
        return {"input_ids": ids, "mask": mask}

    ds = Dataset.from_list(train).map(tokenize, remove_columns=["messages"], desc="tokenize")
    docs, truncated = [], 0
    for ids, mask in zip(ds["input_ids"], ds["mask"]):
        if len(ids) > data.max_length:
            if data.truncation == "drop":
                dropped["too_long"] += 1
                continue
            ids, mask = ids[: data.max_length], mask[: data.max_length]
            truncated += 1
        if not any(mask):
            dropped["no_loss_tokens"] += 1
            continue
        docs.append((ids, mask))

    L = data.max_length
    bins = pack([len(d[0]) for d in docs], L)
    n = len(bins)
    input_ids = np.full((n, L), tok.pad_token_id, dtype=np.int32)
    labels = np.full((n, L), IGNORE, dtype=np.int32)
    position_ids = np.zeros((n, L), dtype=np.int32)
    boundaries = []  # (sequence, start, length) of every document
    for s, members in enumerate(bins):
        at = 0
        for d in members:
            ids, mask = docs[d]
            k = len(ids)
            input_ids[s, at: at + k] = ids
            labels[s, at: at + k] = np.where(np.array(mask, dtype=bool), ids, IGNORE)
            position_ids[s, at: at + k] = np.arange(k)
            boundaries.append((s, at, k))
            at += k
        position_ids[s, at:] = np.arange(L - at)  # padding is its own document, with no loss
    (out / "train").mkdir()
    save_file({"input_ids": input_ids, "labels": labels, "position_ids": position_ids,
               "documents": np.array(boundaries, dtype=np.int32).reshape(-1, 3)},
              str(out / "train" / "shard-00000.safetensors"), metadata={"max_length": str(L)})
    (out / "heldout").mkdir()
    with open(out / "heldout" / "heldout.jsonl", "w") as f:
        for row in heldout:
            f.write(json.dumps(row, ensure_ascii=False, sort_keys=True) + "\n")

    tokens = sum(len(d[0]) for d in docs)
    stats = {
        "rows_in": rows_in,
        "rows_in_total": sum(rows_in.values()),
        "kept": {"train": len(docs), "heldout": len(heldout)},
        "dropped": dict(sorted(dropped.items())),
        "truncated_kept": truncated,
        "tokens": tokens,
        "loss_tokens": int((labels != IGNORE).sum()),
        "sequences": n,
        "sequence_length": L,
        "packing_efficiency": round(tokens / (n * L), 6),
    }
    assert stats["rows_in_total"] == len(docs) + len(heldout) + sum(dropped.values())
    (out / "stats.json").write_text(json.dumps(stats, indent=1, sort_keys=True) + "\n")
    ctx.log.info("packed %d documents (%d tokens) into %d sequences of %d: efficiency %.3f",
                 len(docs), tokens, n, L, stats["packing_efficiency"])
