"""What the plan's decisions do to a model and to the process: shared by the plan's probe
(stages/train/autotune.py), which measures them, and by training, which applies them, so the
two can never drift apart."""
from __future__ import annotations

import os
import warnings

from stages.model.numerics import ROCM_FA_SWITCH

# PEFT 0.21's get_peft_model and TRL 1.16's trainers read transformers' deprecated
# `is_gradient_checkpointing` property (its FutureWarning on every LoRA build); not a call of
# ours to fix, so this one message is filtered where training is set up
warnings.filterwarnings("ignore", message="`is_gradient_checkpointing` is deprecated", category=FutureWarning)


def nodes() -> int:
    """Nodes of a multi-node launch: NNODES in the environment, 1 without it (read by the plan,
    whose processes it multiplies, and by the launch, stages/train/distributed.py)."""
    from stages.engine.errors import UserError

    value = os.environ.get("NNODES", "1")
    if not value.isdigit() or int(value) < 1:
        raise UserError(f"environment NNODES={value!r}: give the number of nodes as a positive integer")
    return int(value)


def sharding(processes: int, device: str, replica_fits: bool = False) -> dict | None:
    """How the plan splits a run of several GPU processes: FSDP2 through the Trainer's accelerate
    (parameters, gradients and optimizer state sharded per decoder layer, resharded after each
    forward, the full weights gathered for saving), or None: every process holds the whole model
    and the Trainer runs DDP. None for one process; for a run whose replica fits one GPU
    (`replica_fits`: a LoRA run, whose only gradients are the adapter's, so DDP moves megabytes a
    step where FSDP2 gathers every weight twice); and on CPU, where accelerate 1.15 turns its FSDP
    plugin on only for accelerator devices (AcceleratorState leaves a CPU run MULTI_CPU, and
    would ignore an fsdp_config): the processes run DDP over gloo."""
    if processes == 1 or device == "cpu" or replica_fits:
        return None
    return {"version": 2, "reshard_after_forward": True, "state_dict_type": "FULL_STATE_DICT"}


def lora_config(t, task_type: str = "CAUSAL_LM"):
    """PEFT's LoraConfig from the recipe's train section (its lora and the method's task:
    SEQ_CLS for a reward model, whose new scoring head PEFT then trains in full)."""
    from peft import LoraConfig

    return LoraConfig(r=t.lora.r, lora_alpha=t.lora.alpha, lora_dropout=t.lora.dropout,
                      target_modules=t.lora.target_modules, target_parameters=t.lora.target_parameters,
                      task_type=task_type)


def peft_config(t, task_type: str):
    """The adapter TRL wraps the model in: LoRA for lora and qlora (whose base is loaded in
    4-bit by trainable_model), none for full weights; task_type is the method's row's peft_task."""
    return None if t.peft == "none" else lora_config(t, task_type)


def nf4_config():
    """QLoRA's base: bitsandbytes NF4 with double quantization, bf16 compute (the QLoRA paper's
    setting); the one-line error where bitsandbytes is not installed."""
    import importlib.util

    import torch
    from transformers import BitsAndBytesConfig

    from stages.engine.errors import UserError

    if importlib.util.find_spec("bitsandbytes") is None:
        raise UserError("train.peft: qlora needs bitsandbytes: pip install 'mindxtrain[qlora]' (or use peft: lora)")
    return BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
                              bnb_4bit_compute_dtype=torch.bfloat16)


def rocm_env(library: str | None) -> dict[str, str]:
    """The environment switch that selects the ROCm flash-attention library (none: torch's default)."""
    return {} if library is None else {ROCM_FA_SWITCH: "1" if library == "ck" else "0"}


def sdpa_backend(name: str | None):
    """The plan's SDPA backend for every attention call in training (none chosen: torch decides)."""
    from contextlib import nullcontext

    from torch.nn.attention import SDPBackend, sdpa_kernel

    return sdpa_kernel(getattr(SDPBackend, name.upper())) if name else nullcontext()


def decoder_layers(model) -> list:
    from transformers.modeling_layers import GradientCheckpointingLayer

    return [m for m in model.modules() if isinstance(m, GradientCheckpointingLayer)]


def without_peft(model):
    """The transformers model under a PEFT wrapper (itself when there is none)."""
    return model.get_base_model() if hasattr(model, "get_base_model") else model


