"""checkpoint: supervised fine-tuning with TRL's SFTTrainer (+ PEFT LoRA), resumable.

Training consumes the packed shards as they are (no re-tokenization, no
re-packing) and applies plan.json's decisions verbatim. Trainer checkpoints go
to a work dir that survives a kill, so a rerun resumes from the last saved step.
The artifact holds only deterministic content: the weights (model/) or the
standard PEFT adapter (adapter/), and metrics.jsonl with the loss per step.
"""
from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np

from stages import autotune, packed
from stages.errors import UserError


def trainable_model(ctx, plan: dict):
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(ctx.upstream["base"], dtype=getattr(torch, plan["dtype"]))
    model.config.use_cache = False
    autotune.apply_settings(model, plan)
    return model


def lora_config(t):
    from peft import LoraConfig

    return LoraConfig(r=t.lora.r, lora_alpha=t.lora.alpha, lora_dropout=t.lora.dropout,
                      target_modules=t.lora.target_modules, task_type="CAUSAL_LM")


COMPLETE = "mindxtrain-complete"


def mark_complete_callback():
    """Trainer writes checkpoint-N in place, so a kill mid-save leaves a partial directory.
    Mark each one once it is fully saved; resume only from marked ones."""
    from transformers import TrainerCallback

    class MarkComplete(TrainerCallback):
        def on_save(self, args, state, control, **kwargs):
            (Path(args.output_dir) / f"checkpoint-{state.global_step}" / COMPLETE).touch()

    return MarkComplete()


def step_log_callback(log, max_steps: int):
    """The Trainer's progress bar, with each step's loss written to the stage log
    (beside the artifact) instead of printed as a raw dict."""
    from transformers.trainer_callback import ProgressCallback

    class StepLog(ProgressCallback):
        def on_log(self, args, state, control, logs=None, **kwargs):
            if logs and "loss" in logs:
                log.info("step %d/%d loss %.4f grad_norm %.4f lr %.3g", state.global_step, max_steps,
                         logs["loss"], logs.get("grad_norm", float("nan")), logs.get("learning_rate", 0.0))

    return StepLog()


def last_complete_checkpoint(work: Path) -> Path | None:
    """The newest fully saved checkpoint; partial ones from a kill are removed."""
    import shutil

    saved = sorted(work.glob("checkpoint-*"), key=lambda p: int(p.name.split("-")[-1]))
    for partial in [p for p in saved if not (p / COMPLETE).exists()]:
        shutil.rmtree(partial)
    return next((p for p in reversed(saved) if (p / COMPLETE).exists()), None)


def sdpa_backend(name: str | None):
    """The plan's SDPA backend for every attention call in training (none chosen: torch decides)."""
    from contextlib import nullcontext

    from torch.nn.attention import SDPBackend, sdpa_kernel

    return sdpa_kernel(getattr(SDPBackend, name.upper())) if name else nullcontext()


def training_context(trainer, plan: dict):
    """What train() runs inside: the plan's SDPA backend and, under bf16 autocast, LoRA
    inputs left in bf16. PEFT keeps the adapters in fp32 and casts each input to fp32 (an
    fp32 copy of every projection's input); autocast casts it back to bf16 for the matmul,
    so the round trip changes no value. 8B LoRA micro-batch 4 on H100 through this trainer:
    2.3 GiB less peak memory, the same speed (bench/step_profile.py trainer_mb4_input_cast)."""
    from contextlib import ExitStack

    from peft.helpers import disable_input_dtype_casting

    stack = ExitStack()
    stack.enter_context(sdpa_backend(plan["sdpa_backend"]))
    stack.enter_context(disable_input_dtype_casting(trainer.model, active=trainer.args.bf16))
    return stack


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
    """SFTTrainer over packed rows, with the plan's batch shape (bench/train_speed.py uses it too)."""
    from trl import SFTConfig

    args = SFTConfig(
        output_dir=str(output_dir), max_steps=t.max_steps, learning_rate=t.lr,
        per_device_train_batch_size=plan["micro_batch_size"], gradient_accumulation_steps=plan["grad_accum"],
        warmup_steps=t.warmup_steps, weight_decay=t.weight_decay, lr_scheduler_type="cosine",
        logging_steps=1, logging_nan_inf_filter=False,  # the filter's check of each micro-batch's loss is a
        # host sync that left the GPU idle between micro-batches (8B LoRA on H100: 12.1k -> 13.9k tok/s,
        # bench/step_profile.py); a NaN loss is logged as it is
        save_strategy="steps", save_steps=t.save_steps, save_total_limit=2,
        seed=t.seed, data_seed=t.seed, report_to="none", use_cpu=plan["device"] == "cpu",
        bf16=plan["dtype"] == "bfloat16", gradient_checkpointing=False,  # already set on the model
        dataloader_num_workers=0, remove_unused_columns=False,
        dataset_kwargs={"skip_prepare_dataset": True})
    return model_loss_trainer()(model=model, args=args, train_dataset=train, processing_class=tok,
                                data_collator=collate, peft_config=lora_config(t) if t.peft == "lora" else None)


