"""CPT (continued pretraining): TRL's SFTTrainer on packed plain text, loss on every token
(the shards stage's text kind masks nothing out), the same packed feed as SFT."""
from __future__ import annotations

from stages.train.sft import dataset, make_trainer

__all__ = ["dataset", "make_trainer"]
