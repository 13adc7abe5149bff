"""prompt: prompts with a reference answer, {"prompt": [messages], "reference": str}, from chat,
alpaca and prompt rows (the last assistant turn is the reference); the prompt rendered with the
generation prompt and tokenized, nothing learned (the answer is sampled in training), one row
each (ragged) with its reference beside it. Trains grpo and gspo. Held out: the mean reward
(train.reward, stages/train/verifiers.py) of the greedy answer, and its exact match."""
from __future__ import annotations

import numpy as np

from stages.data.render import render
from stages.data.rows import BadRow, Refused, as_chat, turns
from stages.train.verifiers import reward_function

SIDES = ("ids",)
PACKED = False
LEARNS = False
BESIDE = {"reference": "references.jsonl"}
RETOKENIZED = True


def convert(row: dict, fmt: str) -> dict:
    chat = as_chat(row, fmt)
    last = max((i for i, m in enumerate(chat) if m["role"] == "assistant"), default=None)
    if last is None or last == 0:
        raise BadRow("invalid_row", "a prompt row needs a prompt and a reference answer")
    return {"prompt": chat[:last], "reference": chat[last]["content"]}


def lines(record: dict) -> list[tuple[str, str, bool]]:
    return turns(record["prompt"], False) + [("reference:", record["reference"], True)]


def tokenize(enc, records: list[dict]) -> list[dict | Refused]:
    prompts = [enc.render(r["prompt"], generation_prompt=True) for r in records]
    encoded = iter(enc.texts([p for p in prompts if isinstance(p, str)]))
    return [p if isinstance(p, Refused) else {"ids": (ids := next(encoded)), "mask": np.zeros(len(ids), dtype=np.uint8)}
            for p in prompts]


def heldout_docs(rows: list[dict], tok, context: int) -> list[dict]:
    return [{"prompt": render(tok, r["prompt"], generation_prompt=True), "answer": r["reference"]} for r in rows]


def tasks(docs: list[dict], eos: str, max_new_tokens: int, reward: str) -> list[dict]:
    score = reward_function(reward)

    def rewarded(doc, results):
        answer = results[0].strip()
        return {"reward": score(answer, doc["answer"]), "exact_match": float(answer == doc["answer"].strip())}

    return [dict(task="heldout_reward", output_type="generate_until", doc_to_text="prompt",
                 doc_to_target="answer", process_results=rewarded,
                 generation_kwargs={"until": [eos], "max_gen_toks": max_new_tokens, "do_sample": False},
                 metric_list=[{"metric": m, "aggregation": "mean", "higher_is_better": True}
                              for m in ("reward", "exact_match")])]


def scores(results: dict) -> dict:
    return {m: float(results["heldout_reward"][f"{m},none"]) for m in ("reward", "exact_match")}
