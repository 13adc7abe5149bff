"""checkpoint: training, by the recipe's method, applying plan.json's decisions verbatim.

Each method is one row of stages/train/methods.py: its module (its dataset from the shards, its
TRL trainer), the head, the figures kept; the stage's key covers the module of the recipe's
method only. Trainer checkpoints go to a work dir that survives a kill, so a rerun resumes from
the last saved step. The artifact holds only deterministic content: the weights (model/) or the
standard PEFT adapter (adapter/), and metrics.jsonl with the loss per step. When the plan has more
than one process (hardware.gpus > 1), the same run is launched in each of them by torchrun
(stages/train/distributed.py) and the first writes the same artifact; one process on a machine
with more GPUs runs as a child that sees one of them (distributed.one_of_several_gpus says why).
"""
from __future__ import annotations

from pathlib import Path

from stages.engine import jsontext
from stages.train import distributed, trainer
from stages.train.methods import METHODS


def code_modules(recipe) -> list[str]:
    """The method's module: part of this stage's code, as the modules it imports are."""
    return [METHODS[recipe.train.method].module]


def build(ctx, out: Path) -> None:
    import torch

    t = ctx.recipe.train
    method = METHODS[t.method]
    plan = jsontext.read(ctx.upstream["plan"] / "plan.json")["decisions"]
    resume = trainer.last_complete_checkpoint(ctx.work)
    if resume:  # said here, where the console is, for in-process and torchrun training alike
        ctx.log.info("resuming from %s", resume.name)
    if plan["processes"] == 1 and not distributed.one_of_several_gpus(plan, torch.cuda.device_count()):
        trainer.fit(method, ctx.upstream["base"], ctx.upstream["shards"], plan, t, ctx.work, out, resume, ctx.log,
                    ctx.run, ctx.progress)
        return
    spec = {"method": method.name, "plan": plan, "train": t.model_dump(mode="json"),
            "resume": resume and str(resume.resolve()),
            **{k: str(Path(v).resolve()) for k, v in [("base", ctx.upstream["base"]), ("shards", ctx.upstream["shards"]),
                                                       ("work", ctx.work), ("out", out)]}}
    distributed.launch(spec, plan["processes"], ctx.work, ctx.log, ctx.run)


def summary(path: Path) -> list[str]:
    """The loss curve's ends (metrics.jsonl), for `doit show`."""
    steps = [jsontext.loads(line) for line in (path / "metrics.jsonl").read_text().splitlines()]
    if not steps:
        return ["metrics.jsonl: no steps logged"]
    return [f"metrics.jsonl: loss {steps[0]['loss']:.4f} at step {steps[0]['step']} -> "
            f"{steps[-1]['loss']:.4f} at step {steps[-1]['step']}"]
