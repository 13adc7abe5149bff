"""DPO: TRL's DPOTrainer on the shards' preference pairs (stages/train/pairs.py), the sigmoid
loss with train.beta; the reference model is the base (with LoRA: the same model with its
adapter switched off, as TRL does; full weights: a frozen copy TRL makes)."""
from __future__ import annotations

from pathlib import Path

from stages.train.pairs import preference_texts
from stages.train.settings import peft_config
from stages.train.trainer import plan_args


def dataset(shards: Path, tok):
    return preference_texts(shards, tok)


def make_trainer(model, train, tok, plan: dict, t, output_dir: Path):
    from trl import DPOConfig, DPOTrainer

    return pairwise_trainer(DPOConfig, DPOTrainer, model, train, tok, plan, t, output_dir)


def pairwise_trainer(config, trainer, model, train, tok, plan: dict, t, output_dir: Path):
    """A TRL preference trainer (DPO's, ORPO's) over the pairs, with train.beta and the plan's
    arguments."""
    args = config(**plan_args(plan, t, output_dir), beta=t.beta,
                  max_length=None)  # the shards stage already applied data.max_length
    return trainer(model=model, args=args, train_dataset=train, processing_class=tok,
                   peft_config=peft_config(t))
