"""Cleaning on real rows: near copies (a few words changed) are found, and nothing else is."""
from __future__ import annotations

import json
import random
from pathlib import Path

import numpy as np
import pytest

from stages.data import cleaning, rows
from stages.data.kinds import chat, preference, prompt, text
from stages.engine.recipe import DedupeSection, FiltersSection

SHARED = Path(__file__).resolve().parents[2] / "shared" / "datasets"
GSM8K = SHARED / "gsm8k" / "train.jsonl"


def records_of(lines):
    return [rows.convert(json.loads(line), "auto", chat) for line in lines]


KIND_OF = {"messages": chat, "text": text, "reference": prompt, "chosen": preference}  # by a key only its records have


def lines_of(record: dict) -> list[tuple[str, str, bool]]:
    """The lines cleaning reads of a record of any kind, as its kind gives them."""
    return next(kind for key, kind in KIND_OF.items() if key in record).lines(record)


def near_copy(record: dict, rng: random.Random, changes: int = 3) -> dict:
    """The same problem with `changes` words of the answer replaced."""
    words = record["messages"][1]["content"].split(" ")
    for i in rng.sample(range(len(words)), changes):
        words[i] = rng.choice(["apples", "seven", "quickly", "blue", "twelve"])
    return {"messages": [record["messages"][0], {"role": "assistant", "content": " ".join(words)}]}


def clean(records, **dedupe):
    settings = DedupeSection(**dedupe)
    facts = cleaning.describe([lines_of(r) for r in records], settings)
    codes, of = cleaning.drop_reasons(facts["fingerprint"], facts["repetition"], settings,
                                      FiltersSection(max_repetition=None), lambda: [facts["signature"]],
                                      lambda rows: (lines_of(records[i]) for i in rows))
    for i in np.flatnonzero(codes == 1):  # an exact duplicate names the first row with its text
        assert 0 <= of[i] < i and (facts["fingerprint"][of[i]] == facts["fingerprint"][i]).all()
    for i in np.flatnonzero(codes == 2):  # a near duplicate names an earlier row that was kept
        assert 0 <= of[i] < i and codes[of[i]] == 0
    assert (of[codes == 0] == -1).all()
    return [((None,) + cleaning.REASONS)[c] for c in codes]


@pytest.mark.skipif(not GSM8K.is_file(), reason="../shared/datasets is not on this machine")
def test_near_duplicates_of_real_rows_are_found_and_nothing_else():
    originals = records_of(GSM8K.read_text().splitlines()[:1000])
    rng = random.Random(7)
    picked = rng.sample(range(len(originals)), 40)
    copies = [near_copy(originals[i], rng) for i in picked]
    exact = [originals[i] for i in picked[:5]]
    stream = originals + copies + exact
    order = list(range(len(stream)))
    rng.shuffle(order)  # copies may come before their original: the first seen is kept
    reasons = clean([stream[i] for i in order])  # the default threshold
    dropped = {order[k] for k, r in enumerate(reasons) if r}
    groups = {i: {i, len(originals) + j} for j, i in enumerate(picked)}
    for j, i in enumerate(picked[:5]):
        groups[i].add(len(originals) + len(copies) + j)
    for group in groups.values():  # one row of each group is kept...
        assert len(group - dropped) == 1, group
    assert len(dropped) == sum(len(g) - 1 for g in groups.values())  # ...and no distinct row is dropped
    assert {r for r in reasons if r} == {"near_duplicate", "exact_duplicate"}


@pytest.mark.skipif(not GSM8K.is_file(), reason="../shared/datasets is not on this machine")
def test_near_dedupe_off_keeps_near_copies():
    originals = records_of(GSM8K.read_text().splitlines()[:50])
    copies = [near_copy(r, random.Random(1)) for r in originals[:10]]
    assert not any(clean(originals + copies, near_threshold=None))


