"""SFT: TRL's SFTTrainer over the packed shards as they are (no re-tokenization, no
re-packing), with the plan's batch shape; the loss is the model's own (bench/train_speed.py
builds its trainer here too)."""
from __future__ import annotations

from pathlib import Path

import numpy as np

from stages.data import packed
from stages.train.settings import lora_config
from stages.train.trainer import plan_args


def dataset(shards: Path, tok=None):
    """The packed training sequences: ids, labels and restarting position ids (already
    tokenized: the tokenizer, which other methods decode with, is not needed)."""
    from datasets import Dataset

    parts = [packed.read(p) for p in sorted((shards / "train").glob("shard-*.safetensors"))]
    return Dataset.from_dict({k: np.concatenate([s[k] for s in parts]).tolist()
                              for k in ("input_ids", "labels", "position_ids")})


def collate(rows):
    """Packed rows are already full length: stack them. No attention mask, so the model
    builds a causal mask per document from the restarting position ids."""
    import torch

    return {k: torch.tensor([r[k] for r in rows], dtype=torch.long)
            for k in ("input_ids", "labels", "position_ids")}


def model_loss_trainer():
    """SFTTrainer whose loss is the model's own (cross-entropy on the shard's labels, inside the
    forward, normalized by the batch's loss tokens as TRL's is). TRL's default runs its chunked
    LM head instead, which also computes entropy and token accuracy for the logs: three host
    syncs and extra passes over the vocabulary per micro-batch (bench/step_profile.py times both)."""
    from transformers import Trainer
    from trl import SFTTrainer

    class ModelLossSFTTrainer(SFTTrainer):
        def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
            return Trainer.compute_loss(self, model, inputs, return_outputs, num_items_in_batch)

    return ModelLossSFTTrainer


def make_trainer(model, train, tok, plan: dict, t, output_dir: Path):
    """SFTTrainer over packed rows, with the plan's batch shape."""
    from trl import SFTConfig

    args = SFTConfig(**plan_args(plan, t, output_dir), dataset_kwargs={"skip_prepare_dataset": True})
    return model_loss_trainer()(model=model, args=args, train_dataset=train, processing_class=tok,
                                data_collator=collate, peft_config=lora_config(t) if t.peft == "lora" else None)
