"""Cleaning on real rows: near copies (a few words changed) are found, and nothing else is."""
from __future__ import annotations

import json
import random
from pathlib import Path

import numpy as np
import pytest

from stages import cleaning, rows
from stages.recipe import DedupeSection, FiltersSection

SHARED = Path(__file__).resolve().parents[2] / "shared" / "datasets"
GSM8K = SHARED / "gsm8k" / "train.jsonl"


def records_of(lines):
    return [rows.convert(json.loads(line), "auto", "chat") for line in lines]


def near_copy(record: dict, rng: random.Random, changes: int = 3) -> dict:
    """The same problem with `changes` words of the answer replaced."""
    words = record["messages"][1]["content"].split(" ")
    for i in rng.sample(range(len(words)), changes):
        words[i] = rng.choice(["apples", "seven", "quickly", "blue", "twelve"])
    return {"messages": [record["messages"][0], {"role": "assistant", "content": " ".join(words)}]}


def clean(records, **dedupe):
    settings = DedupeSection(**dedupe)
    facts = [cleaning.describe(r, settings) for r in records]
    signatures = [np.stack([f["signature"] for f in facts])] if settings.near_threshold else []
    cleaner = cleaning.Cleaner(settings, FiltersSection(max_repetition=None), signatures)
    return [cleaner.drop_reason(f["fingerprint"], f["repetition"], lambda r=r: r) for f, r in zip(facts, records)]


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
    cleaner = cleaning.Cleaner(settings, FiltersSection(max_repetition=0.5))
    for record, reason in ((loop, "repetitive"), (varied, None)):
        facts = cleaning.describe(record, settings)
        assert cleaner.drop_reason(facts["fingerprint"], facts["repetition"], lambda: record) == reason


def test_a_chat_rows_facts_are_those_of_its_own_texts():
    """describe hashes a chat row's words once and takes its answers' n-grams from the normalized
    text: the same repetition and signature as computing each from its own text, on real rows
    and on rows with Unicode whitespace, blank answers and answers without words."""
    rng = random.Random(0)
    pieces = [" word", " Word", " cat", " ", "\u3000", "\xa0", "\n", "é", "!!", "12", "_", "\t", "ſ"]
    records = records_of(GSM8K.read_text().splitlines()[:300]) if GSM8K.is_file() else []
    for _ in range(300):
        messages = [{"role": role, "content": "".join(rng.choices(pieces, k=rng.randint(0, 80)))}
                    for role in rng.choice([["user", "assistant"], ["system", "user", "assistant", "user", "assistant"]])]
        records.append({"messages": messages})
    settings = DedupeSection(near_threshold=0.8)
    for record in records:
        facts = cleaning.describe(record, settings)
        norm = cleaning.normalized(record)
        assert facts["norm"] == norm
        assert facts["repetition"] == cleaning.repetition_ratio(rows.answers(record)), record
        assert np.array_equal(facts["signature"], cleaning.signature(cleaning.shingle_hashes(norm, settings.ngram),
                                                                     settings.num_perm))


def test_signature_is_datasketchs_minhash():
    """The array-at-once signature is datasketch's own MinHash of the same n-gram hashes, on real
    rows (GSM8K where present) and on rows of one, two and many words."""
    from datasketch import MinHash

    texts = [cleaning.normalized(r) for r in records_of(GSM8K.read_text().splitlines()[:200])] if GSM8K.is_file() else []
    texts += ["", "one", "two words", " ".join(f"w{i}" for i in range(5000))]
    for text in texts:
        grams = cleaning.shingle_hashes(text, 3)
        for num_perm in (16, 128):
            theirs = MinHash(num_perm=num_perm, seed=1, scheme=cleaning.SCHEME, hashfunc=int)
            theirs.update_batch(grams.tolist())
            assert np.array_equal(cleaning.signature(grams, num_perm), theirs.hashvalues), text[:80]
