"""Cleaning: exact and near-duplicate removal and quality filters, each drop with a reason.

A record is read as its data kind's lines (stages/data/kinds/: prefix, text, and whether the
text is an answer), so cleaning knows no kind. Exact duplicates are found on a fingerprint of
the normalized text (case and whitespace folded). Near duplicates use MinHash over word n-grams
with an LSH index (datasketch); a candidate the index returns counts only if the exact Jaccard
similarity of the two rows' n-gram sets reaches the threshold, so the estimate's noise never
drops a distinct row. Rows are visited in a fixed order, so the first of a group is kept, on
every machine.
"""
from __future__ import annotations

import functools

import blake3
import numpy as np



def fold(text: str) -> str:
    return " ".join(text.split()).lower()  # whitespace runs -> one space, ends stripped


def normalized(lines: list[tuple[str, str, bool]]) -> str:
    """A record's text for duplicate detection, from its lines (its kind's lines(record): prefix,
    text, is an answer): each prefix and folded text, one line each."""
    return "\n".join(prefix + fold(text) for prefix, text, _ in lines)


def fingerprint_of(norm: bytes) -> bytes:
    return blake3.blake3(norm).digest(length=16)


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


def words_of_bytes(b: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """A 32-bit hash of each word of UTF-8 text (a run of ASCII letters, digits, underscores or
    non-ASCII bytes) and the byte where it starts, all at once with numpy: word = difference of prefix polynomial
    hashes over the bytes, shifted back to start at PRIME**0, then mixed."""
    edges = np.diff(np.concatenate(([0], WORD_BYTE[b], [0])).astype(np.int8))
    starts, ends = np.flatnonzero(edges == 1), np.flatnonzero(edges == -1)
    up, down = _powers_to(len(b) + 1)
    prefix = np.concatenate((np.zeros(1, dtype=np.uint64), np.cumsum(b.astype(np.uint64) * up[: len(b)], dtype=np.uint64)))
    words = (prefix[ends] - prefix[starts]) * down[starts]
    return (words * MIX) >> np.uint64(32), starts


def words_of_texts(word_starts: np.ndarray, texts: list[bytes]) -> np.ndarray:
    """(first, end) word of each text, for words found in the texts joined by a newline (which
    no word crosses): words_of_bytes' word starts of the joined bytes."""
    ends = np.cumsum([len(t) + 1 for t in texts])
    return np.searchsorted(word_starts, np.stack([np.append(0, ends[:-1]), ends], axis=1))


SCHEME = "affine32"  # datasketch's hashing scheme, named so stored signatures stay comparable


@functools.lru_cache(maxsize=4)
def _permutations(num_perm: int) -> tuple[np.ndarray, np.ndarray]:
    from datasketch import MinHash

    return MinHash(num_perm=num_perm, seed=1, scheme=SCHEME).permutations


NEAR_BATCH = 2048  # rows near dedupe looks ahead over, to make the n-gram sets it will compare at once
ESTIMATE_SDS = 4  # a pair whose MinHash estimate is this many standard deviations under the threshold is not compared


class NearDuplicates:
    """LSH banding over every row's MinHash signature, decided row by row in order: a row is a
    near copy if a row kept before it shares a band and their word n-gram sets reach the
    threshold in exact Jaccard similarity.

    Bands and rows per band come from datasketch's MinHashLSH, tuned for recall (a missed
    pair is worse than a wasted comparison). The buckets are found up front with numpy over
    all signatures, so only rows that share a bucket with another row are ever asked. Most
    pairs that share a bucket are far from the threshold (text that shares a passage, a
    prompt, a licence header): their MinHash estimate (the share of equal signature values)
    says so, and only pairs whose estimate comes within ESTIMATE_SDS standard deviations of
    the threshold are compared exactly, so only their rows are read again and their n-gram
    sets made. The exact comparison alone drops a row: the estimate's noise never does."""

    def __init__(self, threshold: float, num_perm: int, ngram: int, signature_chunks, eligible: np.ndarray):
        from datasketch import MinHashLSH

        lsh = MinHashLSH(threshold=threshold, num_perm=num_perm, weights=(0.2, 0.8))
        self.threshold, self.ngram, self.bands, self.rows = threshold, ngram, lsh.b, lsh.r
        spread = max(threshold, 0.5)  # the estimate's variance J(1-J)/num_perm is largest at J = 0.5
        self.cutoff = threshold - ESTIMATE_SDS * (spread * (1 - spread) / num_perm) ** 0.5
        keys = [self.band_keys(chunk) for chunk in signature_chunks()]
        self.keys = np.concatenate(keys) if keys else np.zeros((0, self.bands), dtype=np.uint64)  # a bucket per key
        self.shared = np.zeros(self.keys.shape, dtype=bool)
        for band in range(self.bands):
            ordered = np.sort(self.keys[:, band])
            repeated = ordered[1:][ordered[1:] == ordered[:-1]]
            if len(repeated):
                self.shared[:, band] = np.isin(self.keys[:, band], repeated)
        self.asked = np.flatnonzero(self.shared.any(axis=1) & eligible)
        self.position = np.full(len(self.keys), -1, dtype=np.int64)
        self.position[self.asked] = np.arange(len(self.asked))
        sketches, at = [], 0  # the asked rows' signatures, low 16 bits (a chance equality only raises the estimate)
        for chunk in signature_chunks():
            sketches.append(chunk[self.position[at: at + len(chunk)] >= 0].astype(np.uint16))
            at += len(chunk)
        self.sketch = np.concatenate(sketches) if sketches else np.zeros((0, num_perm), dtype=np.uint16)
        self.members: dict[tuple[int, int], list[int]] = {}  # bucket -> kept rows in it
        self.kept: set[int] = set()
        self.grams: dict[int, np.ndarray] = {}  # n-gram sets of rows in a pair compared exactly

    def band_keys(self, signatures: np.ndarray) -> np.ndarray:
        bands = signatures[:, : self.bands * self.rows].astype(np.uint64).reshape(len(signatures), self.bands, self.rows)
        keys = np.zeros(bands.shape[:2], dtype=np.uint64)
        for k in range(self.rows):  # FNV-style mixing; wraps around in uint64
            keys = (keys * np.uint64(0x100000001B3)) ^ bands[:, :, k]
        return keys

    def gram_sets(self, lines: list[list]) -> list[np.ndarray]:
        """Each record's set of word n-gram hashes (sorted, unique), all records hashed at once:
        the word n-grams of normalized(its lines) for each, as describe_batch hashes a batch."""
        texts = [normalized(view).encode() for view in lines]
        hashes, word_starts = words_of_bytes(np.frombuffer(b"\n".join(texts), dtype=np.uint8))
        grams, counts = segment_shingles(hashes, words_of_texts(word_starts, texts), self.ngram)
        keys = np.sort((np.repeat(np.arange(len(texts), dtype=np.uint64), counts) << np.uint64(32)) | grams)
        keys = keys[np.concatenate(([True], keys[1:] != keys[:-1]))]  # (np.unique hashes first: slower here)
        cuts = np.searchsorted(keys >> np.uint64(32), np.arange(1, len(texts), dtype=np.uint64))
        return np.split(keys & np.uint64(0xFFFFFFFF), cuts)

    def buckets(self, i: int) -> list[tuple[int, int]]:
        return [(int(band), int(self.keys[i, band])) for band in np.flatnonzero(self.shared[i])]

    def close(self, i: int, candidates: list[int]) -> list[int]:
        """The candidates (in increasing order) whose MinHash estimate with row i reaches the cutoff."""
        if not candidates:
            return []
        at = self.position[np.array(candidates)]
        agree = np.count_nonzero(self.sketch[at] == self.sketch[self.position[i]], axis=1) / self.sketch.shape[1]
        return [j for j, ok in zip(candidates, (agree >= self.cutoff).tolist()) if ok]

    def decide(self, lines):
        """(row, the kept row it is a near copy of) of each near duplicate among the asked rows,
        in order; lines(rows) gives those rows' lines (rows in increasing order). A batch of
        rows at a time: first the pairs that could reach the threshold, against kept rows and
        against every earlier row of the batch (whether those are kept is not known yet), whose
        rows' n-gram sets are then made at once; then each row in order against the kept rows
        among them, exactly."""
        for lo in range(0, len(self.asked), NEAR_BATCH):
            batch = self.asked[lo: lo + NEAR_BATCH].tolist()
            buckets = [self.buckets(i) for i in batch]
            earlier: dict[tuple[int, int], list[int]] = {}
            plausible: dict[int, list[int]] = {}
            for i, where in zip(batch, buckets):
                candidates = {j for b in where for j in self.members.get(b, ())}
                candidates.update(j for b in where for j in earlier.get(b, ()))
                close = self.close(i, sorted(candidates))
                if close:
                    plausible[i] = close
                for b in where:
                    earlier.setdefault(b, []).append(i)
            need = sorted(({j for close in plausible.values() for j in close} | plausible.keys()) - self.grams.keys())
            if need:
                self.grams.update(zip(need, self.gram_sets(list(lines(np.array(need, dtype=np.int64))))))
            for i, where in zip(batch, buckets):
                copied = next((j for j in plausible.get(i, ()) if j in self.kept
                               and jaccard(self.grams[j], self.grams[i]) >= self.threshold), None)
                if copied is None:
                    self.kept.add(i)
                    for b in where:
                        self.members.setdefault(b, []).append(i)
                else:
                    self.grams.pop(i, None)  # a near copy is never compared again
                    yield i, copied


def jaccard(a: np.ndarray, b: np.ndarray) -> float:
    """Exact Jaccard similarity of two sets given as sorted unique arrays."""
    at = np.searchsorted(b, a)
    common = int(np.count_nonzero(b[np.minimum(at, len(b) - 1)] == a)) if len(b) else 0
    return common / (len(a) + len(b) - common)


def segment_shingles(h: np.ndarray, bounds: np.ndarray, n: int) -> tuple[np.ndarray, np.ndarray]:
    """32-bit hashes of the n-grams of each (lo, hi) segment of one array of word hashes,
    concatenated, and how many each segment has: every gram at once, whatever the segments'
    lengths. An n-gram combines its words' hashes; a segment of fewer than n words is one gram
    of them all, one without words one gram of an empty word."""
    lo, hi = bounds[:, 0], bounds[:, 1]
    lengths = hi - lo
    counts = np.maximum(lengths - n + 1, 1)
    first = np.cumsum(counts) - counts
    starts = np.repeat(lo, counts) + np.arange(int(counts.sum())) - np.repeat(first, counts)
    width = np.repeat(np.minimum(lengths, n), counts)  # words in each gram (fewer in a short segment)
    padded = np.append(h.astype(np.uint64), np.uint64(0))
    grams = padded[starts]
    for k in range(1, n):
        step = (grams * np.uint64(0x9E3779B1) + padded[np.minimum(starts + k, len(h))]) & np.uint64(0xFFFFFFFF)
        grams = np.where(width > k, step, grams)
    grams[width == 0] = 0  # a segment without words is one empty word
    return grams, counts


def murmur3_finalizer(h: np.ndarray) -> np.ndarray:
    """MurmurHash3's 32-bit finalizer (uint32 arithmetic wraps): the pre-mix datasketch's affine32
    scheme applies to each value before its permutations (its own copy is not public API)."""
    h = h ^ (h >> np.uint32(16))
    h = h * np.uint32(0x85EBCA6B)
    h = h ^ (h >> np.uint32(13))
    h = h * np.uint32(0xC2B2AE35)
    return h ^ (h >> np.uint32(16))


SIGNATURE_BATCH = 8192  # n-grams hashed under every permutation at once: 4 MiB at 128, in cache


def signatures(grams: np.ndarray, counts: np.ndarray, num_perm: int) -> np.ndarray:
    """The MinHash signature of each row's word n-grams (32-bit hashes; the rows' n-grams
    concatenated, `counts` per row, each >= 1): what datasketch's MinHash(scheme="affine32",
    seed=1).update_batch computes from these values, with its own pre-mix and permutations,
    applied to several rows' arrays at once. update_batch takes the values one Python call each."""
    a, b = (p[:, None] for p in _permutations(num_perm))
    mixed = murmur3_finalizer(grams.astype(np.uint32))
    ends = np.cumsum(counts)
    starts = ends - counts
    out = np.empty((len(counts), num_perm), dtype=np.uint32)
    work = np.empty((num_perm, max(SIGNATURE_BATCH, int(counts.max(initial=0)))), dtype=np.uint32)
    row = 0
    while row < len(counts):  # rows whose n-grams fit the batch (a longer row on its own)
        stop = max(int(np.searchsorted(ends, starts[row] + SIGNATURE_BATCH, side="right")), row + 1)
        lo, hi = starts[row], ends[stop - 1]
        hashed = work[:, : hi - lo]
        np.multiply(a, mixed[lo:hi], out=hashed)  # uint32 arithmetic wraps: the scheme's modulo 2**32
        np.add(hashed, b, out=hashed)
        out[row:stop] = np.minimum.reduceat(hashed, starts[row:stop] - lo, axis=1).T
        row = stop
    return out


DESCRIBE_BATCH = 256  # rows hashed together (their bytes, times the temporaries, stay a few MB)


def describe(lines: list[list], dedupe) -> dict[str, np.ndarray]:
    """What cleaning needs to know of each row (given as its lines), computed once and kept with
    its tokens, as arrays: `fingerprint` (n, 16) of the normalized text, `repetition` (n,) of the answers,
    and with near dedupe on the MinHash `signature` (n, num_perm) of the normalized text's
    word n-grams. Rows are hashed in batches (numpy's cost per call is paid per batch, not
    per row), and a row's answers' n-grams are slices of its normalized text's words."""
    batches = [describe_batch(lines[i: i + DESCRIBE_BATCH], dedupe) for i in range(0, len(lines), DESCRIBE_BATCH)]
    return {key: np.concatenate([b[key] for b in batches]) for key in batches[0]}


def describe_batch(lines: list[list], dedupe) -> dict[str, np.ndarray]:
    texts, answers, at = [], [], 0  # answers: (row, byte range) of each non-blank answer in the joined texts
    for row, view in enumerate(lines):
        folded = []
        for prefix, text, is_answer in view:
            line = (prefix + fold(text)).encode()
            if is_answer and text.strip():
                answers.append((row, at + len(prefix.encode()), at + len(line)))
            folded.append(line)
            at += len(line) + 1
        texts.append(b"\n".join(folded))
    hashes, word_starts = words_of_bytes(np.frombuffer(b"\n".join(texts), dtype=np.uint8))
    out = {"fingerprint": np.frombuffer(b"".join(map(fingerprint_of, texts)), dtype=np.uint8).reshape(-1, 16)}
    answers = np.array(answers, dtype=np.int64).reshape(-1, 3)
    grams, counts = segment_shingles(hashes, np.searchsorted(word_starts, answers[:, 1:]), 3)
    out["repetition"] = repeated_shares(grams, np.repeat(answers[:, 0], counts), len(texts))
    if dedupe.near_threshold:
        grams, counts = segment_shingles(hashes, words_of_texts(word_starts, texts), dedupe.ngram)
        out["signature"] = signatures(grams, counts, dedupe.num_perm)
    return out


def repeated_shares(grams: np.ndarray, rows: np.ndarray, n: int) -> np.ndarray:
    """For each of n rows, the share of its n-grams (`rows` says whose each gram is) that repeat
    an earlier one of the row: 0 for varied text, near 1 for loops. Repeats are equal neighbours
    once sorted by (row, gram)."""
    keys = np.sort((rows.astype(np.uint64) << np.uint64(32)) | grams.astype(np.uint64))
    repeats = np.bincount((keys[1:][keys[1:] == keys[:-1]] >> np.uint64(32)).astype(np.int64), minlength=n)
    totals = np.bincount(rows, minlength=n)
    return (repeats / np.maximum(totals, 1)).astype(np.float32)


REASONS = ("exact_duplicate", "near_duplicate", "repetitive")


def drop_reasons(fingerprints: np.ndarray, repetition: np.ndarray, dedupe, filters, signature_chunks,
                 lines) -> tuple[np.ndarray, np.ndarray]:
    """Why each row is dropped (0 kept, else 1 + the index in REASONS), deciding as if row by row
    in their fixed order, so the first row of a group of duplicates is kept, on every machine:
    a row is an exact duplicate of any earlier row with its fingerprint; else, with near dedupe
    on, a near duplicate of an earlier kept row (signature_chunks() gives every row's signature
    in order, and is called twice; lines(rows) gives those rows' lines in order, asked only of
    rows in a pair NearDuplicates compares exactly); else repetitive above filters.max_repetition. Also, for each duplicate, the row it repeats (-1
    for the others)."""
    codes = np.ones(len(fingerprints), dtype=np.int8)
    _, first, group = np.unique(np.ascontiguousarray(fingerprints).view(np.dtype((np.void, 16))).ravel(),
                                return_index=True, return_inverse=True)
    codes[first] = 0
    of = np.where(codes == 1, first[group.ravel()], -1)
    if dedupe.near_threshold:
        near = NearDuplicates(dedupe.near_threshold, dedupe.num_perm, dedupe.ngram, signature_chunks, codes == 0)
        for i, copied in near.decide(lines):
            codes[i], of[i] = 2, copied
    if filters.max_repetition is not None:
        codes[(codes == 0) & (repetition.astype(np.float64) > filters.max_repetition)] = 3
    return codes, of
