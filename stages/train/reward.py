"""Reward modelling: TRL's RewardTrainer on the shards' preference pairs, a one-output scoring
head on the base model trained with the pairwise (Bradley-Terry) loss. The pairs go in as the
shards tokenized them (prompt and answer together, each side whole), which TRL takes as they are."""
from __future__ import annotations

from pathlib import Path

from stages.train.pairs import preference_ids
from stages.train.settings import peft_config
from stages.train.trainer import plan_args

HEAD = "score"  # checkpoint loads the base with a scoring head (trainer.trainable_model)


def dataset(shards: Path, tok):
    from datasets import Dataset

    return Dataset.from_list([{"chosen_ids": p["prompt_ids"] + p["chosen_ids"],
                               "rejected_ids": p["prompt_ids"] + p["rejected_ids"]} for p in preference_ids(shards)])


def make_trainer(model, train, tok, plan: dict, t, output_dir: Path):
    from trl import RewardConfig, RewardTrainer

    args = RewardConfig(**plan_args(plan, t, output_dir),
                        max_length=None)  # the shards stage already applied data.max_length
    return RewardTrainer(model=model, args=args, train_dataset=train, processing_class=tok,
                         peft_config=peft_config(t, "SEQ_CLS"))
