"""The word cache, and the tiktoken encoder where it is taken, give the Rust tokenizer's own ids,
and the same loss masks, on every real row in ../shared/datasets, on Python source and on text
built to trip them: Unicode classes and scripts, case folding, line breaks, non-NFC text,
added tokens inside words."""
from __future__ import annotations

import gzip
import json
import random
import unicodedata
from pathlib import Path

import numpy as np
import pytest
import trl

from stages.data import template
from stages.model.tiny import char_tokenizer
from stages.data.tiktoken_encoder import TiktokenEncoder, encode_texts
from stages.data.word_cache import BYTE_LEVEL_PATTERN, O200K_PATTERN, QWEN_PATTERN, SPACE_CUT_PATTERNS, WordCache, \
    ascii_version, joined_where_not_cut

SHARED = Path(__file__).resolve().parents[2] / "shared" / "datasets"
QWEN3 = SHARED.parent / "tokenizers" / "qwen3"
TRICKY = ("é", "É", "³", "½", "Ⅻ", "\u00a0", "\u2028", "\x85", "\u3000", "\u200b", "ſ", "K", "ﬆ", "İ", "ı",
          "\u0301", "e\u0301", "中文", "😀", "’", "€", "—", "\r\n", "\n\n", "\t", "'s", "'S", "'ll", "'LL",
          "12345", " ", "  ", "<|im_end|>", "<think>", "a<|im_start|>b", "thinking", "'", "\x1c", "_")


def shared_texts() -> list[str]:
    """Every string in every row of ../shared/datasets."""
    def strings(value):
        if isinstance(value, str):
            yield value
        elif isinstance(value, dict):
            for v in value.values():
                yield from strings(v)
        elif isinstance(value, list):
            for v in value:
                yield from strings(v)

    out = []
    for path in sorted(SHARED.rglob("*.json*")):
        raw = gzip.open(path, "rt").read() if path.suffix == ".gz" else path.read_text()
        rows = json.loads(raw) if path.suffix == ".json" else [json.loads(line) for line in raw.splitlines()]
        for row in rows:
            out += strings(row)
    return out


def fuzz_texts(n: int = 3000) -> list[str]:
    rng = random.Random(0)
    pool = list(TRICKY) + ["word", " word", "Word", "x", "7", ".", ",", "!", "?", "\n", " "] * 3
    return ["".join(rng.choices(pool, k=rng.randint(1, 30))) for _ in range(n)]