def test_repetition_filter():
    loop = {"messages": [{"role": "user", "content": "q"},
                         {"role": "assistant", "content": "I am sure. " * 40}]}
    varied = {"messages": [{"role": "user", "content": "q"},
                           {"role": "assistant", "content": " ".join(f"word{i}" for i in range(120))}]}
    settings = DedupeSection(near_threshold=None)
    facts = cleaning.describe([lines_of(loop), lines_of(varied)], settings)
    codes, of = cleaning.drop_reasons(facts["fingerprint"], facts["repetition"], settings,
                                      FiltersSection(max_repetition=0.5), None, None)
    assert codes.tolist() == [1 + cleaning.REASONS.index("repetitive"), 0] and of.tolist() == [-1, -1]


def shingles(text: str, n: int) -> np.ndarray:
    """The word n-gram hashes of one text, by their definition: each gram combines n words'
    hashes in turn; fewer than n words make one gram of them all, no words one of an empty word."""
    h = cleaning.words_of_bytes(np.frombuffer(text.encode(), dtype=np.uint8))[0]
    if not len(h):
        h = np.zeros(1, dtype=np.uint64)
    count = max(len(h) - n + 1, 1)
    grams = h[:count].copy()
    for k in range(1, min(n, len(h))):
        grams = (grams * np.uint64(0x9E3779B1) + h[k: k + count]) & np.uint64(0xFFFFFFFF)
    return grams


def repetition_of(texts: list[str], n: int = 3) -> float:
    """The repetition ratio, by its definition, from a row's own answers: the share of word n-grams
    (each non-blank answer on its own) equal to another of the row's."""
    grams = [shingles(cleaning.fold(t), n) for t in texts if t.strip()]
    grams = np.sort(np.concatenate(grams)) if grams else np.zeros(0)
    return 0.0 if len(grams) < 2 else float(np.count_nonzero(grams[1:] == grams[:-1]) / len(grams))


def minhash(text: str, settings) -> np.ndarray:
    """datasketch's own MinHash of a normalized text's word n-grams."""
    from datasketch import MinHash

    theirs = MinHash(num_perm=settings.num_perm, seed=1, scheme=cleaning.SCHEME, hashfunc=int)
    theirs.update_batch(shingles(text, settings.ngram).tolist())
    return theirs.hashvalues


def test_described_rows_are_their_own_texts_hashed():
    """describe hashes many rows at once and takes each row's answers' n-grams from its normalized
    text (and NearDuplicates.gram_sets, the sets near dedupe compares, many rows' at once): the
    fingerprint, repetition ratio, signature and n-gram set of every row are those computed from the
    row's own texts, on real rows and on rows with Unicode whitespace, blank answers, answers
    without words, and every record kind, across batch boundaries."""
    import blake3

    rng = random.Random(0)
    pieces = [" word", " Word", " cat", " ", "\u3000", "\xa0", "\n", "é", "!!", "12", "_", "\t", "ſ"]
    records = records_of(GSM8K.read_text().splitlines()[:300]) if GSM8K.is_file() else []

    def some_text():
        return "".join(rng.choices(pieces, k=rng.randint(0, 80)))

    for _ in range(300):
        messages = [{"role": role, "content": some_text()}
                    for role in rng.choice([["user", "assistant"], ["system", "user", "assistant", "user", "assistant"]])]
        head = messages[:-2] or messages[:1]  # with an assistant turn where there is one: not an answer
        records.append(rng.choice([{"messages": messages}, {"text": some_text()}, {"prompt": head, "reference": some_text()},
                                   {"prompt": head, "chosen": messages[-1:], "rejected": messages[-1:]}]))
    for settings in (DedupeSection(near_threshold=0.8), DedupeSection(ngram=3, num_perm=16)):
        facts = cleaning.describe([lines_of(r) for r in records], settings)
        near = cleaning.NearDuplicates(settings.near_threshold or 0.5, settings.num_perm, settings.ngram,
                                       lambda: [facts["signature"]], np.ones(len(records), dtype=bool))
        gram_sets = near.gram_sets([lines_of(r) for r in records])
        for i, record in enumerate(records):
            norm = cleaning.normalized(lines_of(record))
            assert facts["fingerprint"][i].tobytes() == blake3.blake3(norm.encode()).digest(length=16)
            answers = [t for _, t, answer in lines_of(record) if answer]
            assert facts["repetition"][i] == np.float32(repetition_of(answers)), record
            assert np.array_equal(facts["signature"][i], minhash(norm, settings)), record
            assert np.array_equal(gram_sets[i], np.unique(shingles(norm, settings.ngram))), record


