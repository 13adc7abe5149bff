"""SFT and CPT: TRL's SFTTrainer over the packed shards as they are (no re-tokenization, no
re-packing), with the plan's batch shape; the loss is the model's own loss function, computed
on the positions that have a target only: the assistant tokens of chat rows (sft), every token
of plain text (cpt: the text kind masks nothing out). bench/train_speed.py builds its trainer
here too."""
from __future__ import annotations

from contextlib import contextmanager
from pathlib import Path

import numpy as np

from stages.data import packed
from stages.train import document_mask
from stages.train.settings import peft_config, without_peft
from stages.train.trainer import plan_args


def dataset(shards: Path, tok=None):
    """The packed training sequences: ids, labels and restarting position ids (already
    tokenized: the tokenizer, which other methods decode with, is not needed)."""
    from datasets import Dataset

    parts = [packed.read(p) for p in sorted((shards / "train").glob("shard-*.safetensors"))]
    return Dataset.from_dict({k: np.concatenate([s[k] for s in parts]).tolist()
                              for k in ("input_ids", "labels", "position_ids")})


def collate(rows, document_blocks: bool = False):
    """Packed rows are already full length: stack them. No attention mask: the model builds a
    causal mask per document from the restarting position ids, or, with document_blocks, takes
    flex attention's block mask from the blocks found here (stages/train/document_mask.py).
    loss_rows: the flattened positions whose next token is a target, and loss_targets those
    targets. Both found here on the CPU so that using them on the GPU needs no host sync."""
    import torch

    batch = {k: torch.tensor([r[k] for r in rows], dtype=torch.long)
             for k in ("input_ids", "labels", "position_ids")}
    targets = torch.nn.functional.pad(batch["labels"][:, 1:], (0, 1), value=packed.IGNORE).flatten()
    batch["loss_rows"] = (targets != packed.IGNORE).nonzero().squeeze(1)
    batch["loss_targets"] = targets[batch["loss_rows"]]
    if document_blocks:
        batch.update(document_mask.blocks(batch["position_ids"]))
    return batch


class TargetRowsHead:
    """Hooks on the output embeddings: only the positions that have a target go through the LM
    head and the loss. A prompt token, a padding token or a document's last token has none,
    yet the model's own loss computes its logits (a 152k vocabulary: 2.5 GFLOP per token
    forward and backward on an 8B model) and its fp32 softmax, then ignores them. The model's
    forward runs unchanged otherwise; models that add a router loss to the loss inside the
    forward keep it whole.

    The head's output is also kept here for the loss, and the model handed an empty slice of
    it: under bf16 the Trainer's accelerate converts every bf16 tensor the forward returns to
    fp32, a copy of the logits each way (5 GB apiece at a 152k vocabulary, 9 ms of an H100
    step), where the compiled loss upcasts in registers. Only for a model that returns the
    head's output as its logits, which the first forward checks (`keep` is None until then):
    one that caps or scales its logits after the head keeps returning them whole, as does a
    model under FSDP (make_trainer)."""

    def __init__(self, model):
        config = without_peft(model).config
        self.usable = not getattr(config, "output_router_logits", False) and model.get_output_embeddings() is not None
        self.rows = None
        self.keep = None
        self.kept = None
        if self.usable:
            head = model.get_output_embeddings()
            head.register_forward_pre_hook(self.select)
            head.register_forward_hook(self.hold)

    def select(self, module, args):
        if self.rows is None:
            return None
        hidden = args[0]
        return (hidden.flatten(0, -2)[self.rows],) + args[1:]

    def hold(self, module, args, output):
        if self.rows is None or self.keep is False:
            return None
        self.kept = output
        return output[:0] if self.keep else None

    def logits(self, returned):
        """The logits for the loss: the head's own output where the model returns it as is (the
        first call compares the two, bit for bit; the loss sees one dtype from the start, so it
        compiles once), else what the model returned."""
        import torch

        kept, self.kept = self.kept, None
        if self.keep is None:  # compared a slice at a time: no third copy of the logits at once
            self.keep = kept is not None and returned.shape == kept.shape and all(
                torch.equal(r.to(kept.dtype), k) for r, k in zip(returned.split(1024), kept.split(1024)))
        return kept if self.keep else returned

    @contextmanager
    def only(self, rows):
        self.rows = rows
        try:
            yield
        finally:
            self.rows = None


def model_loss_trainer(sft_trainer):
    """`sft_trainer` (TRL's SFTTrainer) whose loss is the model's own loss function (cross-entropy on the shard's
    labels, normalized by the batch's loss tokens as TRL's is), on the target rows only
    (TargetRowsHead). TRL's default runs its chunked LM head instead, which also computes
    entropy and token accuracy for the logs: three host syncs and extra passes over the
    vocabulary per micro-batch (bench/step_profile.py times both)."""
    from transformers import Trainer

    class ModelLossSFTTrainer(sft_trainer):
        def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
            inputs = dict(inputs)
            rows, targets = inputs.pop("loss_rows"), inputs.pop("loss_targets")
            if document_mask.KEYS[0] in inputs:
                inputs["attention_mask"] = document_mask.block_mask({k: inputs.pop(k) for k in document_mask.KEYS})
            if return_outputs or not self.head.usable:
                return Trainer.compute_loss(self, model, inputs, return_outputs, num_items_in_batch)
            inputs.pop("labels")
            with self.head.only(rows):
                logits = self.head.logits(model(**inputs).logits)
            base = without_peft(self.accelerator.unwrap_model(model))
            loss = base.loss_function(logits=logits, labels=None, shift_labels=targets,
                                      vocab_size=logits.shape[-1], num_items_in_batch=num_items_in_batch)
            if self.args.average_tokens_across_devices and num_items_in_batch is not None:
                loss = loss * self.accelerator.num_processes  # as Trainer.compute_loss scales its own
            return loss

    return ModelLossSFTTrainer


def make_trainer(method, model, train, tok, plan: dict, t, output_dir: Path):
    """SFTTrainer over packed rows, with the plan's batch shape; under flex attention, the
    documents' block mask found by the collator."""
    from functools import partial

    config, trainer = method.trl()
    args = config(**plan_args(plan, t, output_dir, method.logs), dataset_kwargs={"skip_prepare_dataset": True})
    blocks = document_mask.usable(without_peft(model).config, plan.get("attn_implementation"))
    run = model_loss_trainer(trainer)(model=model, args=args, train_dataset=train, processing_class=tok,
                                      data_collator=partial(collate, document_blocks=blocks),
                                      peft_config=peft_config(t, method.peft_task))
    run.head = TargetRowsHead(run.model)
    if run.is_fsdp_enabled:  # FSDP hangs its backward hooks on the forward's outputs: hand it the logits whole
        run.head.keep = False
    return run
