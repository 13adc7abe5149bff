"""Which prepared rows become training documents, decided on arrays over all rows: the
held-out split and the length rules, each drop counted by reason and listed by place."""
from __future__ import annotations

import json
from pathlib import Path

import blake3
import numpy as np


def split_hash(fingerprint: bytes, seed: int) -> int:
    """A stable split: a row's side depends on its own (normalized) content alone, not on its
    neighbours. The row is held out when this 32-bit hash is below fraction * 2**32."""
    return int.from_bytes(blake3.blake3(f"{seed}\0".encode() + fingerprint).digest(length=4), "big")


LENGTH_REASONS = ("too_short", "too_long", "no_loss_tokens")


def counted(codes: np.ndarray, reasons: tuple[str, ...]) -> dict[str, int]:
    """Drop counts by reason, from codes (0 kept, else 1 + the reason's index)."""
    return {r: int(n) for r, n in zip(reasons, np.bincount(codes, minlength=len(reasons) + 1)[1:]) if n}


def length_rules(longest: np.ndarray, loss: np.ndarray, loss_when_cut, data, learns: bool):
    """The length rules, for documents whose longer side has `longest` tokens and `loss` tokens
    of loss (where the kind `learns`, a document left without any is dropped): (codes, 0 kept
    else 1 + the index in LENGTH_REASONS; which are kept cut to max_length; loss tokens of each
    once cut). loss_when_cut(at) counts again the loss of the documents at `at` that are cut:
    some of it may lie past max_length."""
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
    if learns:
        codes[(codes == 0) & (loss == 0)] = 3
    return codes, cut[codes[cut] == 0], loss


def write_drop_list(path: Path, labels: list[str], unit: list[str], first_pass: list[list], second_pass) -> None:
    """dropped.jsonl: every dropped row, one line each in source order: its source, its line (a
    JSON Lines file's) or row (any other), why, and for a duplicate the row it repeats.
    `first_pass` holds each source's (row, reason) drops; `second_pass` is (source, row, reason,
    source and row repeated or None) for the rest."""
    entries = [(i, row, reason, None) for i, drops in enumerate(first_pass) for row, reason in drops]
    entries += list(second_pass)

    def place(i, row):
        return {"source": labels[i], unit[i]: int(row)}

    with open(path, "w", encoding="utf-8") as f:
        for i, row, reason, of in sorted(entries, key=lambda e: (e[0], e[1])):
            entry = {**place(i, row), "reason": reason, **({"duplicate_of": place(*of)} if of else {})}
            f.write(json.dumps(entry, ensure_ascii=False) + "\n")
