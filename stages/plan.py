"""plan: decide how to train on this hardware, ahead of time, and write the decisions down.

plan.json holds decisions only (hashed; they feed the checkpoint key and training
applies them verbatim). Timings that led to them are run-time measurements and
are kept beside the artifact (in its sidecar), never in the hashed tree.
On CPU the decisions follow from the device facts; on a GPU (CUDA or ROCm) they come
from stages/train/autotune.py's probe: real training steps per candidate, inside
autotune.budget_seconds. The recipe's global batch is kept exact: with hardware.gpus > 1
(times the nodes of a multi-node launch) each process takes an equal share of it, and
micro-batch x accumulation x processes == the recipe's micro-batch x accumulation. A GPU plan
also records how its processes split the model (`sharding`: FSDP2's settings, or null where each
process holds all of it: one process, or DDP replicas of a LoRA run that fits one GPU). A sharded
run's probe plans for its shards (autotune.sharded_estimate); the sidecar keeps the peak memory
of a process it expects (`probe.peak_bytes`), to set beside the checkpoint stage's measured one
(`peak_gpu_memory_bytes`), as bench/scale.py does.
"""
from __future__ import annotations

import json
import math
import os
import platform
from pathlib import Path

from stages.engine.errors import RecipeError, UserError
from stages.train import autotune, settings


def device_facts(hardware) -> dict:
    """What the decisions depend on; part of the key, so new hardware means a new plan."""
    processes = hardware.gpus * settings.nodes()
    if hardware.profile == "cpu":
        return {"device": "cpu", "machine": platform.machine(), "cpus": os.cpu_count(), "processes": processes}
    import torch

    if not torch.cuda.is_available():
        raise RecipeError("hardware.profile", f"{hardware.profile} needs a GPU and none is visible; "
                                              f"use profile: cpu on this machine")
    if torch.cuda.device_count() < hardware.gpus:
        raise RecipeError("hardware.gpus", f"{hardware.gpus} asked, {torch.cuda.device_count()} visible; ask for "
                                           f"at most {torch.cuda.device_count()}")
    return {"device": "cuda", "name": torch.cuda.get_device_name(0),
            "capability": list(torch.cuda.get_device_capability(0)),
            "hip": torch.version.hip, "cuda": torch.version.cuda, "gpus": hardware.gpus, "processes": processes}


def blocked_here(recipe) -> str | None:
    """Why this machine cannot plan the recipe at all (`doit status` says it of a recipe not yet
    built): a GPU profile where no GPU is visible, or fewer than hardware.gpus. A CPU build of
    torch says so in its version, which spares importing torch."""
    from importlib.metadata import version

    hw = recipe.hardware
    if hw.profile == "cpu":
        return None
    visible = 0
    if not version("torch").endswith("+cpu"):
        import torch

        visible = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if visible == 0:
        return f"hardware.profile {hw.profile} needs a GPU, and none is visible"
    return f"hardware.gpus is {hw.gpus}, {visible} visible" if hw.gpus > visible else None


def env_block(root: Path, profile: str) -> dict[str, str]:
    """The profile's environment block from ops/hardware.yaml."""
    import yaml

    return yaml.safe_load((root / "ops" / "hardware.yaml").read_text())[profile]["env"]


def extra_inputs(recipe, root: Path, store) -> dict:
    return {"facts": device_facts(recipe.hardware), "env": env_block(root, recipe.hardware.profile)}


def share(global_batch: int, micro: int, processes: int) -> tuple[int, int]:
    """(micro-batch, accumulation) per process so that micro x accumulation x processes is
    exactly the recipe's global batch: the recipe's micro-batch, or the largest divisor of it
    that divides the process's share."""
    if global_batch % processes:
        raise UserError(f"recipe train.micro_batch_size x train.grad_accum = {global_batch} sequences per step "
                        f"cannot be split evenly over {processes} processes (hardware.gpus x nodes): "
                        f"make it a multiple of {processes}")
    per_process = global_batch // processes
    micro = math.gcd(micro, per_process)
    return micro, per_process // micro


REPLICA_SHARE = 0.5  # without a probe, a LoRA run's base of at most this share of the GPU's memory is
# replicated: the rest is left to activations under full checkpointing (Qwen3-8B LoRA, 2048 x 4 a
# micro-batch: 15.3 GiB of weights, 30.4 GiB at its peak on one GPU)


def replica_fits(recipe, probed: bool, weight_bytes: int, gpu_bytes: int) -> bool:
    """Whether each of several GPU processes may hold the whole model (DDP) rather than a shard.
    Only for a LoRA run with hardware.sharding auto (a full fine-tune's gradients and optimizer
    state are what FSDP2 is for), and only where a replica fits one GPU: with a probe, a base
    inside the probe's memory limit, and the probe then runs it whole on one GPU (build() shards
    the run if no setting fits there); without one, a base of at most REPLICA_SHARE of the GPU."""
    if recipe.hardware.sharding != "auto" or recipe.train.peft != "lora":
        return False
    return weight_bytes <= (1 - autotune.MEMORY_MARGIN if probed else REPLICA_SHARE) * gpu_bytes


