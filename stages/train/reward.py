"""Reward modelling: TRL's RewardTrainer on the shards' preference pairs, a one-output scoring
head on the base model (the row's head: trainer.trainable_model loads it) trained with the
pairwise (Bradley-Terry) loss. The pairs go in as the shards tokenized them (prompt and answer
together, each side whole), which TRL takes as they are."""
from __future__ import annotations

from pathlib import Path

from stages.train.pairs import preference_ids
from stages.train.settings import peft_config
from stages.train.trainer import plan_args


def dataset(shards: Path, tok):
    from datasets import Dataset

    return Dataset.from_list([{"chosen_ids": p["prompt_ids"] + p["chosen_ids"],
                               "rejected_ids": p["prompt_ids"] + p["rejected_ids"]} for p in preference_ids(shards)])


def make_trainer(method, model, train, tok, plan: dict, t, output_dir: Path):
    config, trainer = method.trl()
    args = config(**plan_args(plan, t, output_dir, method.logs),
                  max_length=None)  # the shards stage already applied data.max_length
    return trainer(model=model, args=args, train_dataset=train, processing_class=tok,
                   peft_config=peft_config(t, method.peft_task))  # SEQ_CLS: PEFT trains the new head in full
