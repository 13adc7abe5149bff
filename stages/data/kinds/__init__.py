"""Data kinds: what a training method's rows are, one module each (chat, text, preference,
prompt), named by the method's row of stages/train/methods.py. The shards stage and the eval
stage load the recipe's kind by that name (and declare its module in their keys: code_modules);
the machinery around a kind (reading files, dedupe, packing, tokenizers) is generic and gets the
kind's module passed in.

A kind's module holds:

    SIDES       the token sequences of one row: ("ids",), a preference pair ("ids", "rejected_ids");
                each has its loss mask ("mask", "rejected_mask")
    PACKED      True: documents packed into data.max_length sequences (stages/data/packed.py);
                False: one row each, ragged (stages/data/ragged.py)
    LEARNS      False where a row has no loss tokens (a prompt: its answer is sampled); else a
                row without them is dropped (no_loss_tokens) and ragged shards store labels
    BESIDE      record fields a ragged shard keeps beside each row: field -> file suffix
    RETOKENIZED True where the trainer tokenizes the rendered rows again (TRL's preference, KTO
                and GRPO trainers take text): there a special token's text in a field would be
                read as that token, so such a row is refused (special_token_text); False where
                training reads the shards' ids, in which such text is text
    convert(row, fmt) -> record         the canonical record of a raw row of format `fmt`
                                        (stages/data/rows.py), or rows.BadRow
    lines(record) -> [(prefix, text, is an answer)]   the record as cleaning reads it: dedupe,
                                        repetition, empty answers, max_row_bytes
    tokenize(enc, records) -> [doc or rows.Refused]    each SIDE's ids and mask, from
                                        stages/data/sources.Encoder (no tokenizer code is
                                        imported here, so the eval stage's key holds none)
    heldout_docs(rows, tok, context) -> docs   held-out records as lm-eval docs (any over the
                                        model's context left out)
    tasks(docs, eos, max_new_tokens, reward) -> lm-eval task configs (stages/scoring/harness.py
                                        adds the dataset); `reward` is train.reward's name
    scores(results) -> {metric: value}  eval.json's figures from lm-eval's results

Adding a kind is one module here; a method's row names it. This file holds no code: a package's
__init__ is in no stage's key.
"""
