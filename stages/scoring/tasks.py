"""lm-eval tasks over the held-out rows of the kinds beyond chat, each measuring what its
training method exists for (the chat kind's tasks are in stages/evaluate.py):

    text        perplexity per token of each held-out text (rolling loglikelihood)      cpt
    preference  chosen-minus-rejected log-probability margin, preference accuracy        dpo, orpo
    prompt      mean reward of the greedy answer (train.reward), and its exact match     grpo
"""
from __future__ import annotations

from stages.data.render import render


def kind_of(row: dict) -> str:
    """A held-out row's kind, from its canonical record's keys (stages/data/rows.py)."""
    return ("chat" if "messages" in row else "text" if "text" in row else
            "preference" if "chosen" in row else "prompt")


def answer_text(tok, prompt: list[dict], answer: list[dict]) -> str:
    """What the template renders after the generation prompt for `answer`, to its end of turn:
    the tokens preference training learns."""
    head = render(tok, prompt, generation_prompt=True)
    full = render(tok, prompt + answer)
    return full[len(head):].rstrip() if full.startswith(head) else answer[-1]["content"] + tok.eos_token


def docs_for(kind: str, rows: list[dict], tok, context: int) -> list[dict]:
    """lm-eval docs of the held-out rows; a pair longer than the model's context (held-out rows
    are not length-filtered as training rows are) cannot be scored and is left out: the caller
    counts them as len(rows) - len(docs)."""
    if kind == "text":
        return [{"text": r["text"] + tok.eos_token,
                 "n_tokens": len(tok.encode(r["text"] + tok.eos_token, add_special_tokens=False))} for r in rows]
    if kind == "preference":
        docs = [{"prompt": render(tok, r["prompt"], generation_prompt=True),
                 "choices": [answer_text(tok, r["prompt"], r["chosen"]), answer_text(tok, r["prompt"], r["rejected"])]}
                for r in rows]
        return [d for d in docs if max(len(tok.encode(d["prompt"] + c, add_special_tokens=False))
                                       for c in d["choices"]) <= context]
    return [{"prompt": render(tok, r["prompt"], generation_prompt=True), "answer": r["reference"]} for r in rows]


def configs(kind: str, docs: list[dict], eos: str, max_new_tokens: int, reward) -> list[dict]:
    """The lm-eval task configs for `kind` over an in-memory dataset (no YAML, no hub)."""
    from datasets import Dataset

    data = Dataset.from_list(docs)
    common = {"custom_dataset": lambda **_: {"test": data}, "test_split": "test", "num_fewshot": 0,
              "target_delimiter": "", "metadata": {"version": 1}}
    if kind == "text":
        return [dict(common, task="heldout_text_perplexity", output_type="loglikelihood_rolling",
                     doc_to_text="", doc_to_target="text",
                     process_results=lambda doc, results: {"perplexity": (results[0], doc["n_tokens"])},
                     metric_list=[{"metric": "perplexity", "aggregation": "weighted_perplexity",
                                   "higher_is_better": False}])]
    if kind == "preference":
        def margin(doc, results):
            (chosen, _), (rejected, _) = results
            return {"margin": chosen - rejected, "preference_accuracy": float(chosen > rejected)}

        return [dict(common, task="heldout_preference", output_type="multiple_choice",
                     doc_to_text="prompt", doc_to_choice="choices", doc_to_target=0, process_results=margin,
                     metric_list=[{"metric": m, "aggregation": "mean", "higher_is_better": True}
                                  for m in ("margin", "preference_accuracy")])]

    def rewarded(doc, results):
        answer = results[0].strip()
        return {"reward": reward(answer, doc["answer"]), "exact_match": float(answer == doc["answer"].strip())}

    return [dict(common, task="heldout_reward", output_type="generate_until", doc_to_text="prompt",
                 doc_to_target="answer", process_results=rewarded,
                 generation_kwargs={"until": [eos], "max_gen_toks": max_new_tokens, "do_sample": False},
                 metric_list=[{"metric": m, "aggregation": "mean", "higher_is_better": True}
                              for m in ("reward", "exact_match")])]


def metrics(kind: str, results: dict) -> dict:
    """eval.json's numbers for one model, from lm-eval's results."""
    if kind == "text":
        return {"perplexity": float(results["heldout_text_perplexity"]["perplexity,none"])}
    names = ("margin", "preference_accuracy") if kind == "preference" else ("reward", "exact_match")
    task = "heldout_preference" if kind == "preference" else "heldout_reward"
    return {m: float(results[task][f"{m},none"]) for m in names}
