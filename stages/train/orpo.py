"""ORPO: TRL's ORPOTrainer (trl.experimental.orpo in TRL 1.x) on the shards' preference pairs:
the chosen answer's language-model loss plus train.beta times the odds-ratio loss, with no
reference model."""
from __future__ import annotations

from pathlib import Path

from stages.train.dpo import dataset, pairwise_trainer

__all__ = ["dataset", "make_trainer"]


def make_trainer(model, train, tok, plan: dict, t, output_dir: Path):
    from trl.experimental.orpo import ORPOConfig, ORPOTrainer

    return pairwise_trainer(ORPOConfig, ORPOTrainer, model, train, tok, plan, t, output_dir)
