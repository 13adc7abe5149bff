"""checkpoint: training, by the recipe's method, applying plan.json's decisions verbatim.

Each method is one module of stages/train/ (its dataset from the shards, its TRL trainer),
named in METHODS; the stage's key covers the module of the recipe's method only. Trainer
checkpoints go to a work dir that survives a kill, so a rerun resumes from the last saved
step. The artifact holds only deterministic content: the weights (model/) or the standard
PEFT adapter (adapter/), and metrics.jsonl with the loss per step.
"""
from __future__ import annotations

import importlib
import json
import os
from pathlib import Path

from stages.engine.errors import UserError
from stages.train import trainer
from stages.train.settings import training_mode

# train.method -> its module: dataset(shards, tok), make_trainer(...), and HEAD where it is not a causal LM
METHODS = {"sft": "stages.train.sft", "cpt": "stages.train.cpt", "dpo": "stages.train.dpo",
           "reward": "stages.train.reward", "orpo": "stages.train.orpo", "grpo": "stages.train.grpo"}


def code_modules(recipe) -> list[str]:
    """The method's module: part of this stage's code, as the modules it imports are."""
    return [METHODS[recipe.train.method]] if recipe.train.method in METHODS else []


def build(ctx, out: Path) -> None:
    from transformers import AutoTokenizer, set_seed

    t = ctx.recipe.train
    if t.method not in METHODS:
        raise UserError(f"train.method: {t.method} training is not built yet (its shards are: "
                        f"doit shards:{ctx.recipe_name}); use method: {' or '.join(METHODS)}")
    method = importlib.import_module(METHODS[t.method])
    plan = json.loads((ctx.upstream["plan"] / "plan.json").read_text())["decisions"]
    os.environ.update(plan["env"])
    training_mode()
    set_seed(t.seed)

    tok = AutoTokenizer.from_pretrained(ctx.upstream["base"])
    model = trainer.trainable_model(ctx.upstream["base"], plan, getattr(method, "HEAD", "causal_lm"), t.peft)
    ctx.log.info("base loaded in %s", "4-bit NF4 (bitsandbytes), bf16 compute" if getattr(model, "is_loaded_in_4bit", False)
                 else plan["dtype"])
    ctx.work.mkdir(parents=True, exist_ok=True)
    run = method.make_trainer(model, method.dataset(ctx.upstream["shards"], tok), tok, plan, t, ctx.work)
    trainer.train(run, plan, t.max_steps, ctx.work, ctx.log, ctx.run)
    trainer.save(run, tok, t.peft, out)


def summary(path: Path) -> list[str]:
    """The loss curve's ends (metrics.jsonl), for `doit show`."""
    steps = [json.loads(line) for line in (path / "metrics.jsonl").read_text().splitlines()]
    if not steps:
        return ["metrics.jsonl: no steps logged"]
    return [f"metrics.jsonl: loss {steps[0]['loss']:.4f} at step {steps[0]['step']} -> "
            f"{steps[-1]['loss']:.4f} at step {steps[-1]['step']}"]