def apply_checkpointing(model, mode: str) -> None:
    """off, full, or selective: every other decoder layer recomputed in the backward pass."""
    if mode == "off":
        model.activation_checkpointing_disable()
        return
    model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    if mode == "selective":
        for layer in decoder_layers(model)[1::2]:
            layer.gradient_checkpointing = False


# Inductor fuses a chain of ops in fp32 and rounds to bf16 once, where eager rounds after each
# op (RMSNorm's cast back before its weight, the activation before the gate's product): on real
# text that moved 20 steps' loss 0.055 from eager's (bench/compile_precision.py). Emulating
# eager's casts keeps the fusions, rounds where eager does, and costs no speed there.
COMPILE_OPTIONS = {"emulate_precision_casts": True}


def compile_regions(model) -> None:
    """Regional compilation: each decoder layer compiled (one graph, reused by all layers),
    and the loss: eager, it copies the logits to fp32, keeps fp32 log-probabilities for the
    backward and writes an fp32 gradient, each the size of the logits (4 x 2048 tokens of
    a 152k vocabulary: 5 GB apiece); compiled, the upcast, softmax and gather are fused."""
    import torch

    for layer in decoder_layers(model):
        layer.compile(options=COMPILE_OPTIONS)
    base = without_peft(model)
    base.loss_function = torch.compile(base.loss_function, options=COMPILE_OPTIONS)


def switch_settings(model, s: dict) -> None:
    """The part of a setting that can change on a built model as often as wanted: attention
    (with ROCm's flash library) and checkpointing. The probe switches them on its one model."""
    if s["rocm_fa_library"]:
        import torch

        torch.backends.cuda.preferred_rocm_fa_library(s["rocm_fa_library"])
    model.set_attn_implementation(s["attn_implementation"])
    apply_checkpointing(model, s["gradient_checkpointing"])


def apply_settings(model, s: dict) -> None:
    """Everything in a setting that acts on a built model (the probe and training alike)."""
    switch_settings(model, s)
    if s["compile"]:
        compile_regions(model)
    if s["fused_cross_entropy"]:
        fused_loss(without_peft(model))


def fused_loss(model) -> None:
    """Liger's fused linear cross-entropy bound to this instance, through its public per-model
    function (apply_liger_kernel_to_<type>(model=...)). Its other switches (rope, RMSNorm,
    SwiGLU, ...: on by default) patch transformers' module for the whole process, so every model
    built after this probe candidate would run them, compiled regions included: all turned off."""
    import inspect

    from liger_kernel.transformers.monkey_patch import MODEL_TYPE_TO_APPLY_LIGER_FN

    apply = MODEL_TYPE_TO_APPLY_LIGER_FN.get(model.config.model_type)
    if apply is None:  # the probe records this candidate as failed; a plan never holds it
        raise ValueError(f"Liger has no fused loss for model type {model.config.model_type!r}")
    others = {name: False for name, p in inspect.signature(apply).parameters.items()
              if isinstance(p.default, bool) and name != "fused_linear_cross_entropy"}
    apply(model=model, fused_linear_cross_entropy=True, **others)


def step_context(model, plan: dict, bf16: bool = True, share_inputs: bool = True, accumulate: bool = True):
    """What every training step runs inside, in training and in the probe's measurements alike:
    the plan's SDPA backend; under bf16 autocast, LoRA inputs left in bf16; LoRA's scale in B's
    weight, A's product shared per input and the base product added into LoRA's by cuBLAS
    (stages/train/lora_scale.py; share_inputs=False: one A product per projection, and
    accumulate=False: the two products summed, bench/step_profile.py's baselines). PEFT keeps the adapters in fp32 and casts each input
    to fp32 (an fp32 copy of every projection's input); autocast casts it back to bf16 for the
    matmul, so the round trip changes no value. 8B LoRA micro-batch 4 on H100 through this
    trainer: 2.3 GiB less peak memory, the same speed (bench/step_profile.py
    trainer_mb4_input_cast)."""
    from contextlib import ExitStack

    from peft.helpers import disable_input_dtype_casting

    from stages.train.lora_scale import scale_in_weight

    stack = ExitStack()
    stack.enter_context(sdpa_backend(plan["sdpa_backend"]))
    stack.enter_context(disable_input_dtype_casting(model, active=bf16))
    stack.enter_context(scale_in_weight(model, share_inputs, accumulate))
    return stack


def training_context(trainer, plan: dict):
    """What train() runs inside: step_context for the Trainer's model and precision."""
    return step_context(trainer.model, plan, trainer.args.bf16)