def build(ctx, out: Path) -> None:
    import torch
    from datasets import Dataset
    from transformers import AutoTokenizer, set_seed
    from transformers.trainer_callback import ProgressCallback

    t = ctx.recipe.train
    plan = json.loads((ctx.upstream["plan"] / "plan.json").read_text())["decisions"]
    os.environ.update(plan["env"])
    autotune.training_mode()
    set_seed(t.seed)

    if t.method != "sft":
        raise UserError(f"train.method: {t.method} training is not built yet (its shards are: "
                        f"doit shards:{ctx.recipe_name}); use method: sft")
    shards = [packed.read(p) for p in sorted((ctx.upstream["shards"] / "train").glob("shard-*.safetensors"))]
    train = Dataset.from_dict({k: np.concatenate([s[k] for s in shards]).tolist()
                               for k in ("input_ids", "labels", "position_ids")})
    tok = AutoTokenizer.from_pretrained(ctx.upstream["base"])
    model = trainable_model(ctx, plan)

    ctx.work.mkdir(parents=True, exist_ok=True)
    trainer = make_trainer(model, train, tok, plan, t, ctx.work)
    trainer.remove_callback(ProgressCallback)
    trainer.add_callback(step_log_callback(ctx.log, t.max_steps))
    trainer.add_callback(mark_complete_callback())
    resume = last_complete_checkpoint(ctx.work)
    if resume:
        ctx.log.info("resuming from %s", resume.name)
        ctx.run["resumed_from_step"] = int(resume.name.split("-")[-1])
    with training_context(trainer, plan):
        result = trainer.train(resume_from_checkpoint=str(resume) if resume else None)
    ctx.run.update({k: v for k, v in result.metrics.items() if "runtime" in k or "per_second" in k})

    with open(out / "metrics.jsonl", "w") as f:
        for entry in trainer.state.log_history:
            if "loss" in entry:
                f.write(json.dumps({k: entry[k] for k in ("step", "loss", "grad_norm", "learning_rate")
                                    if k in entry}, sort_keys=True) + "\n")
    if t.peft == "lora":
        trainer.model.save_pretrained(out / "adapter")
        (out / "adapter" / "README.md").unlink(missing_ok=True)  # a model card with local paths
        cfg_path = out / "adapter" / "adapter_config.json"
        cfg = json.loads(cfg_path.read_text())
        cfg["base_model_name_or_path"] = None  # the base is named by digest in the manifest
        cfg_path.write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
    else:
        trainer.model.save_pretrained(out / "model")
        tok.save_pretrained(out / "model")


def load_trained(checkpoint: Path, base: Path, dtype="float32"):
    """The trained model as a plain transformers model (LoRA merged), for eval and quantize."""
    import torch
    from transformers import AutoModelForCausalLM

    if (checkpoint / "adapter").is_dir():
        from peft import PeftModel

        model = AutoModelForCausalLM.from_pretrained(base, dtype=getattr(torch, dtype))
        return PeftModel.from_pretrained(model, checkpoint / "adapter").merge_and_unload()
    return AutoModelForCausalLM.from_pretrained(checkpoint / "model", dtype=getattr(torch, dtype))
