"""ORPO: TRL's ORPOTrainer (trl.experimental.orpo in TRL 1.x) on the shards' preference pairs:
the chosen answer's language-model loss plus train.beta times the odds-ratio loss, with no
reference model."""
from __future__ import annotations

from pathlib import Path

from stages.train.pairs import preference_texts
from stages.train.settings import lora_config
from stages.train.trainer import plan_args


def dataset(shards: Path, tok):
    return preference_texts(shards, tok)


def make_trainer(model, train, tok, plan: dict, t, output_dir: Path):
    from trl.experimental.orpo import ORPOConfig, ORPOTrainer

    args = ORPOConfig(**plan_args(plan, t, output_dir), beta=t.beta,
                      max_length=None)  # the shards stage already applied data.max_length
    return ORPOTrainer(model=model, args=args, train_dataset=train, processing_class=tok,
                       peft_config=lora_config(t) if t.peft == "lora" else None)
