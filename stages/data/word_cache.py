"""Tokenization with a word cache: the tokenizer's own steps, each distinct word modelled once.

A fast tokenizer splits text at added tokens, normalizes, pre-tokenizes with a regex
into words, and runs its model (BPE...) on each word on its own, so a text's ids are
the concatenation of its words' ids. Most words of a corpus recur, and the Rust encode
(offsets for every token, its objects handed back to Python) cost about four times what
this does on chat rows: here the split runs with the tokenizer's own pattern (`regex`,
the module transformers' Python tokenizers used for these same patterns, or `re` where a
translation is exact: Splitter), and each word's ids come from the tokenizer's own model
the first time the word is seen. For the common patterns even the split is cached: text
is cut at spaces into units that recur as words do (WordCache).

Only tokenizers whose pipeline is exactly that are taken (see WordCache.of); for any
other, or a text that is not NFC where the tokenizer normalizes to NFC, callers use
the Rust encode. tests/test_word_cache.py holds the two to the same ids.
"""
from __future__ import annotations

import functools
import json
import random
import re
import unicodedata
from dataclasses import dataclass

import numpy as np
import regex

# tokenizers' ByteLevel pre-tokenizer's own pattern (GPT-2's), used when use_regex is set
BYTE_LEVEL_PATTERN = r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""
# Qwen2/Qwen3's and gpt-oss's (o200k) Split patterns, as their tokenizer.json files hold them
QWEN_PATTERN = (r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"""
                r"""|\s*[\r\n]+|\s+(?!\S)|\s+""")
O200K_PATTERN = "|".join([
    r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
    r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
    r"""\p{N}{1,3}""", r""" ?[^\s\p{L}\p{N}]+[\r\n/]*""", r"""\s*[\r\n]+""", r"""\s+(?!\S)""", r"""\s+"""])
# Patterns under which a text may be cut before any space that follows a non-whitespace
# character, and each part split on its own, giving the same words. In each, a match that
# has taken a non-whitespace character goes on over no whitespace but line breaks, there is
# no lookbehind or anchor, and the one lookahead follows whitespace only: no match runs over
# such a cut, none ends differently for what lies past it, and the part after it is matched
# from its start as it would be in place (tests/test_word_cache.py checks the words).
SPACE_CUT_PATTERNS = frozenset({BYTE_LEVEL_PATTERN, QWEN_PATTERN, O200K_PATTERN})
MODELS = ("BPE", "WordLevel")
POST_PROCESSORS = ("TemplateProcessing", "ByteLevel", "Sequence")  # none of them moves offsets here


class WordCache:
    """Encodes text to (ids, where each token's word starts), as the tokenizer would.

    The cached entity is a unit: one word, or under SPACE_CUT_PATTERNS a run of words cut
    out of the text at spaces (str.split, no regex), such as " word," (" word" and ",").
    Units are numbered as first seen; a unit's number indexes arrays of its length, token
    count and first position in flat arrays of all known units' ids and, per token, its
    word's offset in the unit, so a batch of texts' ids are one dict lookup per unit and one
    numpy gather. The regex and the model run once per distinct unit and word. The tables
    are emptied, between batches, when they pass MAX_UNITS (memory stays bounded on text
    with ever-new words: numbers, names, URLs)."""

    MAX_UNITS = 1 << 20

    def __init__(self, backend, pattern: str | None, byte_level: bool, nfc: bool, added: list[dict]):
        from transformers.convert_slow_tokenizer import bytes_to_unicode

        self.model, self.nfc = backend.model, nfc
        self.splitter = Splitter(pattern) if pattern else None
        self.space_cut = pattern in SPACE_CUT_PATTERNS
        self.byte_char = bytes_to_unicode() if byte_level else None
        # the tokenizer finds added tokens in two passes: those matched on the raw text, then
        # (in what is left) those matched on normalized text; each pass takes the longest match
        self.added = [alternation([t["content"] for t in added if t["normalized"] == normalized])
                      for normalized in (False, True)]
        self.added_ids = {t["content"]: t["id"] for t in added}
        self.clear()

    def clear(self) -> None:
        self.word_ids: dict[str, list[int]] = {}
        self.units: dict[str, int] = {}  # unit -> its number (added tokens, words, segments' first units)
        self.spaced: dict[str, int] = {}  # x -> the number of unit " " + x
        self.length, self.count, self.first = (np.zeros(1024, dtype=np.int64) for _ in range(3))
        self.flat, self.offset, self.used = np.zeros(4096, dtype=np.int32), np.zeros(4096, dtype=np.int64), 0
        self.stored = 0  # units numbered so far
        for content, i in self.added_ids.items():
            self.units[content] = self.store(len(content), [i], [0])

    @staticmethod
    @functools.lru_cache(maxsize=8)
    def of(tok) -> WordCache | None:
        """A cache for this tokenizer if its pipeline is one this module reproduces, else None."""
        pipeline = split_pipeline(tok)
        if pipeline is None or pipeline[0]["model"]["type"] not in MODELS:
            return None
        spec, nfc, (pattern, byte_level) = pipeline
        try:
            return WordCache(tok.backend_tokenizer, pattern, byte_level, nfc, spec["added_tokens"])
        except regex.error:
            return None  # a pattern in a regex dialect the regex module does not read

    def store(self, length: int, ids: list[int], offsets: list[int]) -> int:
        """A new unit's number, for its length in characters, ids and each id's word offset."""
        n, self.stored = self.stored, self.stored + 1
        if n == len(self.length):
            self.length, self.count, self.first = (np.concatenate([a, np.zeros_like(a)]) for a in
                                                   (self.length, self.count, self.first))
        while self.used + len(ids) > len(self.flat):
            self.flat, self.offset = (np.concatenate([a, np.zeros_like(a)]) for a in (self.flat, self.offset))
        self.flat[self.used: self.used + len(ids)] = ids
        self.offset[self.used: self.used + len(ids)] = offsets
        self.length[n], self.count[n], self.first[n] = length, len(ids), self.used
        self.used += len(ids)
        return n

    def model_ids(self, word: str) -> list[int]:
        """The model's ids for one word (seen for the first time)."""
        piece = "".join(self.byte_char[b] for b in word.encode()) if self.byte_char else word
        return [t.id for t in self.model.tokenize(piece)]

    def learn(self, words: list[str]) -> int:
        """A new unit made of these words."""
        ids, offsets, at = [], [], 0
        for w in words:
            w_ids = self.word_ids.get(w)
            if w_ids is None:
                w_ids = self.word_ids[w] = self.model_ids(w)
            ids += w_ids
            offsets += [at] * len(w_ids)
            at += len(w)
        return self.store(at, ids, offsets)

    def unit(self, unit: str) -> int:
        """The number of a unit: under SPACE_CUT_PATTERNS the first unit of a segment (split
        here), else a word as the pattern found it in place."""
        n = self.units.get(unit)
        if n is None:
            n = self.units[unit] = self.learn(self.splitter.findall(unit) if self.space_cut else [unit])
        return n

    def spaced_unit(self, x: str) -> int:
        """The number of unit " " + x, remembered only if a cut may follow it."""
        n = self.spaced.get(x)
        if n is None:
            n = self.learn(self.splitter.findall(" " + x))
            if x and not x[-1].isspace():
                self.spaced[x] = n
        return n

    def numbers(self, text: str) -> list[int]:
        """The numbers of the text's units: added tokens whole, the rest split by the
        pre-tokenizer's pattern (into words, or under SPACE_CUT_PATTERNS into units)."""
        out = []
        for k, part in enumerate(split(self.added[0], text)):
            for j, segment in enumerate([part] if k % 2 else split(self.added[1], part)):
                if k % 2 or j % 2:
                    out.append(self.units[segment])  # an added token
                elif segment and self.space_cut:
                    out += self.segment_units(segment)
                elif segment:
                    out += map(self.unit, self.splitter.findall(segment) if self.splitter else [segment])
        return out

    def segment_units(self, segment: str) -> list[int]:
        """Unit numbers of a text between added tokens: cut before each space that follows a
        non-whitespace character (see SPACE_CUT_PATTERNS). `spaced` holds only pieces that end
        in non-whitespace, so when every piece is found there, every space is such a cut;
        otherwise the pieces are joined where a space is not one."""
        head, *rest = segment.split(" ")
        out = list(map(self.spaced.get, rest))
        if None in out or (rest and head and head[-1].isspace()):
            head, rest = joined_where_not_cut(head, rest)
            out = list(map(self.spaced_unit, rest))
        return [self.unit(head), *out] if head else out

    def encode_batch(self, texts: list[str]) -> Encoded:
        """The texts' ids and where each token's word starts, in one numpy pass for all of them
        (numpy's cost per call is paid per batch). A text the cache does not reproduce (not NFC
        where the tokenizer normalizes, or split in a way this module does not know) is marked
        for the tokenizer itself. The tables are emptied, if full, before a batch, never in one."""
        if self.stored > self.MAX_UNITS:
            self.clear()
        numbers, units = [], np.zeros(len(texts), dtype=np.int64)
        ok = np.ones(len(texts), dtype=bool)
        for k, text in enumerate(texts):
            if self.nfc and not unicodedata.is_normalized("NFC", text):
                ok[k] = False
                continue
            found = self.numbers(text)
            numbers += found
            units[k] = len(found)
        numbers = np.array(numbers, dtype=np.int64)
        lengths, counts = self.length[numbers], self.count[numbers]
        text_of = np.repeat(np.arange(len(texts)), units)
        # the pattern skipped characters: a split this module does not reproduce
        ok &= np.bincount(text_of, weights=lengths, minlength=len(texts)) == [len(t) for t in texts]
        at = np.cumsum(counts) - counts  # where each unit's ids begin in the batch's ids
        positions = np.arange(int(counts.sum())) + np.repeat(self.first[numbers] - at, counts)
        unit_ends = np.cumsum(lengths)
        text_start = np.repeat(np.cumsum(units) - units, units)  # (the text's first unit)
        in_text = unit_ends - lengths - np.append(0, unit_ends)[text_start]
        starts = np.repeat(in_text, counts) + self.offset[positions]
        bounds = np.append(0, np.cumsum(np.bincount(text_of, weights=counts, minlength=len(texts)))).astype(np.int64)
        return Encoded(self.flat[positions], starts, bounds, ok)


@dataclass
class Encoded:
    """Texts' tokens, end to end: ids, where (in characters, in its own text) each token's word
    starts (each token's own start where `per_token`), token `bounds` of each text (n + 1), and
    `ok`: False for a text whose tokens are not here and must come from the tokenizer itself."""
    ids: np.ndarray
    starts: np.ndarray
    bounds: np.ndarray
    ok: np.ndarray
    per_token: bool = False

    def __getitem__(self, k: int) -> tuple[np.ndarray, np.ndarray] | None:
        lo, hi = self.bounds[k], self.bounds[k + 1]
        return (self.ids[lo:hi], self.starts[lo:hi]) if self.ok[k] else None


# What Unicode classes hold among ASCII characters ("" for none), as the regex module reads them
ASCII_MEMBERS = {"L": "a-zA-Z", "Lu": "A-Z", "Ll": "a-z", "Lt": "", "Lm": "", "Lo": "", "M": "", "Mn": "",
                 "Mc": "", "Me": "", "N": "0-9", "Nd": "0-9", "Nl": "", "No": "", "s": "\\t\\n\\x0b\\x0c\\r ",
                 "d": "0-9"}
ESCAPE = regex.compile(r"\\p\{(\w+)\}|\\([sdS])|\\.|\[\^?|\]|[^\\\[\]]+")


class Splitter:
    """The pre-tokenizer's pattern, run by the standard `re` module wherever that is exact.

    A translation of the pattern (each Unicode class -> its ASCII members) finds the same
    words as the pattern, twice as fast, on text whose non-ASCII characters belong to none of
    the classes the pattern names (nor are letters, whose case rules reach ASCII: the long s,
    the Kelvin sign): to both, such a character is just "not in any class". Quotes, dashes
    and currency signs are the usual ones; a text with any other goes to `regex`."""

    def __init__(self, pattern: str):
        self.original = regex.compile(pattern)
        self.ascii = ascii_version(pattern) if pattern.isascii() else None
        named = {m.group(1) or m.group(2) for m in ESCAPE.finditer(pattern)} - {None}
        classes = "".join({"s": r"\s", "S": r"\s", "d": r"\d"}.get(c, rf"\p{{{c}}}") for c in sorted(named | {"L"}))
        self.in_a_class = regex.compile(rf"[^\x00-\x7f](?<=[{classes}])")

    def findall(self, text: str) -> list[str]:
        if self.ascii is not None and (text.isascii() or not self.in_a_class.search(text)):
            return self.ascii.findall(text)
        return self.original.findall(text)


def ascii_version(pattern: str):
    """The pattern for the standard `re` module, exact on ASCII-only text. None when the pattern
    uses something this does not translate, or the two disagree on a sample of ASCII text."""
    out, in_class = [], False
    for m in ESCAPE.finditer(pattern):
        name, short, piece = m.group(1), m.group(2), m.group(0)
        if name is not None or short in ("s", "d"):
            members = ASCII_MEMBERS.get(name or short)
            if members is None:
                return None
            piece = members if in_class else (f"[{members}]" if members else "(?!)")
        elif short == "S":
            if in_class:
                return None
            piece = f"[^{ASCII_MEMBERS['s']}]"
        elif piece[0] == "\\" and piece[1].isalnum() and piece[1] not in "rntfv":
            return None  # \w, \b, \x..: classes and anchors that would need their own translation
        elif piece.startswith("["):
            in_class = True
        elif piece == "]":
            in_class = False
        out.append(piece)
    try:
        translated = re.compile("".join(out))
    except re.error:
        return None
    original, rng = regex.compile(pattern), random.Random(0)
    alphabet = [chr(c) for c in range(128)] + list("  aAzZ09'sStTdDmMlLrReEvV\n\r") * 4
    for _ in range(2000):
        text = "".join(rng.choices(alphabet, k=rng.randint(1, 24)))
        if translated.findall(text) != original.findall(text):
            return None
    return translated


def joined_where_not_cut(head: str, rest: list[str]) -> tuple[str, list[str]]:
    """head and rest (text = head + " " + rest[0] + " " + ...) with each space that follows
    whitespace (or another space) joined back into the unit before it: those are not cuts."""
    joined: list[str] = []
    for x in rest:
        before = (" " + joined[-1]) if joined else head
        if before and not before[-1].isspace():  # str.isspace covers all that \s matches
            joined.append(x)
        elif joined:
            joined[-1] += " " + x
        else:
            head += " " + x
    return head, joined


def alternation(tokens: list[str]):
    """A pattern matching any of `tokens`, longest first (None for no tokens)."""
    longest_first = sorted(tokens, key=lambda t: (-len(t), t))
    return regex.compile("(" + "|".join(map(regex.escape, longest_first)) + ")") if tokens else None


def split(pattern, text: str) -> list[str]:
    """text around the matches of `pattern`, the matches at odd indices."""
    return pattern.split(text) if pattern else [text]


def split_pipeline(tok) -> tuple[dict, bool, tuple[str | None, bool]] | None:
    """(the tokenizer's spec, whether it normalizes to NFC, its pre-tokenizer's (pattern,
    byte-level?)) where its pipeline is normalize (NFC or nothing), split by a pattern, then
    the model once per word, with added tokens matched as written and offsets left as the
    pre-tokenizer gives them: what the word cache and the tiktoken encoder both reproduce
    (each then checks its model). None for any other pipeline."""
    spec = json.loads(tok.backend_tokenizer.to_str())
    if tok.backend_tokenizer.encode_special_tokens or spec["truncation"] or spec["padding"] \
            or any(t["lstrip"] or t["rstrip"] or t["single_word"] for t in spec["added_tokens"]):
        return None
    normalizer = (spec["normalizer"] or {}).get("type")
    steps = pre_tokenizer_steps(spec["pre_tokenizer"])
    if normalizer not in (None, "NFC") or spec["model"].get("dropout") or steps is None \
            or not post_processor_keeps_offsets(spec["post_processor"]):
        return None
    return spec, normalizer == "NFC", steps


def post_processor_keeps_offsets(spec: dict | None) -> bool:
    """Offsets (which loss masks read) are the pre-tokenizer's own: no trimming afterwards."""
    if spec is None:
        return True
    if spec["type"] == "Sequence":
        return all(post_processor_keeps_offsets(s) for s in spec["processors"])
    return spec["type"] in POST_PROCESSORS and not (spec["type"] == "ByteLevel" and spec.get("trim_offsets"))


def pre_tokenizer_steps(spec: dict | None) -> tuple[str | None, bool] | None:
    """(split pattern, byte-level?) for the pre-tokenizers this module reproduces: ByteLevel
    (its own pattern or none), an isolating regex Split, or a Split then a pattern-less ByteLevel."""
    steps = spec["pretokenizers"] if spec and spec["type"] == "Sequence" else [spec] if spec else []
    pattern, byte_level = None, False
    for i, step in enumerate(steps):
        if step["type"] == "Split" and i == 0 and "Regex" in step["pattern"] \
                and step["behavior"] == "Isolated" and not step["invert"]:
            pattern = step["pattern"]["Regex"]
        elif step["type"] == "ByteLevel" and i == len(steps) - 1 and not step["add_prefix_space"] \
                and not (step["use_regex"] and pattern):
            byte_level = True
            pattern = BYTE_LEVEL_PATTERN if step["use_regex"] else pattern
        else:
            return None
    return pattern, byte_level
