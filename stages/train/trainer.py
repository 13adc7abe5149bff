"""What every training method shares around its TRL trainer: the model built as the plan
says (with the head the method's row names), resuming after a kill from the last fully saved
step, the step log, and saving the artifact (weights or a standard PEFT adapter, metrics.jsonl)
with deterministic content only. fit() is one process's whole run: the checkpoint stage calls it
itself, or through torchrun in each of the plan's processes (stages/train/distributed.py)."""
from __future__ import annotations

import importlib
import json
import shutil
import time
from pathlib import Path

from stages.model.trained import dequantized
from stages.model.numerics import training_mode
from stages.train.settings import apply_settings, nf4_config, training_context

COMPLETE = "mindxtrain-complete"
SET_VALUED = ("target_modules", "exclude_modules")  # adapter_config.json fields PEFT keeps as sets


def trainable_model(base: Path, plan: dict, head: str, peft: str):
    """The base model in the plan's dtype with the plan's settings applied; head "score" puts a
    one-output scoring head on it (a reward model), as TRL's RewardTrainer loads one; peft
    "qlora" loads the base's linear layers in 4-bit NF4 on the GPU (TRL then puts LoRA on it)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

    dtype = getattr(torch, plan["dtype"])
    load = dequantized(base)
    if peft == "qlora":
        load = {"quantization_config": nf4_config(), "device_map": {"": torch.cuda.current_device()}}
    if head == "score":
        model = AutoModelForSequenceClassification.from_pretrained(base, dtype=dtype, num_labels=1, **load)
    else:
        model = AutoModelForCausalLM.from_pretrained(base, dtype=dtype, **load)
    model.config.use_cache = False
    apply_settings(model, plan)
    return model


def fit(method, base: Path, shards: Path, plan: dict, t, work: Path, out: Path, resume: Path | None, log,
        run: dict, progress=None) -> None:
    """Train by the method (its row of stages/train/methods.py; its module's dataset and
    make_trainer) as the plan says, from `resume` if given, and save the artifact into `out`
    (the first process only, when there are several). `progress` makes the step bar (the build's
    Context.progress: on the console, drawn only on a terminal); None: tqdm's own."""
    from transformers import AutoTokenizer, set_seed

    training_mode(plan["env"])
    set_seed(t.seed)
    tok = AutoTokenizer.from_pretrained(base)
    module = importlib.import_module(method.module)
    model = trainable_model(base, plan, method.head, t.peft)
    log.debug("base loaded in %s", "4-bit NF4 (bitsandbytes), bf16 compute" if getattr(model, "is_loaded_in_4bit", False)
             else plan["dtype"])
    work.mkdir(parents=True, exist_ok=True)
    trainer = module.make_trainer(method, model, module.dataset(shards, tok), tok, plan, t, work)
    train(trainer, plan, t.max_steps, resume, log, run, progress)
    save(trainer, tok, t.peft, plan["dtype"], method.logs, out, log)


def distributed_args(plan: dict) -> dict:
    """The Trainer's arguments for the sharding plan.json records (none: one process, or DDP)."""
    return {"fsdp": True, "fsdp_config": plan["sharding"]} if plan.get("sharding") else {}


LOG_EVERY = 10  # steps between the Trainer's own logs (TRL's default): each reads the loss, a host sync


def plan_args(plan: dict, t, output_dir: Path, logs: tuple[str, ...] = ()) -> dict:
    """The TrainingArguments every method shares: the recipe's optimizer settings, the plan's
    batch shape (per process) and precision, checkpoints every save_steps for resuming, FSDP2
    where the plan has several GPU processes, and no host sync between steps: the Trainer logs
    every LOG_EVERY steps (StepRecords keeps each step's figures) and copies batches to the GPU
    without blocking, so the host fetches and collates the next batch while the GPU trains.
    A method with figures of its own (`logs`: TRL's, kept in metrics.jsonl) is logged every step."""
    return dict(**distributed_args(plan),
        output_dir=str(output_dir), max_steps=t.max_steps, learning_rate=t.lr,
        per_device_train_batch_size=plan["micro_batch_size"], gradient_accumulation_steps=plan["grad_accum"],
        warmup_steps=t.warmup_steps, weight_decay=t.weight_decay, lr_scheduler_type="cosine",
        logging_steps=1 if logs else LOG_EVERY,
        logging_nan_inf_filter=False,  # the filter's check of each micro-batch's loss is a
        # host sync that left the GPU idle between micro-batches (8B LoRA on H100: 12.1k -> 13.9k tok/s,
        # bench/step_profile.py); a NaN loss is logged as it is
        accelerator_config={"non_blocking": plan["device"] != "cpu"},  # pinned batches (the default) to the GPU
        save_strategy="steps", save_steps=t.save_steps, save_total_limit=2,
        seed=t.seed, data_seed=t.seed, report_to="none", use_cpu=plan["device"] == "cpu",
        bf16=plan["dtype"] == "bfloat16", activation_checkpointing=False,  # already set on the model
        dataloader_num_workers=0, remove_unused_columns=False)


