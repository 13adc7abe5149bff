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
    """LSH banding over every row's MinHash signature, decided row by row in order: a row is a
    near copy if a row kept before it shares a band and reaches the threshold on the estimated
    Jaccard similarity.

    Bands and rows per band come from datasketch's MinHashLSH, tuned for recall (a missed
    pair is worse than a wasted comparison). The buckets are found up front with numpy over
    all signatures, so only rows that share a bucket with another row are ever held in
    memory: a few bytes per row instead of an index entry per band."""

    def __init__(self, threshold: float, num_perm: int, signature_chunks):
        from datasketch import MinHashLSH

        lsh = MinHashLSH(threshold=threshold, num_perm=num_perm, weights=(0.2, 0.8))
        self.threshold, self.bands, self.rows = threshold, lsh.b, lsh.r
        keys = [self.band_keys(chunk) for chunk in signature_chunks]
        keys = np.concatenate(keys) if keys else np.zeros((0, self.bands), dtype=np.uint64)
        self.bucket = np.empty(keys.shape, dtype=np.int64)
        self.shared = np.empty(keys.shape, dtype=bool)
        for band in range(self.bands):
            _, inverse, counts = np.unique(keys[:, band], return_inverse=True, return_counts=True)
            self.bucket[:, band], self.shared[:, band] = inverse, counts[inverse] > 1
        self.members: dict[tuple[int, int], list[int]] = {}
        self.kept: dict[int, np.ndarray] = {}

    def band_keys(self, signatures: np.ndarray) -> np.ndarray:
        bands = signatures[:, : self.bands * self.rows].astype(np.uint64).reshape(len(signatures), self.bands, self.rows)
        keys = np.zeros(bands.shape[:2], dtype=np.uint64)
        for k in range(self.rows):  # FNV-style mixing; wraps around in uint64
            keys = (keys * np.uint64(0x100000001B3)) ^ bands[:, :, k]
        return keys

    def seen(self, i: int, signature: np.ndarray) -> bool:
        """For row i (rows asked in increasing order): True if it is a near copy of a row kept
        before it; otherwise it is kept."""
        bands = np.flatnonzero(self.shared[i])
        if not len(bands):
            return False  # no other row falls in any of its buckets
        buckets = [(int(band), int(self.bucket[i, band])) for band in bands]
        candidates = {j for b in buckets for j in self.members.get(b, ())}
        if any(float(np.mean(self.kept[j] == signature)) >= self.threshold for j in candidates):
            return True
        for b in buckets:
            self.members.setdefault(b, []).append(i)
        self.kept[i] = signature
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
    """Decides, row by row in a fixed order, whether a row is dropped and why. With near dedupe
    on, `signature_chunks` are every row's signatures, in the order rows will be presented."""

    def __init__(self, dedupe, filters, signature_chunks=()):
        self.filters = filters
        self.exact: set[bytes] = set()
        self.row = -1
        self.near = NearDuplicates(dedupe.near_threshold, dedupe.num_perm, signature_chunks) \
            if dedupe.near_threshold else None

    def drop_reason(self, fingerprint: bytes, signature, repetition: float) -> str | None:
        self.row += 1
        if fingerprint in self.exact:
            return "exact_duplicate"
        self.exact.add(fingerprint)
        if self.near is not None and self.near.seen(self.row, signature):
            return "near_duplicate"
        limit = self.filters.max_repetition
        if limit is not None and repetition > limit:
            return "repetitive"
        return None
