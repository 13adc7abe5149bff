"""Cleaning: exact and near-duplicate removal and quality filters, each drop with a reason.

Exact duplicates are found on a fingerprint of the normalized text (case and
whitespace folded). Near duplicates use MinHash over word n-grams with an LSH
index (datasketch); a candidate the index returns counts only if its estimated
Jaccard similarity reaches the threshold. Rows are visited in a fixed order, so
the first of a group is kept, on every machine.
"""
from __future__ import annotations

import functools
import re
import zlib

import blake3
import numpy as np

SPACE = re.compile(r"\s+")
WORD = re.compile(r"\w+")


def normalized(record: dict) -> str:
    """The record's text for duplicate detection: roles + contents, case and whitespace folded."""
    def fold(text: str) -> str:
        return SPACE.sub(" ", text).strip().lower()

    def chat(messages):
        return "\n".join(m["role"] + ":" + fold(m["content"]) for m in messages)

    if "messages" in record:
        return chat(record["messages"])
    if "text" in record:
        return fold(record["text"])
    if "reference" in record:
        return chat(record["prompt"]) + "\nreference:" + fold(record["reference"])
    return chat(record["prompt"]) + "\nchosen:" + chat(record["chosen"]) + "\nrejected:" + chat(record["rejected"])


def fingerprint(norm: str) -> bytes:
    return blake3.blake3(norm.encode()).digest(length=16)


def shingle_hashes(text: str, n: int) -> np.ndarray:
    """32-bit hashes of the word n-grams of `text`, computed with numpy: each word is hashed
    once (crc32), n-grams combine their words' hashes."""
    words = WORD.findall(text) or [""]
    h = np.fromiter((zlib.crc32(w.encode()) for w in words), dtype=np.uint64, count=len(words))
    count = max(len(h) - n + 1, 1)
    grams = h[:count].copy()
    for k in range(1, min(n, len(h))):
        grams = (grams * np.uint64(0x9E3779B1) + h[k: k + count]) & np.uint64(0xFFFFFFFF)
    return grams


SCHEME = "affine32"  # datasketch's hashing scheme, named so stored signatures stay comparable


@functools.lru_cache(maxsize=4)
def _permutations(num_perm: int):
    from datasketch import MinHash

    return MinHash(num_perm=num_perm, seed=1, scheme=SCHEME).permutations


def signature(norm: str, n: int, num_perm: int) -> np.ndarray:
    """MinHash signature of the word n-grams: a small array, cheap to store and to cache."""
    from datasketch import MinHash

    m = MinHash(num_perm=num_perm, seed=1, scheme=SCHEME, hashfunc=int,  # values are hashes already
                permutations=_permutations(num_perm))
    m.update_batch(shingle_hashes(norm, n).tolist())
    return m.hashvalues


class NearDuplicates:
    """An LSH index that answers 'is this row a near copy of one kept before?'.

    The index is tuned for recall (a missed pair is worse than a wasted comparison);
    every candidate it returns is confirmed on the estimated Jaccard similarity."""

    def __init__(self, threshold: float, num_perm: int):
        from datasketch import MinHashLSH

        self.threshold = threshold
        self.lsh = MinHashLSH(threshold=threshold, num_perm=num_perm, weights=(0.2, 0.8))
        self.kept: list[np.ndarray] = []

    def seen(self, hashvalues: np.ndarray) -> bool:
        """True if a kept row is at least `threshold` similar; otherwise keep this one."""
        from datasketch import LeanMinHash

        m = LeanMinHash(seed=1, hashvalues=hashvalues, scheme=SCHEME)
        for other in self.lsh.query(m):
            if float(np.mean(self.kept[other] == hashvalues)) >= self.threshold:
                return True
        self.lsh.insert(len(self.kept), m)
        self.kept.append(hashvalues)
        return False


def repetition_ratio(texts: list[str], n: int = 3) -> float:
    """Share of word n-grams that repeat an earlier one: 0 for varied text, near 1 for loops."""
    grams = np.concatenate([shingle_hashes(t.lower(), n) for t in texts if t.strip()] or [np.zeros(0)])
    return 1 - len(np.unique(grams)) / len(grams) if len(grams) > 1 else 0.0


def describe(norm: str, answers: list[str], dedupe) -> dict:
    """What cleaning needs to know of one row (its normalized text and answers), computed once
    and cached with its tokens."""
    return {"fingerprint": fingerprint(norm),
            "signature": signature(norm, dedupe.ngram, dedupe.num_perm) if dedupe.near_threshold else None,
            "repetition": repetition_ratio(answers)}


class Cleaner:
    """Decides, row by row in a fixed order, whether a row is dropped and why."""

    def __init__(self, dedupe, filters):
        self.filters = filters
        self.exact: set[bytes] = set()
        self.near = NearDuplicates(dedupe.near_threshold, dedupe.num_perm) if dedupe.near_threshold else None

    def drop_reason(self, fingerprint: bytes, signature, repetition: float) -> str | None:
        if fingerprint in self.exact:
            return "exact_duplicate"
        self.exact.add(fingerprint)
        if self.near is not None and self.near.seen(signature):
            return "near_duplicate"
        limit = self.filters.max_repetition
        if limit is not None and repetition > limit:
            return "repetitive"
        return None
