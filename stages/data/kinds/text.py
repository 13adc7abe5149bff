"""text: plain text, {"text": str}, from text rows; loss on every token (and the end-of-text
token appended to each document), documents packed. Trains cpt. Held out: the perplexity per
token of each text (lm-eval's rolling loglikelihood)."""
from __future__ import annotations

import numpy as np

from stages.data.rows import BadRow, text_field

SIDES = ("ids",)
PACKED = True
LEARNS = True
BESIDE: dict[str, str] = {}
RETOKENIZED = False


def convert(row: dict, fmt: str) -> dict:
    if fmt != "text":
        raise BadRow("wrong_format", f"a {fmt} row cannot feed continued pretraining (needs text)")
    return {"text": text_field(row, "text")}


def lines(record: dict) -> list[tuple[str, str, bool]]:
    return [("", record["text"], True)]


def tokenize(enc, records: list[dict]) -> list[dict]:
    return [{"ids": np.append(ids, enc.eos_token_id), "mask": np.ones(len(ids) + 1, dtype=np.uint8)}
            for ids in enc.documents([r["text"] for r in records])]


def heldout_docs(rows: list[dict], tok, context: int) -> list[dict]:
    return [{"text": r["text"] + tok.eos_token,
             "n_tokens": len(tok.encode(r["text"] + tok.eos_token, add_special_tokens=False))} for r in rows]


def text_loglikelihood(doc, results):
    return {"perplexity": (results[0], doc["n_tokens"])}


def tasks(docs: list[dict], eos: str, max_new_tokens: int, reward: str) -> list[dict]:
    return [dict(task="heldout_text_perplexity", output_type="loglikelihood_rolling",
                 doc_to_text="", doc_to_target="text", process_results=text_loglikelihood,
                 metric_list=[{"metric": "perplexity", "aggregation": "weighted_perplexity",
                               "higher_is_better": False}])]


def scores(results: dict) -> dict:
    return {"perplexity": float(results["heldout_text_perplexity"]["perplexity,none"])}
