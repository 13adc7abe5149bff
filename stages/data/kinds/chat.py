"""chat: conversations, {"messages": [{"role", "content", "reasoning"?}, ...]}, from chat, alpaca
and prompt rows; loss on the assistant turns as the model's own chat template renders them
(stages/data/template.py), documents packed. Trains sft. Held out: exact match of the greedy
answer to the last assistant turn, and the perplexity per token of that answer and its end of
turn given the conversation before it: the tokens training puts loss on."""
from __future__ import annotations

from stages.data.render import render
from stages.data.rows import BadRow, Refused, as_chat, turns

SIDES = ("ids",)
PACKED = True
LEARNS = True
BESIDE: dict[str, str] = {}
RETOKENIZED = False


def convert(row: dict, fmt: str) -> dict:
    chat = as_chat(row, fmt)
    if not any(m["role"] == "assistant" for m in chat):
        raise BadRow("no_assistant_turn", "no assistant turn to learn from")
    return {"messages": chat}


def lines(record: dict) -> list[tuple[str, str, bool]]:
    return turns(record["messages"])


def tokenize(enc, records: list[dict]) -> list[dict | Refused]:
    return [done if isinstance(done, Refused) else {"ids": done[0], "mask": done[1]}
            for done in enc.chats([r["messages"] for r in records])]


def heldout_docs(rows: list[dict], tok, context: int) -> list[dict]:
    """One doc per held-out row: the chat-rendered prompt up to the last assistant turn, and its answer."""
    docs = []
    for row in rows:
        messages = row["messages"]
        last = max(i for i, m in enumerate(messages) if m["role"] == "assistant")
        prompt = render(tok, messages[:last], generation_prompt=True)
        answer = messages[last]["content"]
        # lm-eval moves the prompt's trailing whitespace into the continuation before
        # scoring it; count the scored tokens the same way so perplexity is per token.
        context_text = prompt.rstrip()
        scored = prompt[len(context_text):] + answer + tok.eos_token
        n_tokens = len(tok.encode(context_text + scored, add_special_tokens=False)) - len(
            tok.encode(context_text, add_special_tokens=False))
        docs.append({"prompt": prompt, "answer": answer, "continuation": answer + tok.eos_token,
                     "n_tokens": n_tokens})
    return docs


def answer_loglikelihood(doc, results):
    loglikelihood, _ = results[0]
    return {"perplexity": (loglikelihood, doc["n_tokens"])}


def tasks(docs: list[dict], eos: str, max_new_tokens: int, reward: str) -> list[dict]:
    exact = dict(
        task="heldout_exact_match", output_type="generate_until",
        doc_to_text="prompt", doc_to_target="answer",
        generation_kwargs={"until": [eos], "max_gen_toks": max_new_tokens, "do_sample": False},
        filter_list=[{"name": "strip", "filter": [{"function": "remove_whitespace"},
                                                  {"function": "take_first"}]}],
        metric_list=[{"metric": "exact_match", "aggregation": "mean", "higher_is_better": True}],
    )
    perplexity = dict(
        task="heldout_perplexity", output_type="loglikelihood",
        doc_to_text="prompt", doc_to_target="continuation", process_results=answer_loglikelihood,
        metric_list=[{"metric": "perplexity", "aggregation": "weighted_perplexity", "higher_is_better": False}],
    )
    return [exact, perplexity]


def scores(results: dict) -> dict:
    exact, ppl = results["heldout_exact_match"], results["heldout_perplexity"]
    return {"exact_match": float(exact["exact_match,strip"]),
            "perplexity": float(ppl["perplexity,none"])}
