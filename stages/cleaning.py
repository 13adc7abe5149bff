"""Cleaning: exact and near-duplicate removal and quality filters, each drop with a reason.

Exact duplicates are found on a fingerprint of the normalized text (case and
whitespace folded). Near duplicates use MinHash over word n-grams with an LSH
index (datasketch); a candidate the index returns counts only if the exact Jaccard
similarity of the two rows' n-gram sets reaches the threshold, so the estimate's
noise never drops a distinct row. Rows are visited in a fixed order, so
the first of a group is kept, on every machine.
"""
from __future__ import annotations

import functools

import blake3
import numpy as np

from stages import rows


def fold(text: str) -> str:
    return " ".join(text.split()).lower()  # whitespace runs -> one space, ends stripped


def chat_lines(messages: list[dict]) -> list[str]:
    return [m["role"] + ":" + fold(m["content"]) for m in messages]


def normalized(record: dict) -> str:
    """The record's text for duplicate detection: roles + contents, case and whitespace folded."""
    def chat(messages):
        return "\n".join(chat_lines(messages))

    if "messages" in record:
        return chat(record["messages"])
    if "text" in record:
        return fold(record["text"])
    if "reference" in record:
        return chat(record["prompt"]) + "\nreference:" + fold(record["reference"])
    return chat(record["prompt"]) + "\nchosen:" + chat(record["chosen"]) + "\nrejected:" + chat(record["rejected"])


def fingerprint(norm: str) -> bytes:
    return blake3.blake3(norm.encode()).digest(length=16)


WORD_BYTE = np.zeros(256, dtype=bool)  # ASCII letters, digits, underscore, and every non-ASCII byte
WORD_BYTE[[*range(48, 58), *range(65, 91), 95, *range(97, 123), *range(128, 256)]] = True
PRIME = 0x100000001B3  # odd, so it has an inverse modulo 2**64
MIX = np.uint64(0x9E3779B97F4A7C15)
_powers = {"up": np.ones(1, dtype=np.uint64), "down": np.ones(1, dtype=np.uint64)}


def _powers_to(n: int) -> tuple[np.ndarray, np.ndarray]:
    """PRIME**j and PRIME**-j modulo 2**64 for j < n (uint64 arithmetic wraps), grown as needed."""
    if len(_powers["up"]) < n:
        size = max(n, 2 * len(_powers["up"]))
        for name, base in (("up", PRIME), ("down", pow(PRIME, -1, 2**64))):
            _powers[name] = np.concatenate((np.ones(1, dtype=np.uint64), np.cumprod(np.full(size - 1, base, dtype=np.uint64))))
    return _powers["up"][:n], _powers["down"][:n]


def word_hashes(text: str) -> tuple[np.ndarray, np.ndarray]:
    """A 32-bit hash of each word of `text` (a run of ASCII letters, digits, underscores or
    non-ASCII characters) and the byte where it starts, all at once with numpy: word =
    difference of prefix polynomial hashes over the UTF-8 bytes, shifted back to start at
    PRIME**0, then mixed."""
    b = np.frombuffer(text.encode(), dtype=np.uint8)
    edges = np.diff(np.concatenate(([0], WORD_BYTE[b], [0])).astype(np.int8))
    starts, ends = np.flatnonzero(edges == 1), np.flatnonzero(edges == -1)
    up, down = _powers_to(len(b) + 1)
    prefix = np.concatenate((np.zeros(1, dtype=np.uint64), np.cumsum(b.astype(np.uint64) * up[: len(b)], dtype=np.uint64)))
    words = (prefix[ends] - prefix[starts]) * down[starts]
    return (words * MIX) >> np.uint64(32), starts


def shingles(h: np.ndarray, n: int) -> np.ndarray:
    """32-bit hashes of the n-grams of a sequence of word hashes: n-grams combine their words'
    hashes (fewer than n words: one gram of them all; no words: one empty word)."""
    if not len(h):
        h = np.zeros(1, dtype=np.uint64)
    count = max(len(h) - n + 1, 1)
    grams = h[:count].copy()
    for k in range(1, min(n, len(h))):
        grams = (grams * np.uint64(0x9E3779B1) + h[k: k + count]) & np.uint64(0xFFFFFFFF)
    return grams


def shingle_hashes(text: str, n: int) -> np.ndarray:
    return shingles(word_hashes(text)[0], n)


SCHEME = "affine32"  # datasketch's hashing scheme, named so stored signatures stay comparable


@functools.lru_cache(maxsize=4)
def _permutations(num_perm: int) -> tuple[np.ndarray, np.ndarray]:
    from datasketch import MinHash

    return MinHash(num_perm=num_perm, seed=1, scheme=SCHEME).permutations


def signature(grams: np.ndarray, num_perm: int) -> np.ndarray:
    """MinHash signature of a row's word n-grams (32-bit hashes): what datasketch's
    MinHash(scheme="affine32", seed=1).update_batch computes from these values, with its own
    pre-mix and permutations, applied to the array at once. update_batch takes the values one
    Python call each, which made it 2-3x slower than this for a typical row."""
    from datasketch.minhash import _fmix

    a, b = _permutations(num_perm)
    mixed = _fmix(grams.astype(np.uint32)[:, None], 32)
    return (mixed * a + b).min(axis=0)  # uint32 arithmetic wraps: the scheme's modulo 2**32