class StepRecords:
    """Each optimizer step's loss, gradient norm and learning rate, the figures the Trainer logs
    when it logs every step, kept as tensors where the GPU computes them and read at the
    Trainer's own logs (a host sync every LOG_EVERY steps, and at every save and the last step).
    Reading them each step drained the GPU at every step's end, and it idled while the host
    fetched, collated and launched the next step: 3.3-3.7% of an 8B LoRA step on an H100
    (bench/results/steps_ahead_h100_2026-12-07/). At each of its logs the Trainer's entry (the
    mean of the steps since the last) is replaced in its log history by one entry per step, so
    metrics.jsonl and a resumed run's history hold every step, as before; a method's own figures
    (TRL's) stay on the step they were logged at. The loss is the step's micro-batch losses
    summed from zero in fp32, as the Trainer sums them (tests/test_step_records.py: the same floats
    in one process; over several, averaged as it does, up to the order of that sum; after a NaN
    loss each step starts again from zero, where the Trainer's running sum stayed NaN); the norm
    is what clip_grad_norm_ returned (before clipping; where transformers computes it without
    the accelerator, on mixed device meshes, only its logged steps have one); the rate is the
    scheduler's for the step. The Trainer hands none of them to callbacks, so its public
    training_step and its accelerator's clip_grad_norm_ are wrapped on this one trainer."""

    def __init__(self, trainer):
        from transformers import TrainerCallback

        self.trainer, self.pending, self.last = trainer, [], []
        self.loss = self.norm = self.rate = None
        step, clip = trainer.training_step, trainer.accelerator.clip_grad_norm_

        def training_step(*args, **kwargs):
            import torch

            loss = step(*args, **kwargs)
            if self.loss is None:
                self.loss = torch.zeros((), device=loss.device)
            self.loss += loss
            return loss

        def clip_grad_norm_(*args, **kwargs):
            self.norm = clip(*args, **kwargs)
            return self.norm

        trainer.training_step, trainer.accelerator.clip_grad_norm_ = training_step, clip_grad_norm_
        records = self

        class Records(TrainerCallback):
            def on_optimizer_step(self, args, state, control, lr_scheduler=None, **kwargs):
                rate = lr_scheduler.get_last_lr()[0]
                records.rate = rate.item() if hasattr(rate, "item") else rate

            def on_step_end(self, args, state, control, **kwargs):
                records.pending.append((state.global_step, records.loss, records.norm, records.rate))
                records.loss = records.norm = records.rate = None
                if state.global_step % args.save_steps == 0 or state.global_step >= state.max_steps:
                    control.should_log = True  # a checkpoint's history, and the run's, hold every step

            def on_log(self, args, state, control, logs=None, **kwargs):
                rows = records.flush()
                entry = state.log_history[-1] if state.log_history else {}
                if "loss" in entry and rows and entry["step"] == rows[-1]["step"]:
                    state.log_history.pop()  # the Trainer's mean over the steps since its last log
                    rows[-1] = {**entry, **rows[-1]}
                state.log_history += rows

        trainer.add_callback(Records())

    def flush(self) -> list[dict]:
        """The pending steps as log entries ({step, loss, grad_norm, learning_rate}), also kept as
        `last`. Every process calls it at the same steps (the Trainer's logs): under several, the
        losses are gathered and averaged, as the Trainer's log does."""
        import torch

        pending, self.pending, self.last = self.pending, [], []
        if not pending:
            return []
        losses = torch.stack([loss for _, loss, _, _ in pending])
        if self.trainer.accelerator.num_processes > 1:
            losses = self.trainer.accelerator.gather(losses[None]).mean(0)
        for (step, _, norm, rate), loss in zip(pending, losses.tolist()):
            row = {"loss": loss, "learning_rate": rate, "step": step}
            if norm is not None:
                row["grad_norm"] = norm.item() if isinstance(norm, torch.Tensor) else norm
            self.last.append(row)
        return list(self.last)


