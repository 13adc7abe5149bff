"""eval: score the base, trained and quantized models (one per scheme) on the held-out split,
and say what each one's weights take on disk.

What is measured is the recipe's method's: its row of stages/train/methods.py names the data
kind, whose module (stages/data/kinds/) turns the held-out rows into lm-eval docs and tasks (run
by stages/scoring/harness.py, no hub access), and the metrics eval.json reports. Chat rows: exact
match of the greedy answer to the reference (prompt rendered with the model's chat template),
and per-token perplexity of the reference answer and its end-of-turn token given the prompt: the
tokens training puts loss on; text: perplexity; preference pairs: margin and preference accuracy;
prompts: GRPO's reward. Generative tasks run lm-eval's generate in batches as wide as the KV
cache allows (stages/scoring/wide_lm.py; docs/serving.md has the measurement against the
generation engine's continuous batch and lm-eval's batches of eval.batch_size). A method with a scoring head (reward) is scored on how it ranks held-out
pairs (stages/scoring/reward_ranking.py). Scoring the base model too makes eval.json show the
gain; scoring each quantized model beside the trained one, with its size (size_bytes: the weight
files), shows what each scheme costs in accuracy for what it saves.
"""
from __future__ import annotations

import importlib
import json
from pathlib import Path

from stages.data.render import control_pattern, quoted_control
from stages.engine import jsontext
from stages.model.numerics import as_planned
from stages.model.trained import (dequantized, device, load_trained, placement, size_on_disk,
                                  trained_size_on_disk)
from stages.scoring import harness, reward_ranking
from stages.train.methods import METHODS


def code_modules(recipe) -> list[str]:
    """The method's data kind's module (its held-out scoring): part of this stage's code."""
    return [METHODS[recipe.train.method].kind_module]


def extra_inputs(recipe, root: Path, store) -> dict:
    return {"device": device()}


def merges_into(base: Path, checkpoint: Path) -> bool:
    """Whether the trained model is the base as eval loads it with an adapter merged in: then the
    base model eval has just scored becomes the trained one (an 8B load of 2-3 s on an H100
    spared). Not where load_trained dequantizes the base (MXFP4) and eval scores it as saved."""
    return (checkpoint / "adapter").is_dir() and not dequantized(base)


def trained_model(scored_base, checkpoint: Path, base: Path):
    """The trained model: the adapter merged into `scored_base` (the same weights as
    load_trained's, tests/test_builds.py holds them equal), or loaded afresh where it is None."""
    if scored_base is None:
        return load_trained(checkpoint, base)
    from peft import PeftModel

    return PeftModel.from_pretrained(scored_base, checkpoint / "adapter").merge_and_unload()


def without_special_token_text(rows: list[dict], kind, tok) -> list[dict]:
    """The held-out rows none of whose fields quote a special token's text. lm-eval tokenizes the
    rendered text itself and would read such text as the token, so the row would be scored on
    other tokens than training learned from it (the shards encode it as text; the kinds whose
    trainer tokenizes again refuse such rows before they are held out)."""
    pattern = control_pattern(tok)
    return [r for r in rows if not quoted_control(kind.lines(r), pattern)]


def build(ctx, out: Path) -> None:
    import logging
    import os

    os.environ.setdefault("QUARK_DISABLE_COMPILE", "1")
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    as_planned(ctx.upstream["plan"])
    torch.manual_seed(0)
    logging.getLogger("lm_eval").setLevel(logging.ERROR)
    settings = ctx.recipe.eval
    method = METHODS[ctx.recipe.train.method]
    tok = AutoTokenizer.from_pretrained(ctx.upstream["base"])
    lines = (ctx.upstream["shards"] / "heldout" / "heldout.jsonl").read_text().splitlines()
    rows = [jsontext.loads(line) for line in lines][:settings.limit]
    base, checkpoint, quantized = ctx.upstream["base"], ctx.upstream["checkpoint"], ctx.upstream["quantized"]
    report = {"settings": settings.model_dump(mode="json")}
    if method.head == "score":
        report["heldout_rows"] = len(rows)
        for name, trained in (("base", None), ("trained", checkpoint)):
            scores = reward_ranking.score(reward_ranking.load(trained, base), tok, rows)
            report[name] = {m: scores[m] for m in method.metrics}
            ctx.log.debug("%s: %s", name, report[name])
    else:
        kind = importlib.import_module(method.kind_module)
        context = jsontext.read(base / "config.json")["max_position_embeddings"]
        scorable = without_special_token_text(rows, kind, tok)
        if len(scorable) < len(rows):
            report["heldout_special_token_text"] = len(rows) - len(scorable)
        docs = kind.heldout_docs(scorable, tok, context)
        if len(docs) < len(scorable):
            report["heldout_longer_than_context"] = len(scorable) - len(docs)
        configs = harness.task_configs(kind.tasks(docs, tok.eos_token, settings.max_new_tokens, ctx.recipe.train.reward),
                                       docs)
        report["heldout_rows"] = len(docs)
        models = [  # (where its result goes, its name there, how to load it, its weights' bytes)
            (report, "base", lambda _: AutoModelForCausalLM.from_pretrained(base, **placement()), size_on_disk(base)),
            (report, "trained", lambda scored: trained_model(scored, checkpoint, base),
             trained_size_on_disk(checkpoint, base)),
        ]
        for scheme in sorted(d.name for d in quantized.iterdir() if d.is_dir()):
            export = quantized / scheme
            models.append((report.setdefault("quantized", {}), scheme,
                           lambda _, d=export: AutoModelForCausalLM.from_pretrained(d, **placement()),
                           size_on_disk(export)))
        scored_base = None
        for where, name, load, size in ctx.progress(models, desc="scoring", unit=" models"):
            ctx.log.debug("scoring %s on %d held-out rows", name, len(docs))
            model, scored_base = load(scored_base), None
            ctx.log.debug("%s loaded", name)
            scores = kind.scores(harness.results(model, tok, configs, settings))
            if name == "base" and merges_into(base, checkpoint):
                scored_base = model
            del model
            where[name] = {**{m: scores[m] for m in method.metrics}, "size_bytes": size}
            ctx.log.debug("%s: %s", name, where[name])
        report["quantization_cost"] = {scheme: {m: q[m] - report["trained"][m] for m in q if m != "size_bytes"}
                                       for scheme, q in report.get("quantized", {}).items()}
    report["gain"] = {m: report["trained"][m] - report["base"][m] for m in report["base"] if m != "size_bytes"}
    (out / "eval.json").write_text(json.dumps(report, indent=1, sort_keys=True) + "\n")


def summary(path: Path) -> list[str]:
    """eval.json's scores and sizes, for `doit show`."""
    report = jsontext.read(path / "eval.json")
    models = [(m, report[m]) for m in ("base", "trained") if m in report]
    models += [(f"quantized {s}", q) for s, q in report.get("quantized", {}).items()]
    return [f"eval.json on {report['heldout_rows']} held-out rows: " + "; ".join(
        f"{m} " + ", ".join(f"{v:,} bytes" if k == "size_bytes" else
                           f"{k.replace('_', ' ')} {v:{'.2f' if k == 'perplexity' else '.3f'}}"
                           for k, v in sorted(r.items())) for m, r in models)]
