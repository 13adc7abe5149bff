"""eval: score the base, trained and quantized models (one per scheme) with lm-eval on the
held-out split, and say what each one's weights take on disk.

Two local tasks built from shards/heldout/heldout.jsonl, no hub access: exact
match of the greedy answer to the reference (prompt rendered with the model's
chat template), and per-token perplexity of the reference answer and its
end-of-turn token given the prompt: the tokens training puts loss on. Scoring the base model too
makes eval.json show the gain; scoring each quantized model beside the trained one, with its size
(size_bytes: the weight files), shows what each scheme costs in accuracy for what it saves.
Held-out rows of the other methods' kinds get their own method's metrics
(stages/scoring/tasks.py: text perplexity, preference margin and accuracy, GRPO's reward),
and a reward model its accuracy on held-out pairs (stages/scoring/reward_model.py).
"""
from __future__ import annotations

import json
from pathlib import Path

from stages.data.render import render
from stages.model.trained import device, load_trained, placement, size_on_disk, trained_size_on_disk
from stages.scoring import reward_model, tasks
from stages.train.rewards import reward_function


def extra_inputs(recipe, root: Path, store) -> dict:
    return {"device": device()}


def heldout_docs(shards: Path, tok, limit: int | None) -> list[dict]:
    """One doc per held-out row: the chat-rendered prompt up to the last assistant turn, and its answer."""
    rows = [json.loads(line) for line in (shards / "heldout" / "heldout.jsonl").read_text().splitlines()]
    docs = []
    for row in rows[:limit]:
        messages = row["messages"]
        last = max(i for i, m in enumerate(messages) if m["role"] == "assistant")
        prompt = render(tok, messages[:last], generation_prompt=True)
        answer = messages[last]["content"]
        # lm-eval moves the prompt's trailing whitespace into the continuation before
        # scoring it; count the scored tokens the same way so perplexity is per token.
        context = prompt.rstrip()
        scored = prompt[len(context):] + answer + tok.eos_token
        n_tokens = len(tok.encode(context + scored, add_special_tokens=False)) - len(
            tok.encode(context, add_special_tokens=False))
        docs.append({"prompt": prompt, "answer": answer, "continuation": answer + tok.eos_token,
                     "n_tokens": n_tokens})
    return docs


def answer_loglikelihood(doc, results):
    loglikelihood, _ = results[0]
    return {"perplexity": (loglikelihood, doc["n_tokens"])}


def task_configs(docs: list[dict], eos: str, max_new_tokens: int) -> list[dict]:
    """The two lm-eval task configs over an in-memory dataset (no YAML, no hub)."""
    from datasets import Dataset

    data = Dataset.from_list(docs)

    def dataset(**_):  # lm-eval calls it with the task metadata as keyword arguments
        return {"test": data}

    common = {"custom_dataset": dataset, "test_split": "test", "num_fewshot": 0,
              "target_delimiter": "", "metadata": {"version": 1}}
    exact = dict(
        common, task="heldout_exact_match", output_type="generate_until",
        doc_to_text="prompt", doc_to_target="answer",
        generation_kwargs={"until": [eos], "max_gen_toks": max_new_tokens, "do_sample": False},
        filter_list=[{"name": "strip", "filter": [{"function": "remove_whitespace"},
                                                  {"function": "take_first"}]}],
        metric_list=[{"metric": "exact_match", "aggregation": "mean", "higher_is_better": True}],
    )
    perplexity = dict(
        common, task="heldout_perplexity", output_type="loglikelihood",
        doc_to_text="prompt", doc_to_target="continuation", process_results=answer_loglikelihood,
        metric_list=[{"metric": "perplexity", "aggregation": "weighted_perplexity", "higher_is_better": False}],
    )
    return [exact, perplexity]


def chat_metrics(res: dict) -> dict:
    exact, ppl = res["heldout_exact_match"], res["heldout_perplexity"]
    return {"exact_match": float(exact["exact_match,strip"]),
            "perplexity": float(ppl["perplexity,none"])}


