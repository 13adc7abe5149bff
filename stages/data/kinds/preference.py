"""preference: pairs, {"prompt": [messages], "chosen": [messages], "rejected": [messages]}, from
preference rows (each side a string, an HH-RLHF transcript or messages; without a prompt, the
turns both sides share); each side tokenized whole with the model's chat template, loss on its
answer, the pair kept whole (ragged). Trains dpo, orpo and reward. Held out: the chosen answer's
log-probability minus the rejected one's (margin), and how often it is higher."""
from __future__ import annotations

import re

from stages.data.render import render
from stages.data.rows import BadRow, Refused, messages, turns

SIDES = ("ids", "rejected_ids")
PACKED = False
LEARNS = True
BESIDE: dict[str, str] = {}
RETOKENIZED = True
TRANSCRIPT_TURN = re.compile(r"\n\n(Human|Assistant): ")


def transcript(text: str) -> list[dict]:
    """'\\n\\nHuman: ...\\n\\nAssistant: ...' (the HH-RLHF layout) as messages."""
    parts = TRANSCRIPT_TURN.split(text)
    if len(parts) < 3 or parts[0].strip():
        raise BadRow("invalid_row", "a transcript string starts with '\\n\\nHuman: '")
    return [{"role": "user" if who == "Human" else "assistant", "content": said}
            for who, said in zip(parts[1::2], parts[2::2])]


def side(value) -> list[dict]:
    """One side of a preference pair: a string, a transcript, or a list of messages."""
    if isinstance(value, str):
        return transcript(value) if value.startswith("\n\nHuman: ") else [{"role": "assistant", "content": value}]
    return messages(value)


def convert(row: dict, fmt: str) -> dict:
    if fmt != "preference":
        raise BadRow("wrong_format", f"a {fmt} row cannot feed preference training")
    chosen, rejected = side(row.get("chosen")), side(row.get("rejected"))
    if "prompt" in row:
        prompt = side(row["prompt"]) if not isinstance(row["prompt"], str) else \
            [{"role": "user", "content": row["prompt"]}]
    else:  # implicit prompt: the turns both sides share
        n = 0
        while n < min(len(chosen), len(rejected)) - 1 and chosen[n] == rejected[n]:
            n += 1
        prompt, chosen, rejected = chosen[:n], chosen[n:], rejected[n:]
    if not prompt or prompt[-1]["role"] != "user":
        raise BadRow("invalid_row", "a preference pair needs a prompt ending in a user turn")
    for name, answer in (("chosen", chosen), ("rejected", rejected)):
        if not answer or any(m["role"] != "assistant" for m in answer):
            raise BadRow("invalid_row", f"{name} must be assistant turns after the prompt")
    return {"prompt": prompt, "chosen": chosen, "rejected": rejected}


def lines(record: dict) -> list[tuple[str, str, bool]]:
    return (turns(record["prompt"], False) + turns(record["chosen"], True, "chosen:")
            + turns(record["rejected"], True, "rejected:"))


def tokenize(enc, records: list[dict]) -> list[dict | Refused]:
    chosen = enc.chats([r["prompt"] + r["chosen"] for r in records])
    rejected = enc.chats([r["prompt"] + r["rejected"] for r in records])
    return [c if isinstance(c, Refused) else r if isinstance(r, Refused) else
            {"ids": c[0], "mask": c[1], "rejected_ids": r[0], "rejected_mask": r[1]} for c, r in zip(chosen, rejected)]


def answer_text(tok, prompt: list[dict], answer: list[dict]) -> str:
    """What the template renders after the generation prompt for `answer`, to its end of turn:
    the tokens preference training learns."""
    head = render(tok, prompt, generation_prompt=True)
    full = render(tok, prompt + answer)
    return full[len(head):].rstrip() if full.startswith(head) else answer[-1]["content"] + tok.eos_token


def heldout_docs(rows: list[dict], tok, context: int) -> list[dict]:
    """A pair longer than the model's context (held-out rows are not length-filtered as training
    rows are) cannot be scored and is left out."""
    docs = [{"prompt": render(tok, r["prompt"], generation_prompt=True),
             "choices": [answer_text(tok, r["prompt"], r["chosen"]), answer_text(tok, r["prompt"], r["rejected"])]}
            for r in rows]
    return [d for d in docs if max(len(tok.encode(d["prompt"] + c, add_special_tokens=False))
                                   for c in d["choices"]) <= context]


def margin(doc, results):
    (chosen, _), (rejected, _) = results
    return {"margin": chosen - rejected, "preference_accuracy": float(chosen > rejected)}


def tasks(docs: list[dict], eos: str, max_new_tokens: int, reward: str) -> list[dict]:
    return [dict(task="heldout_preference", output_type="multiple_choice",
                 doc_to_text="prompt", doc_to_choice="choices", doc_to_target=0, process_results=margin,
                 metric_list=[{"metric": m, "aggregation": "mean", "higher_is_better": True}
                              for m in ("margin", "preference_accuracy")])]


def scores(results: dict) -> dict:
    return {m: float(results["heldout_preference"][f"{m},none"]) for m in ("margin", "preference_accuracy")}
