"""Tokenization through tiktoken, for byte-level BPE tokenizers that tiktoken encodes exactly.

Qwen's (and OpenAI's) tokenizers are tiktoken rank files converted to Hugging Face's format:
their merges are the ranks in order, so tiktoken's BPE (merge the adjacent pair whose result
ranks lowest) and the Rust tokenizer's (apply the earliest merge first) give the same ids.
tiktoken's encoder hands back plain ids, without the per-token offset objects the Rust encode
builds, and on text whose words rarely repeat (code, numbers, other scripts, where the word
cache keeps learning) it is the fastest exact encoder here. Loss masks need where each token
starts: that comes from each token's length in bytes, mapped to characters, and is what the
Rust tokenizer's offsets give (a token that starts inside a character starts with it).

Taken only where the pipeline is exactly that (TiktokenEncoder.of: byte-level BPE whose merges
are its ranks in order, a split pattern tiktoken reads, added tokens matched as written);
texts that are not NFC where the tokenizer normalizes go to the Rust encode.
tests/test_word_cache.py holds it to the Rust tokenizer's ids and masks.
"""
from __future__ import annotations

import functools
import importlib.util
import unicodedata

import numpy as np

from stages.data.word_cache import Encoded, WordCache, split_pipeline


def merges_are_ranks(vocab: dict[str, int], merges: list) -> bool:
    """True where the merges are every split of every token into two tokens, ordered by the
    merged token's rank, as a tiktoken rank file converted to Hugging Face's format has them:
    then any two adjacent tokens whose join is a token merge, lowest rank first, which is
    tiktoken's BPE. (A BPE trained by merges has fewer: some joins that are tokens may not
    merge, and tiktoken would merge them.)"""
    pairs = [tuple(m.split(" ")) if isinstance(m, str) else tuple(m) for m in merges]
    merged = [vocab.get(a + b) for a, b in pairs]
    if None in merged or any(x > y for x, y in zip(merged, merged[1:])):
        return False
    splits = sum(1 for t in vocab for i in range(1, len(t)) if t[:i] in vocab and t[i:] in vocab)
    return splits == len(set(pairs)) == len(pairs)


class TiktokenEncoder:
    """Encodes texts to Encoded (ids, where each token starts in characters, bounds, ok)."""

    def __init__(self, encoding, nfc: bool, token_bytes: np.ndarray):
        self.encoding, self.nfc, self.token_bytes = encoding, nfc, token_bytes

    @staticmethod
    @functools.lru_cache(maxsize=8)
    def of(tok) -> TiktokenEncoder | None:
        """An encoder for this tokenizer if tiktoken reproduces it exactly, else None."""
        if importlib.util.find_spec("tiktoken") is None:
            return None
        import tiktoken
        from transformers.convert_slow_tokenizer import bytes_to_unicode

        pipeline = split_pipeline(tok)
        if pipeline is None:
            return None
        spec, nfc, (pattern, byte_level) = pipeline
        model, added = spec["model"], spec["added_tokens"]
        if model["type"] != "BPE" or model.get("continuing_subword_prefix") or model.get("end_of_word_suffix") \
                or not byte_level or pattern is None or any(t["normalized"] for t in added):
            return None
        byte_of = {c: b for b, c in bytes_to_unicode().items()}
        try:
            ranks = {bytes(byte_of[c] for c in token): i for token, i in model["vocab"].items()}
        except KeyError:
            return None  # a vocabulary entry that is not byte-level
        if not merges_are_ranks(model["vocab"], model["merges"]):
            return None
        specials = {t["content"]: t["id"] for t in added}
        try:
            encoding = tiktoken.Encoding(f"mindxtrain-{id(tok)}", pat_str=pattern, mergeable_ranks=ranks,
                                         special_tokens=specials)
        except ValueError:
            return None  # a pattern tiktoken's regex engine does not read
        token_bytes = np.zeros(max(max(ranks.values()), max(specials.values(), default=0)) + 1, dtype=np.int64)
        for token, i in ranks.items():
            token_bytes[i] = len(token)
        for content, i in specials.items():
            token_bytes[i] = len(content.encode())
        return TiktokenEncoder(encoding, nfc, token_bytes)

    def encode_batch(self, texts: list[str]) -> Encoded:
        """The texts' ids and where each token starts (in characters, in its own text); a text
        that is not NFC where the tokenizer normalizes is marked for the Rust encode."""
        ok = np.array([not self.nfc or unicodedata.is_normalized("NFC", t) for t in texts], dtype=bool)
        texts = [t if good else "" for t, good in zip(texts, ok)]
        ids = [self.encoding.encode_to_numpy(t, allowed_special="all") for t in texts]  # one process per core already
        counts = np.array([len(x) for x in ids], dtype=np.int64)
        bounds = np.append(0, np.cumsum(counts))
        flat = np.concatenate(ids).astype(np.int32) if ids else np.zeros(0, dtype=np.int32)
        raw = [t.encode() for t in texts]
        lengths = self.token_bytes[flat]
        ends = np.cumsum(lengths)
        sizes = np.array([len(b) for b in raw], dtype=np.int64)
        tiled = np.append(0, ends)[bounds[1:]] - np.append(0, ends)[bounds[:-1]] == sizes
        byte_base = np.append(0, np.cumsum(sizes))  # each text's first byte, all texts end to end
        local = ends - lengths - np.repeat(np.append(0, ends)[bounds[:-1]], counts)
        # bytes to characters: a byte belongs to the character whose first byte is the last at or before it
        everything = np.frombuffer(b"".join(raw), dtype=np.uint8)
        chars_before = np.append(0, np.cumsum((everything & 0xC0) != 0x80))
        at = np.minimum(local + np.repeat(byte_base[:-1], counts), max(len(everything) - 1, 0))
        starts = chars_before[at + 1] - 1 - np.repeat(chars_before[byte_base[:-1]], counts)
        return Encoded(flat, starts.astype(np.int64), bounds.astype(np.int64), ok & tiled, per_token=True)


def encoder_of(tok) -> TiktokenEncoder | WordCache | None:
    """The fastest exact encoder this tokenizer allows: tiktoken where it reproduces it (fastest
    on long-tailed text), else the word cache (stages/data/word_cache.py), else None: callers
    then use the Rust encode."""
    return TiktokenEncoder.of(tok) or WordCache.of(tok)


def encode_texts(tok, texts: list[str]) -> list[np.ndarray]:
    """Token ids of each text (no special tokens added): through encoder_of's encoder where it
    reproduces the tokenizer, else in one batch call of the Rust tokenizer."""
    encoder, out = encoder_of(tok), [None] * len(texts)
    if encoder:
        encoded = encoder.encode_batch(texts)
        out = [None if got is None else got[0] for got in map(encoded.__getitem__, range(len(texts)))]
    rest = [k for k, ids in enumerate(out) if ids is None]
    for k, enc in zip(rest, tok.backend_tokenizer.encode_batch([texts[k] for k in rest], add_special_tokens=False)):
        out[k] = np.array(enc.ids, dtype=np.int32)
    return out
