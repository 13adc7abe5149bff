"""DPO and ORPO: TRL's preference trainer named in the method's row, on the shards' preference
pairs (stages/train/pairs.py), with train.beta. DPO: the sigmoid loss, the reference model the
base (with LoRA: the same model with its adapter switched off, as TRL does; full weights: a
frozen copy TRL makes). ORPO (trl.experimental.orpo in TRL 1.x): the chosen answer's
language-model loss plus train.beta times the odds-ratio loss, with no reference model."""
from __future__ import annotations

from pathlib import Path

from stages.train.pairs import preference_texts
from stages.train.settings import peft_config
from stages.train.trainer import plan_args


def dataset(shards: Path, tok):
    return preference_texts(shards, tok)


def make_trainer(method, model, train, tok, plan: dict, t, output_dir: Path):
    config, trainer = method.trl()
    args = config(**plan_args(plan, t, output_dir, method.logs), beta=t.beta,
                  max_length=None)  # the shards stage already applied data.max_length
    return trainer(model=model, args=args, train_dataset=train, processing_class=tok,
                   peft_config=peft_config(t, method.peft_task))