def mark_complete_callback():
    """Trainer writes checkpoint-N in place, so a kill mid-save leaves a partial directory.
    Mark each one once every process has saved its part; resume only from marked ones. And
    save every save_steps only: transformers also saves at the last step, which the artifact
    saved right after makes useless, and for a sharded full fine-tune that save gathers the
    whole optimizer state onto one process (Qwen3-14B on two H200s: minutes, for nothing)."""
    from transformers import TrainerCallback

    class MarkComplete(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            if state.global_step >= state.max_steps and state.global_step % args.save_steps:
                control.should_save = False

        def on_save(self, args, state, control, **kwargs):
            import torch.distributed as dist

            if dist.is_initialized():
                dist.barrier()  # every process has written its part (its RNG state, its shards)
            if state.is_local_process_zero:  # each node marks its own work dir
                (Path(args.output_dir) / f"checkpoint-{state.global_step}" / COMPLETE).touch()

    return MarkComplete()


def step_log_callback(log, max_steps: int, records: StepRecords, progress=None):
    """The Trainer's progress bar (steps, ETA) with the loss in it: the one live line on the
    console, made by `progress` where given; each step's line goes to the stage log beside the
    artifact only (DEBUG), written at each of the Trainer's logs (StepRecords)."""
    from transformers.trainer_callback import ProgressCallback

    class StepLog(ProgressCallback):
        def on_train_begin(self, args, state, control, **kwargs):
            if progress is None:
                return super().on_train_begin(args, state, control, **kwargs)
            if state.is_world_process_zero:
                self.training_bar = progress(total=state.max_steps, dynamic_ncols=True)
            self.current_step = 0

        def on_log(self, args, state, control, logs=None, **kwargs):
            rows = records.last  # flushed by the records' own callback, added before this one
            for row in rows:
                log.debug("step %d/%d loss %.4f grad_norm %.4f lr %.3g", row["step"], max_steps,
                          row["loss"], row.get("grad_norm", float("nan")), row["learning_rate"])
            if rows and self.training_bar is not None:
                self.training_bar.set_postfix(loss=f"{rows[-1]['loss']:.4f}", refresh=False)

    return StepLog()


def step_clock_callback(seconds: list):
    """Each optimizer step's wall time, the interval between the ends of consecutive steps, filled
    in at the end of training: the run's tokens/s without the start-up, load and save that
    train_runtime holds. On a GPU the ends are CUDA events, timed as the GPU reaches them (its
    idle time waiting for the host included) with no host sync between steps (StepRecords)."""
    import time

    from transformers import TrainerCallback

    class StepClock(TrainerCallback):
        def __init__(self):
            self.ends = []  # per step: the time (CPU) or CUDA event of its end; None where a save came before

        def now(self):
            import torch

            if not torch.cuda.is_available():
                return time.perf_counter()
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            return event

        def on_step_end(self, args, state, control, **kwargs):
            self.ends.append(self.now())

        def on_save(self, args, state, control, **kwargs):
            self.ends += [None, self.now()]  # the next step's time starts after the save

        def on_train_end(self, args, state, control, **kwargs):
            import torch

            if torch.cuda.is_available():
                torch.cuda.synchronize()
            for start, end in zip(self.ends, self.ends[1:]):
                if start is not None and end is not None:
                    gap = end - start if isinstance(end, float) else start.elapsed_time(end) / 1e3
                    seconds.append(round(gap, 4))

    return StepClock()


def last_complete_checkpoint(work: Path) -> Path | None:
    """The newest fully saved checkpoint; partial ones from a kill are removed."""
    saved = sorted(work.glob("checkpoint-*"), key=lambda p: int(p.name.split("-")[-1]))
    for partial in [p for p in saved if not (p / COMPLETE).exists()]:
        shutil.rmtree(partial)
    return next((p for p in reversed(saved) if (p / COMPLETE).exists()), None)


def train(trainer, plan: dict, max_steps: int, resume: Path | None, log, run: dict, progress=None) -> None:
    """Run the trainer to max_steps inside the plan's training context, resuming from `resume`
    (last_complete_checkpoint of the work dir, found once before any process starts); run-time
    figures go into `run`."""
    from transformers.trainer_callback import ProgressCallback

    trainer.remove_callback(ProgressCallback)
    records = StepRecords(trainer)
    trainer.add_callback(step_log_callback(log, max_steps, records, progress))
    trainer.add_callback(mark_complete_callback())
    run["step_seconds"] = []  # from the second step on (the first has no start to measure from)
    trainer.add_callback(step_clock_callback(run["step_seconds"]))
    if resume:
        run["resumed_from_step"] = int(resume.name.split("-")[-1])
    with training_context(trainer, plan):
        result = trainer.train(resume_from_checkpoint=str(resume) if resume else None)
    run.update({k: v for k, v in result.metrics.items() if "runtime" in k or "per_second" in k})
    import torch

    if torch.cuda.is_available():
        run["peak_gpu_memory_bytes"] = torch.cuda.max_memory_allocated()


def gathered_state(trainer, peft: str, dtype: str) -> dict | None:
    """Under FSDP, the weights to save, each tensor gathered whole by every process together, one
    at a time, and kept by the first process (None without FSDP: the model holds them). An
    adapter's are its trainable tensors alone, as they are: gathering the whole sharded model to
    keep a few MB of LoRA held a 2-GPU 8B run for minutes after its last step. A full model's are
    what one process saves: cast to the plan's dtype on the GPU before they are copied out
    (accelerate keeps fp32 master weights under mixed precision: a bf16 model would be saved at
    twice its size, and copied and cast on the CPU), and without a tied weight's second name
    (gathered copies no longer share storage, so save_pretrained would write lm_head.weight too)."""
    if not trainer.is_fsdp_enabled:
        return None
    import torch
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor

    model, keep = trainer.model, dist.get_rank() == 0
    if peft == "none":
        aliases = ({n for n, _ in model.named_parameters(remove_duplicate=False)} -
                   {n for n, _ in model.named_parameters()})
        tensors, cast = [(k, v) for k, v in model.state_dict().items() if k not in aliases], getattr(torch, dtype)
    else:
        tensors, cast = [(n, p) for n, p in model.named_parameters() if p.requires_grad], None
    state = {}
    for name, tensor in tensors:
        whole = (tensor.full_tensor() if isinstance(tensor, DTensor) else tensor).detach()
        if keep:
            state[name] = (whole.to(cast) if cast and whole.is_floating_point() else whole).cpu()
    # under NCCL the other processes only queue their side of each gather on the GPU and would exit
    # at once, and the gathers the first process still waits on never complete (a 14B full
    # fine-tune sat here for minutes after its last step). They wait here until it has every tensor.
    dist.barrier()
    return state


def save(trainer, tok, peft: str, dtype: str, logs: tuple[str, ...], out: Path, log) -> None:
    """metrics.jsonl (loss per step, and the method's own figures: `logs`) and the weights:
    model/ for full training, or the standard PEFT adapter/ with nothing machine-specific in it.
    Under FSDP every process takes part in gathering the full weights; the first process alone
    writes, as one process would. A sharded run says how long each took."""
    sharded = trainer.is_fsdp_enabled
    if sharded:
        log.info("gathering the weights from the shards")
    start = time.monotonic()
    state = gathered_state(trainer, peft, dtype)
    if sharded:
        log.info("gathered in %.1f s", time.monotonic() - start)
    if not trainer.is_world_process_zero():
        return
    start = time.monotonic()
    with open(out / "metrics.jsonl", "w") as f:
        for entry in trainer.state.log_history:
            if "loss" in entry:
                f.write(json.dumps({k: entry[k] for k in ("step", "loss", "grad_norm", "learning_rate") + logs
                                    if k in entry}, sort_keys=True) + "\n")
    if peft != "none":
        # the adapter alone: PEFT would also copy the base's embedding weights where target_modules
        # names them, which the base (named by digest in the manifest) already holds, and which a
        # sharded run's gathered_state does not gather
        trainer.model.save_pretrained(out / "adapter", state_dict=state, save_embedding_layers=False)
        (out / "adapter" / "README.md").unlink(missing_ok=True)  # a model card with local paths
        cfg_path = out / "adapter" / "adapter_config.json"
        cfg = json.loads(cfg_path.read_text())
        cfg["base_model_name_or_path"] = None  # the base is named by digest in the manifest
        for name in SET_VALUED:  # PEFT holds these as sets and writes them in PYTHONHASHSEED order
            if isinstance(cfg.get(name), list):
                cfg[name] = sorted(cfg[name])
        cfg_path.write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
    else:
        trainer.model.save_pretrained(out / "model", state_dict=state)
        tok.save_pretrained(out / "model")
    if sharded:
        log.info("%s written in %.1f s", "adapter" if peft != "none" else "model", time.monotonic() - start)
