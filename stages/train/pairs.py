"""Preference pairs and prompts as the shards stage wrote them (stages/data/ragged.py: flat
ids, offsets, labels, the references beside), turned back into what TRL's preference and GRPO
trainers take: the prompt, and each answer from where its loss starts to its last learned token.
Decoding the ids gives back the text the model's chat template rendered (the ids were made by
tokenizing that text), so TRL tokenizes the same tokens again; cleaning, dedupe, the held-out
split and max_length stay the shards'."""
from __future__ import annotations

from pathlib import Path

import numpy as np

from stages.data import ragged
from stages.data.packed import IGNORE


def split(ids: np.ndarray, labels: np.ndarray, rejected: np.ndarray, rejected_labels: np.ndarray):
    """(prompt length, chosen end, rejected end): the answers start at the learned span in
    which the two sides part (a multi-turn prompt's earlier assistant turns are learned spans
    too, shared by both) and end at each side's last learned token."""
    n = min(len(ids), len(rejected))
    differ = np.flatnonzero(ids[:n] != rejected[:n])
    part = int(differ[0]) if len(differ) else n
    learned = labels[: min(part + 1, len(labels))] != IGNORE
    starts = np.flatnonzero(learned & ~np.concatenate([[False], learned[:-1]]))
    prompt = int(starts[-1]) if len(starts) else part
    end = lambda lab: int(np.flatnonzero(lab != IGNORE)[-1]) + 1 if (lab != IGNORE).any() else len(lab)
    return prompt, end(labels), end(rejected_labels)


def preference_ids(shards: Path) -> list[dict]:
    """Each training pair as token ids: prompt_ids, chosen_ids, rejected_ids (answers only)."""
    pairs = []
    for path in ragged.shard_files(shards):
        t = ragged.read(path)
        for i in range(len(t["ids_offsets"]) - 1):
            a, b = t["ids_offsets"][i], t["ids_offsets"][i + 1]
            c, d = t["rejected_ids_offsets"][i], t["rejected_ids_offsets"][i + 1]
            ids, rej = t["ids"][a:b], t["rejected_ids"][c:d]
            p, ce, re_ = split(ids, t["ids_labels"][a:b], rej, t["rejected_ids_labels"][c:d])
            pairs.append({"prompt_ids": ids[:p].tolist(), "chosen_ids": ids[p:ce].tolist(),
                          "rejected_ids": rej[p:re_].tolist()})
    return pairs


def preference_texts(shards: Path, tok):
    """The training pairs as TRL's (non-conversational) preference dataset: prompt, chosen, rejected."""
    from datasets import Dataset

    decode = lambda ids: tok.decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)
    return Dataset.from_list([{"prompt": decode(p["prompt_ids"]), "chosen": decode(p["chosen_ids"]),
                               "rejected": decode(p["rejected_ids"])} for p in preference_ids(shards)])


def prompt_texts(shards: Path, tok):
    """The training prompts (rendered with the generation prompt) and their reference answers,
    as TRL's GRPO dataset: the reference reaches the reward function as a keyword argument."""
    from datasets import Dataset

    rows = []
    for path in ragged.shard_files(shards):
        t = ragged.read(path)
        for i, ref in enumerate(ragged.beside(path, "references.jsonl")):
            ids = t["ids"][t["ids_offsets"][i]: t["ids_offsets"][i + 1]]
            rows.append({"prompt": tok.decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False),
                         "reference": ref})
    return Dataset.from_list(rows)