def byte_level_bpe(pattern: str | None, nfc: bool = False):
    """A byte-level BPE trained on real text with ChatML and Qwen3's added tokens: with
    `pattern`, Qwen's layout (regex Split, then a pattern-less ByteLevel, NFC, offsets kept);
    without, GPT-2's (ByteLevel with its own pattern)."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, \
        processors, trainers
    from transformers import PreTrainedTokenizerFast

    bpe = Tokenizer(models.BPE())
    if pattern:
        bpe.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(pattern), "isolated"),
                                                     pre_tokenizers.ByteLevel(add_prefix_space=False,
                                                                              use_regex=False)])
        bpe.post_processor = processors.ByteLevel(trim_offsets=False)
    else:
        bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    if nfc:
        bpe.normalizer = normalizers.NFC()
    bpe.decoder = decoders.ByteLevel()
    corpus = (shared_texts() or fuzz_texts())[:20000] + fuzz_texts(500)
    bpe.train_from_iterator(corpus, trainers.BpeTrainer(vocab_size=3000, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                                        special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"]))
    bpe.add_tokens([AddedToken("<think>", normalized=False, special=False),
                    AddedToken("</think>", normalized=False, special=False),
                    AddedToken("thinking", normalized=True, special=False)])  # added, matched after normalizing
    tok = PreTrainedTokenizerFast(tokenizer_object=bpe, eos_token="<|im_end|>", pad_token="<|endoftext|>")
    tok.chat_template = (Path(trl.__file__).parent / "chat_templates" / "qwen3.jinja").read_text()
    return tok


TOKENIZERS = {
    "gpt2_byte_level": lambda: byte_level_bpe(None),
    "qwen_split_nfc_byte_level": lambda: byte_level_bpe(QWEN_PATTERN, nfc=True),
    "o200k_split_byte_level": lambda: byte_level_bpe(O200K_PATTERN),
    "char_level": char_tokenizer,
}


@pytest.fixture(scope="module", params=sorted(TOKENIZERS))
def tok(request):
    return TOKENIZERS[request.param]()


def test_same_ids_as_the_tokenizer(tok):
    cache, backend = WordCache.of(tok), tok.backend_tokenizer
    assert cache is not None
    texts = shared_texts() + fuzz_texts()
    assert len(texts) > 3000 or not SHARED.is_dir()  # the real rows, where this machine has them
    refused = 0
    encoded = cache.encode_batch(texts)
    for k, text in enumerate(texts):
        got = encoded[k]
        if got is None:  # only text the tokenizer would first normalize
            assert cache.nfc and not unicodedata.is_normalized("NFC", text), repr(text)
            refused += 1
            continue
        ids, starts = got
        want = backend.encode(text, add_special_tokens=False)
        assert ids.tolist() == want.ids, repr(text)
        first_tokens = np.flatnonzero(np.diff(starts, prepend=-1))  # of each word
        offsets = np.array(want.offsets, dtype=np.int64).reshape(-1, 2)
        assert offsets[first_tokens, 0].tolist() == starts[first_tokens].tolist(), repr(text)
        assert (offsets[:, 0] >= starts).all(), repr(text)
    assert refused < len(texts) / (10 if SHARED.is_dir() else 4)  # (fuzzed text alone is often not NFC)


def test_encode_texts_gives_the_tokenizers_ids(tok):
    """What continued pretraining and GRPO prompts use: the cache where it can, Rust elsewhere."""
    texts = fuzz_texts(500)
    want = [enc.ids for enc in tok.backend_tokenizer.encode_batch(texts, add_special_tokens=False)]
    assert [ids.tolist() for ids in encode_texts(tok, texts)] == want


def test_same_masks_as_the_tokenizer_offsets(tok):
    """Chats from the real data (and fuzzed ones) through Qwen3's template: the word cache and
    the Rust offsets give the same ids and loss masks, row by row."""
    rng = random.Random(1)
    texts = shared_texts()[:2000] + fuzz_texts(1000)
    conversations = []
    for i in range(0, len(texts) - 4, 4):
        turn = {"role": "assistant", "content": texts[i + 2]}
        if i % 8 == 0:
            turn["reasoning"] = texts[i + 3]
        conversations.append([{"role": "system", "content": texts[i]}, {"role": "user", "content": texts[i + 1]},
                              turn, {"role": "user", "content": rng.choice(texts)},
                              {"role": "assistant", "content": rng.choice(texts)}])
    special, cache = template.special_table(tok), WordCache.of(tok)
    texts, spans = zip(*(template.render_with_spans(tok, m) for m in conversations))
    by_words = 0
    for text, sp, got in zip(texts, spans, template.masked_by_words(cache.encode_batch(texts), texts, spans, special)):
        [(want_ids, want_mask)] = template.encode_with_offsets(tok, [text], [sp], special)
        if got is not None:
            by_words += 1
            assert got[0].tolist() == want_ids.tolist()
            assert got[1].tolist() == want_mask.tolist(), repr(text)
    assert by_words > (len(conversations) / 2 if SHARED.is_dir() else 0)  # fuzzed Unicode alone falls back more


def test_pipelines_it_does_not_reproduce_go_to_the_tokenizer():
    from tokenizers import AddedToken, pre_tokenizers, processors

    tok = byte_level_bpe(None)
    tok.backend_tokenizer.post_processor = processors.ByteLevel(trim_offsets=True)  # moves offsets
    assert WordCache.of(tok) is None
    tok = byte_level_bpe(None)
    tok.backend_tokenizer.pre_tokenizer = pre_tokenizers.Metaspace()
    assert WordCache.of(tok) is None
    tok = byte_level_bpe(None)
    tok.add_tokens([AddedToken("<tool>", lstrip=True)])
    assert WordCache.of(tok) is None
    tok = byte_level_bpe(None)
    tok.backend_tokenizer.enable_truncation(16)
    assert WordCache.of(tok) is None


def test_patterns_translate_to_ascii_where_they_can():
    for pattern in (BYTE_LEVEL_PATTERN, QWEN_PATTERN, O200K_PATTERN):
        assert ascii_version(pattern) is not None, pattern
    assert ascii_version(r"\w+|\s+") is None  # \w differs between re and regex beyond ASCII
    assert ascii_version(r"[\s\S]") is None


@pytest.mark.parametrize("pattern", sorted(SPACE_CUT_PATTERNS))
def test_cutting_before_spaces_keeps_the_words(pattern):
    """Under each SPACE_CUT_PATTERNS pattern, splitting the units the cache cuts a text into
    gives the pattern's own words for the whole text, on real text and on text dense in
    spaces, line breaks and other whitespace."""
    import regex

    whole = regex.compile(pattern)
    spacey = ["  ", " ", "\n ", "\t", " \n", "\u3000 ", "\xa0", "\x1c ", "a", "B", "7", ".", "'s", "\r\n", "/"]
    rng = random.Random(2)
    texts = shared_texts()[:3000] + fuzz_texts(2000) + ["".join(rng.choices(spacey, k=rng.randint(1, 40)))
                                                         for _ in range(3000)]
    for text in texts:
        head, *rest = text.split(" ")
        head, rest = joined_where_not_cut(head, rest)
        units = [head] + [" " + x for x in rest]
        assert [w for u in units for w in whole.findall(u)] == whole.findall(text), repr(text)


def test_tables_emptied_between_texts_give_the_same_ids(tok):
    cache = WordCache.of(tok)
    cache.clear()
    cache.MAX_UNITS = 16
    stored = []
    texts = shared_texts()[:300] + fuzz_texts(300)
    for text in texts[:200]:  # a text at a time, and below, ten at a time: emptied only between batches
        got = cache.encode_batch([text])[0]
        stored.append(cache.stored)
        if got is not None:
            assert got[0].tolist() == tok.backend_tokenizer.encode(text, add_special_tokens=False).ids, repr(text)
    for k in range(200, len(texts), 10):
        encoded = cache.encode_batch(texts[k: k + 10])
        stored.append(cache.stored)
        for text, got in zip(texts[k: k + 10], map(encoded.__getitem__, range(10))):
            if got is not None:
                assert got[0].tolist() == tok.backend_tokenizer.encode(text, add_special_tokens=False).ids, repr(text)
    assert any(b < a for a, b in zip(stored, stored[1:]))  # emptied along the way
    del cache.MAX_UNITS
    cache.clear()


def source_texts(n: int = 400) -> list[str]:
    """Excerpts of Python source from the standard library (identifiers, numbers, strings,
    comments, and the Unicode of its tests), 40 lines each."""
    import sysconfig

    files = sorted(Path(sysconfig.get_paths()["stdlib"]).glob("test/test_*.py"))[:: 5]
    out = []
    for path in files:
        lines = path.read_text(encoding="utf-8", errors="replace").splitlines(keepends=True)
        out += ["".join(lines[i: i + 40]) for i in range(0, len(lines), 400)]
    return out[:n]


@pytest.fixture(scope="module")
def qwen3():
    from transformers import AutoTokenizer

    if not QWEN3.is_dir():
        pytest.skip(f"no Qwen3 tokenizer at {QWEN3}")
    return AutoTokenizer.from_pretrained(QWEN3)


def test_tiktoken_gives_qwen3s_ids_and_token_starts(qwen3):
    encoder, backend = TiktokenEncoder.of(qwen3), qwen3.backend_tokenizer
    assert encoder is not None  # Qwen's BPE is a tiktoken rank file converted
    texts = shared_texts() + fuzz_texts() + source_texts()
    encoded = encoder.encode_batch(texts)
    refused = 0
    for k, text in enumerate(texts):
        got = encoded[k]
        if got is None:
            assert not unicodedata.is_normalized("NFC", text), repr(text)
            refused += 1
            continue
        want = backend.encode(text, add_special_tokens=False)
        assert got[0].tolist() == want.ids, repr(text)
        assert got[1].tolist() == [a for a, _ in want.offsets], repr(text)
    assert refused < len(texts) / 4


def test_tiktoken_masks_equal_the_tokenizer_offsets(qwen3):
    """Qwen3's template over real rows, source and fuzzed text: the tiktoken path and the Rust
    offsets give the same ids and loss masks, and the tiktoken path takes most rows."""
    rng = random.Random(3)
    texts = shared_texts()[:1500] + source_texts(300) + fuzz_texts(600)
    conversations = [[{"role": "user", "content": texts[i]}, {"role": "assistant", "content": texts[i + 1]},
                      {"role": "user", "content": rng.choice(texts)}, {"role": "assistant", "content": texts[i + 2]}]
                     for i in range(0, len(texts) - 3, 3)]
    special = template.special_table(qwen3)
    rendered, spans = zip(*(template.render_with_spans(qwen3, m) for m in conversations))
    fast = template.masked_by_words(TiktokenEncoder.of(qwen3).encode_batch(rendered), rendered, spans, special)
    taken = 0
    for text, sp, got in zip(rendered, spans, fast):
        if got is not None:
            [(ids, mask)] = template.encode_with_offsets(qwen3, [text], [sp], special)
            taken += 1
            assert got[0].tolist() == ids.tolist() and got[1].tolist() == mask.tolist(), repr(text)
    assert taken == sum(unicodedata.is_normalized("NFC", t) for t in rendered)  # all but non-NFC text


def test_tiktoken_is_not_taken_for_a_bpe_trained_by_merges():
    """A BPE trained here merges only its own pairs; tiktoken would merge any join that is a
    token, so it is not taken (the word cache is)."""
    tok = byte_level_bpe(QWEN_PATTERN, nfc=True)
    assert TiktokenEncoder.of(tok) is None and WordCache.of(tok) is not None
