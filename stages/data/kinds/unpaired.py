"""unpaired: single answers marked good or bad, {"prompt": [messages], "completion": [messages],
"desirable": bool}, from TRL's unpaired preference rows ({"prompt", "completion", "label"}: prompt
and completion each a string or messages, label true for a desirable answer); the conversation
tokenized whole with the model's chat template, loss on the completion only (one assistant turn),
one row each (ragged) with its label beside it. Trains kto. Held out: the mean log-probability of
the desirable completions minus that of the undesirable ones (label_margin), and each of the two.

A label must be a boolean: JSON's true/false, or the text "true"/"false" (any case) that a CSV cell
holds; anything else (1, "yes", null) is a bad row, invalid_label. An empty completion is dropped
as empty_answer, as an empty answer of any kind is. An exact duplicate is of prompt, completion and
label together: the same answer marked both ways by two raters is not one (near dedupe compares
the words, the label's among them, and may still take a short pair of them for one)."""
from __future__ import annotations

import numpy as np

from stages.data.kinds.preference import answer_text
from stages.data.render import render
from stages.data.rows import ANSWER_KEYS, PROMPT_KEYS, BadRow, Refused, messages, turns

SIDES = ("ids",)
PACKED = False
LEARNS = True
BESIDE = {"desirable": "desirable.jsonl"}
RETOKENIZED = True
METRICS = ("label_margin", "desirable_logprob", "undesirable_logprob")


def label(value) -> bool:
    if isinstance(value, bool):
        return value
    if isinstance(value, str) and value.strip().lower() in ("true", "false"):
        return value.strip().lower() == "true"
    raise BadRow("invalid_label", f'"label" must be true or false (desirable or not), not {repr(value)[:60]}')


def convert(row: dict, fmt: str) -> dict:
    if fmt != "prompt":
        raise BadRow("wrong_format", f"a {fmt} row cannot feed unpaired training (needs prompt, completion, label)"
                     + ("; split each pair into a desirable and an undesirable row" if fmt == "preference" else ""))
    if "label" not in row:
        raise BadRow("invalid_label", 'an unpaired row needs "label": true or false')
    prompt, completion = (next((row[k] for k in keys if k in row), None) for keys in (PROMPT_KEYS, ANSWER_KEYS))
    if prompt is None or completion is None:
        raise BadRow("missing_field", 'an unpaired row needs "prompt", "completion" and "label"')
    prompt = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else messages(prompt)
    completion = [{"role": "assistant", "content": completion}] if isinstance(completion, str) else messages(completion)
    if prompt[-1]["role"] != "user":
        raise BadRow("invalid_row", "an unpaired row needs a prompt ending in a user turn")
    if len(completion) != 1 or completion[0]["role"] != "assistant":
        raise BadRow("invalid_row", "the completion must be one assistant turn")
    return {"prompt": prompt, "completion": completion, "desirable": label(row["label"])}


def lines(record: dict) -> list[tuple[str, str, bool]]:
    head = "desirable:" if record["desirable"] else "undesirable:"
    return turns(record["prompt"], False) + turns(record["completion"], True, head)


def last_span(mask: np.ndarray) -> np.ndarray:
    """The mask with only its last run of ones kept: the completion's tokens (an assistant turn
    of the prompt is context here, not learned)."""
    on = np.flatnonzero(mask)
    out = np.zeros_like(mask)
    if len(on):
        gaps = np.flatnonzero(np.diff(on) > 1)
        out[on[gaps[-1] + 1] if len(gaps) else on[0]: on[-1] + 1] = 1
    return out


def tokenize(enc, records: list[dict]) -> list[dict | Refused]:
    return [done if isinstance(done, Refused) else {"ids": done[0], "mask": last_span(done[1])}
            for done in enc.chats([r["prompt"] + r["completion"] for r in records])]


def heldout_docs(rows: list[dict], tok, context: int) -> list[dict]:
    """A row longer than the model's context is left out, as a preference pair is."""
    docs = [{"prompt": render(tok, r["prompt"], generation_prompt=True),
             "completion": answer_text(tok, r["prompt"], r["completion"]), "desirable": r["desirable"]} for r in rows]
    return [d for d in docs if len(tok.encode(d["prompt"] + d["completion"], add_special_tokens=False)) <= context]


def logprob(doc, results):
    loglikelihood, _ = results[0]
    return {m: (loglikelihood, doc["desirable"]) for m in METRICS}


def mean_of(items, desirable: bool) -> float:
    found = [ll for ll, d in items if d == desirable]
    return sum(found) / len(found) if found else float("nan")


AGGREGATE = {"label_margin": lambda items: mean_of(items, True) - mean_of(items, False),
             "desirable_logprob": lambda items: mean_of(items, True),
             "undesirable_logprob": lambda items: mean_of(items, False)}


def tasks(docs: list[dict], eos: str, max_new_tokens: int, reward: str) -> list[dict]:
    return [dict(task="heldout_unpaired", output_type="loglikelihood", doc_to_text="prompt",
                 doc_to_target="completion", process_results=logprob,
                 metric_list=[{"metric": m, "aggregation": AGGREGATE[m], "higher_is_better": m != "undesirable_logprob"}
                              for m in METRICS])]


def scores(results: dict) -> dict:
    return {m: float(results["heldout_unpaired"][f"{m},none"]) for m in METRICS}