def split(recipe, processes: int, base: Path, probed: bool) -> dict | None:
    """plan.json's `sharding` for a GPU run (settings.sharding)."""
    if processes == 1:
        return None
    import torch

    weights = sum(p.stat().st_size for p in Path(base).glob("*.safetensors"))
    fits = replica_fits(recipe, probed, weights, torch.cuda.get_device_properties(0).total_memory)
    return settings.sharding(processes, "cuda", fits)


def out_of_memory(measurements: list[dict]) -> bool:
    """Whether every probed setting ran out of memory (rather than a kernel failing to run)."""
    return bool(measurements) and all("OutOfMemoryError" in m.get("error", "") for m in measurements)


def nothing_ran(measurements: list[dict], processes: int, sharded: bool) -> str:
    """The plan's one line where no probed setting ran a step."""
    if out_of_memory(measurements):
        where = f"sharded over {processes} GPUs (FSDP2)" if sharded else "on one GPU"
        return (f"plan: no setting fits {where}, not even micro-batch 1 with full checkpointing: give it more "
                f"GPUs (hardware.gpus), shorter sequences (data.max_length), or train LoRA (train.peft: lora)")
    return ("plan: no attention implementation ran a training step on these shapes; "
            "see the plan log, check data.max_length and the GPU")


def probe(ctx, processes: int, batch: int, sharding: dict | None) -> tuple[dict, dict | None]:
    """The probe's result and the run's sharding: a run of replicas is probed whole on one GPU,
    and sharded instead where every setting ran out of memory there, in what is left of the one
    budget; a sharded run is probed through the memory model of its shards (autotune.sharded_estimate)."""
    import time

    deadline = time.monotonic() + ctx.recipe.autotune.budget_seconds
    shards = processes if sharding else 1
    found = autotune.probe(ctx.upstream["base"], ctx.recipe, ctx.log, batch, shards=shards, deadline=deadline)
    if found["decisions"] is None and shards == 1 and processes > 1 and out_of_memory(found["measurements"]):
        ctx.log.info("plan: no setting fits a whole replica on one GPU; probing the run sharded over %d", processes)
        sharding = settings.sharding(processes, "cuda")
        found = autotune.probe(ctx.upstream["base"], ctx.recipe, ctx.log, batch, shards=processes, deadline=deadline)
    if found["decisions"] is None:
        raise UserError(nothing_ran(found["measurements"], processes, sharding is not None))
    chosen = next(m for m in found["measurements"] if "error" not in m and found["decisions"].items() <= m.items())
    found["peak_bytes"] = chosen["peak_bytes"]  # of one process: expected, for a sharded run
    return found, sharding


def build(ctx, out: Path) -> None:
    r = ctx.recipe
    facts = device_facts(r.hardware)
    processes = facts["processes"]
    micro, accumulation = share(r.train.global_batch, r.train.micro_batch_size, processes)
    if r.train.peft == "qlora" and facts["device"] != "cuda":
        raise RecipeError("train.peft", f"qlora loads the base in 4-bit through bitsandbytes, which needs a GPU; "
                                        f"hardware.profile is {r.hardware.profile}: use peft: lora on this machine")
    if r.train.peft == "qlora" and processes > 1:
        raise RecipeError("train.peft", f"qlora trains on one GPU (its 4-bit weights are not stored for FSDP to "
                                        f"shard); hardware.gpus is {r.hardware.gpus}: use gpus: 1, or peft: lora")
    decisions = {
        "device": facts["device"],
        "dtype": "float32",
        "attn_implementation": "sdpa",
        "sdpa_backend": None,
        "rocm_fa_library": None,
        "processes": processes,
        "micro_batch_size": micro,
        "grad_accum": accumulation,
        "gradient_checkpointing": "off",
        "compile": False,
        "fused_cross_entropy": False,
        "env": env_block(ctx.root, r.hardware.profile),
    }
    if facts["device"] == "cuda":
        decisions.update(dtype="bfloat16", gradient_checkpointing="full")
        sharding = split(r, processes, ctx.upstream["base"], r.autotune.enabled)
        if r.autotune.enabled:
            found, sharding = probe(ctx, processes, micro * accumulation, sharding)
            ctx.run["probe"] = found
            decisions.update(found["decisions"])
            decisions["grad_accum"] = micro * accumulation // decisions["micro_batch_size"]
            decisions["env"] = {**decisions["env"], **settings.rocm_env(decisions["rocm_fa_library"])}
            ctx.log.info("probe chose %s at %.0f tokens/s", found["decisions"], found["tokens_per_s"])
        decisions["sharding"] = sharding
    ctx.run["facts"] = facts
    (out / "plan.json").write_text(json.dumps({"decisions": decisions, "facts": facts},
                                              indent=1, sort_keys=True) + "\n")