def score(model, tok, configs, settings) -> dict:
    """lm-eval's results of the task configs for one model."""
    import lm_eval
    from lm_eval.models.huggingface import HFLM
    from lm_eval.tasks import TaskManager

    lm = HFLM(pretrained=model.eval(), tokenizer=tok, batch_size=settings.batch_size,
              max_length=model.config.max_position_embeddings)
    out = lm_eval.simple_evaluate(
        model=lm, tasks=configs,
        task_manager=TaskManager(include_defaults=False), num_fewshot=0, apply_chat_template=False,
        bootstrap_iters=0, log_samples=False, cache_requests=False,
        random_seed=0, numpy_random_seed=0, torch_random_seed=0, fewshot_random_seed=0)
    return out["results"]


def build(ctx, out: Path) -> None:
    import logging
    import os

    os.environ.setdefault("QUARK_DISABLE_COMPILE", "1")
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.manual_seed(0)
    logging.getLogger("lm_eval").setLevel(logging.ERROR)
    settings = ctx.recipe.eval
    tok = AutoTokenizer.from_pretrained(ctx.upstream["base"])
    rows = [json.loads(line) for line in (ctx.upstream["shards"] / "heldout" / "heldout.jsonl").read_text().splitlines()]
    kind = tasks.kind_of(rows[0]) if rows else "chat"
    base, checkpoint, quantized = ctx.upstream["base"], ctx.upstream["checkpoint"], ctx.upstream["quantized"]
    report = {"settings": settings.model_dump(mode="json")}
    if reward_model.is_reward_model(checkpoint):
        rows = rows[:settings.limit]
        report["heldout_rows"] = len(rows)
        for name, trained in (("base", None), ("trained", checkpoint)):
            report[name] = reward_model.score(reward_model.load(trained, base), tok, rows)
            ctx.log.info("%s: %s", name, report[name])
    else:
        if kind == "chat":
            docs = heldout_docs(ctx.upstream["shards"], tok, settings.limit)
            configs, metrics = task_configs(docs, tok.eos_token, settings.max_new_tokens), chat_metrics
        else:
            context = json.loads((base / "config.json").read_text())["max_position_embeddings"]
            docs = tasks.docs_for(kind, rows[:settings.limit], tok, context)
            if len(docs) < len(rows[:settings.limit]):
                report["heldout_longer_than_context"] = len(rows[:settings.limit]) - len(docs)
            reward = reward_function(ctx.recipe.train.reward) if kind == "prompt" else None
            configs = tasks.configs(kind, docs, tok.eos_token, settings.max_new_tokens, reward)
            metrics = lambda res: tasks.metrics(kind, res)  # noqa: E731
        report["heldout_rows"] = len(docs)
        models = [  # (where its result goes, its name there, how to load it, its weights' bytes)
            (report, "base", lambda: AutoModelForCausalLM.from_pretrained(base, **placement()), size_on_disk(base)),
            (report, "trained", lambda: load_trained(checkpoint, base), trained_size_on_disk(checkpoint, base)),
        ]
        for scheme in sorted(d.name for d in quantized.iterdir() if d.is_dir()):
            export = quantized / scheme
            models.append((report.setdefault("quantized", {}), scheme,
                           lambda d=export: AutoModelForCausalLM.from_pretrained(d, **placement()), size_on_disk(export)))
        for where, name, load, size in models:
            ctx.log.info("scoring %s on %d held-out rows", name, len(docs))
            where[name] = {**metrics(score(load(), tok, configs, settings)), "size_bytes": size}
            ctx.log.info("%s: %s", name, where[name])
        report["quantization_cost"] = {scheme: {m: q[m] - report["trained"][m] for m in q if m != "size_bytes"}
                                       for scheme, q in report.get("quantized", {}).items()}
    report["gain"] = {m: report["trained"][m] - report["base"][m] for m in report["base"] if m != "size_bytes"}
    (out / "eval.json").write_text(json.dumps(report, indent=1, sort_keys=True) + "\n")


def summary(path: Path) -> list[str]:
    """eval.json's scores and sizes, for `doit show`."""
    report = json.loads((path / "eval.json").read_text())
    models = [(m, report[m]) for m in ("base", "trained") if m in report]
    models += [(f"quantized {s}", q) for s, q in report.get("quantized", {}).items()]
    return [f"eval.json on {report['heldout_rows']} held-out rows: " + "; ".join(
        f"{m} " + ", ".join(f"{v:,} bytes" if k == "size_bytes" else
                           f"{k.replace('_', ' ')} {v:{'.2f' if k == 'perplexity' else '.3f'}}"
                           for k, v in sorted(r.items())) for m, r in models)]