def test_signatures_are_datasketchs_minhash():
    """Many rows' signatures at once are datasketch's own MinHash of each row's n-grams, for rows
    of one, two and many words, and across the batches signatures() splits the work into."""
    texts = [cleaning.normalized(lines_of(r)) for r in records_of(GSM8K.read_text().splitlines()[:200])] if GSM8K.is_file() else []
    texts += ["", "one", "two words", " ".join(f"w{i}" for i in range(80000))]
    settings = DedupeSection(ngram=3)
    grams = [shingles(t, 3) for t in texts]
    ours = cleaning.signatures(np.concatenate(grams), np.array([len(g) for g in grams]), settings.num_perm)
    for t, got in zip(texts, ours):
        assert np.array_equal(got, minhash(t, settings)), t[:80]


@pytest.mark.skipif(not GSM8K.is_file(), reason="../shared/datasets is not on this machine")
def test_near_dedupe_decides_as_datasketchs_lsh_with_exact_jaccard(monkeypatch):
    """NearDuplicates' batched decisions (its look-ahead over NEAR_BATCH rows, made small here so
    many batches meet) and its MinHash-estimate shortcut decide as the plain algorithm does: each
    row in order is queried in datasketch's own MinHashLSH of the kept rows, and is a near
    duplicate of the first candidate (in row order) whose exact n-gram Jaccard reaches the
    threshold. Rows: real GSM8K rows, near copies, and rows sharing half their text with another
    (candidates that must be compared and kept)."""
    from datasketch import MinHash, MinHashLSH

    monkeypatch.setattr(cleaning, "NEAR_BATCH", 7)
    originals = records_of(GSM8K.read_text().splitlines()[:400])
    rng = random.Random(3)
    copies = [near_copy(originals[i], rng, changes=rng.randint(1, 12)) for i in rng.sample(range(400), 80)]

    def halves(a, b):  # the second half of one answer and the first half of another
        x, y = a["messages"][1]["content"].split(" "), b["messages"][1]["content"].split(" ")
        return {"messages": [a["messages"][0], {"role": "assistant",
                                                "content": " ".join(x[len(x) // 2:] + y[: len(y) // 2])}]}

    mixed = [halves(originals[i], originals[i + 1]) for i in rng.sample(range(399), 80)]
    stream = originals + copies + mixed
    rng.shuffle(stream)
    settings = DedupeSection()
    facts = cleaning.describe([lines_of(r) for r in stream], settings)
    codes, of = cleaning.drop_reasons(facts["fingerprint"], facts["repetition"], settings,
                                      FiltersSection(max_repetition=None), lambda: [facts["signature"]],
                                      lambda rows: (lines_of(stream[i]) for i in rows))

    lsh = MinHashLSH(threshold=settings.near_threshold, num_perm=settings.num_perm, weights=(0.2, 0.8))
    grams = [np.unique(shingles(cleaning.normalized(lines_of(r)), settings.ngram)) for r in stream]
    want = np.zeros(len(stream), dtype=np.int64) - 1
    for i, signature in enumerate(facts["signature"]):
        sketch = MinHash(num_perm=settings.num_perm, seed=1, scheme=cleaning.SCHEME, hashvalues=signature)
        if codes[i] == 1:  # an exact duplicate: never a near-dedupe candidate
            continue
        for j in sorted(lsh.query(sketch)):
            if cleaning.jaccard(grams[j], grams[i]) >= settings.near_threshold:
                want[i] = j
                break
        else:
            lsh.insert(i, sketch)
    assert (want >= 0).sum() > 40  # the copies with a few words changed are found
    assert np.array_equal(np.where(codes == 2, of, -1), want)