class NearDuplicates:
    """LSH banding over every row's MinHash signature, decided row by row in order: a row is a
    near copy if a row kept before it shares a band and their word n-gram sets reach the
    threshold in exact Jaccard similarity.

    Bands and rows per band come from datasketch's MinHashLSH, tuned for recall (a missed
    pair is worse than a wasted comparison). The buckets are found up front with numpy over
    all signatures, so only rows that share a bucket with another row are ever held in
    memory (their n-gram sets), instead of an index entry per band for every row."""

    def __init__(self, threshold: float, num_perm: int, ngram: int, signature_chunks):
        from datasketch import MinHashLSH

        lsh = MinHashLSH(threshold=threshold, num_perm=num_perm, weights=(0.2, 0.8))
        self.threshold, self.ngram, self.bands, self.rows = threshold, ngram, lsh.b, lsh.r
        keys = [self.band_keys(chunk) for chunk in signature_chunks]
        keys = np.concatenate(keys) if keys else np.zeros((0, self.bands), dtype=np.uint64)
        self.bucket = np.empty(keys.shape, dtype=np.int64)
        self.shared = np.empty(keys.shape, dtype=bool)
        for band in range(self.bands):
            _, inverse, counts = np.unique(keys[:, band], return_inverse=True, return_counts=True)
            self.bucket[:, band], self.shared[:, band] = inverse, counts[inverse] > 1
        self.members: dict[tuple[int, int], list[int]] = {}
        self.kept: dict[int, np.ndarray] = {}  # n-gram sets of kept rows that share a bucket

    def band_keys(self, signatures: np.ndarray) -> np.ndarray:
        bands = signatures[:, : self.bands * self.rows].astype(np.uint64).reshape(len(signatures), self.bands, self.rows)
        keys = np.zeros(bands.shape[:2], dtype=np.uint64)
        for k in range(self.rows):  # FNV-style mixing; wraps around in uint64
            keys = (keys * np.uint64(0x100000001B3)) ^ bands[:, :, k]
        return keys

    def seen(self, i: int, record) -> bool:
        """For row i (rows asked in increasing order): True if it is a near copy of a row kept
        before it; otherwise it is kept. Only rows that share a bucket have their n-grams held
        (and only they call `record` for theirs)."""
        bands = np.flatnonzero(self.shared[i])
        if not len(bands):
            return False  # no other row falls in any of its buckets
        grams = np.unique(shingle_hashes(normalized(record()), self.ngram))
        buckets = [(int(band), int(self.bucket[i, band])) for band in bands]
        candidates = sorted({j for b in buckets for j in self.members.get(b, ())})
        if any(jaccard(self.kept[j], grams) >= self.threshold for j in candidates):
            return True
        for b in buckets:
            self.members.setdefault(b, []).append(i)
        self.kept[i] = grams
        return False


def jaccard(a: np.ndarray, b: np.ndarray) -> float:
    """Exact Jaccard similarity of two sets given as sorted unique arrays."""
    common = len(np.intersect1d(a, b, assume_unique=True))
    return common / (len(a) + len(b) - common)


def repetition_ratio(texts: list[str], n: int = 3) -> float:
    """Share of word n-grams that repeat an earlier one: 0 for varied text, near 1 for loops."""
    return repeated_share([shingle_hashes(fold(t), n) for t in texts if t.strip()])


def repeated_share(grams: list[np.ndarray]) -> float:
    """Repeats counted as equal neighbours in sorted order (4x faster than np.unique on the few
    hundred n-grams of a row)."""
    grams = np.sort(np.concatenate(grams or [np.zeros(0)]))
    if len(grams) < 2:
        return 0.0
    return float(np.count_nonzero(grams[1:] == grams[:-1]) / len(grams))


def describe(record: dict, dedupe) -> dict:
    """What cleaning needs to know of one row (its normalized text and answers), computed once
    and cached with its tokens. A chat row's words are hashed once: its answers' words are
    those of its assistant lines in the normalized text."""
    chat = "messages" in record
    lines = chat_lines(record["messages"]) if chat else []
    norm = "\n".join(lines) if chat else normalized(record)
    hashes, starts = word_hashes(norm)
    if chat:
        edges, at = [], 0  # byte range of each non-blank answer in `norm`
        for m, line in zip(record["messages"], lines):
            size = len(line.encode())
            if m["role"] == "assistant" and m["content"].strip():
                edges += [at + len(m["role"].encode()) + 1, at + size]
            at += size + 1
        bounds = np.searchsorted(starts, edges).reshape(-1, 2)
        repetition = repeated_share([shingles(hashes[lo:hi], 3) for lo, hi in bounds])
    else:
        repetition = repetition_ratio(rows.answers(record))
    return {"norm": norm, "fingerprint": fingerprint(norm), "repetition": repetition,
            "signature": signature(shingles(hashes, dedupe.ngram), dedupe.num_perm) if dedupe.near_threshold else None}


class Cleaner:
    """Decides, row by row in a fixed order, whether a row is dropped and why. With near dedupe
    on, `signature_chunks` are every row's signatures, in the order rows will be presented."""

    def __init__(self, dedupe, filters, signature_chunks=()):
        self.filters = filters
        self.exact: set[bytes] = set()
        self.row = -1
        self.near = NearDuplicates(dedupe.near_threshold, dedupe.num_perm, dedupe.ngram, signature_chunks) \
            if dedupe.near_threshold else None

    def drop_reason(self, fingerprint: bytes, repetition: float, record) -> str | None:
        """`record` returns the row's record: read only for rows near dedupe must compare."""
        self.row += 1
        if fingerprint in self.exact:
            return "exact_duplicate"
        self.exact.add(fingerprint)
        if self.near is not None and self.near.seen(self.row, record):
            return "near_duplicate"
        limit = self.filters.max_repetition
        if limit is not None and repetition > limit:
            return "repetitive"
        return None
