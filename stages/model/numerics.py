"""The numeric mode a build's process computes in, one definition for training and for the stages
after it: deterministic kernels only, no cuDNN benchmarking, and the plan's environment block
(ops/hardware.yaml's profile: cuBLAS's workspace, no GEMM tuning, ...; the ROCm flash-attention
switch the probe chose). The mode holds for the whole process, so a stage after training that did
not set it would compute in whatever mode ran before it: on an H100 the quantized stage rebuilt
alone wrote other FP8 scales (training loss 3.7445 against 3.7443) under the same key as when it
followed training in one `doit` run.

A plan may come from a remote cache, so its environment block is checked before it is applied:
only the names a hardware profile sets, as short strings. Anything else (LD_PRELOAD, PYTHONPATH,
TORCH_EXTENSIONS_DIR, where Quark's kernels are built and loaded from) would run code of the
remote's choosing in this process or its children."""
from __future__ import annotations

import os
from pathlib import Path

from stages.engine import jsontext
from stages.engine.errors import UserError

PROFILES = Path(__file__).resolve().parents[2] / "ops" / "hardware.yaml"
ROCM_FA_SWITCH = "TORCH_ROCM_FA_PREFER_CK"  # the probe's choice of ROCm flash-attention library
VALUE_CAP = 256  # characters of one setting's value
# Bytes of a plan.json: its decisions and facts take one or two KB, so a larger one is not a plan
# (its nesting is bounded apart, by jsontext).
PLAN_CAP = 16 << 10


def settable() -> set[str]:
    """The environment names a plan may set: those ops/hardware.yaml's profiles set, and ROCm's switch."""
    import yaml

    return {name for profile in yaml.safe_load(PROFILES.read_text()).values() for name in profile.get("env") or {}} | {
        ROCM_FA_SWITCH}


def training_mode(env: dict[str, str] | None = None, source: str = "plan.json") -> None:
    """Put the process in training's mode; `env`: the plan's environment block, from `source` (the
    probe, which measures one setting after another, sets its own). Set by the probe as by
    training, so the probe never picks a kernel that training would refuse."""
    import torch

    env = {} if env is None else env
    if not isinstance(env, dict):
        raise UserError(f"{source}: decisions.env is not a mapping of names to values; build the plan again here")
    names = settable() if env else set()
    for name, value in env.items():
        if name not in names or not isinstance(value, str) or len(value) > VALUE_CAP:
            raise UserError(f"{source}: decisions.env sets {name[:64]!r}, which is not a setting of a profile in "
                            f"ops/hardware.yaml (or not a string of at most {VALUE_CAP} characters); build the plan "
                            f"again here rather than take it from a remote")
    os.environ.update(env)  # before the process's first cuBLAS call, which reads its workspace setting
    torch.use_deterministic_algorithms(True)
    torch.backends.cudnn.benchmark = False


def as_planned(plan: Path) -> None:
    """training_mode with the environment block of the plan artifact at `plan` (its plan.json):
    how the stages after training set it."""
    path = plan / "plan.json"
    try:
        env = jsontext.read(path, size_cap=PLAN_CAP)["decisions"]["env"]
    except jsontext.TooLarge:
        raise UserError(f"{path}: larger than {PLAN_CAP} bytes, which no plan is; build the plan again here") from None
    except (ValueError, KeyError, TypeError):
        raise UserError(f"{path}: not a plan (no decisions.env); build the plan again here") from None
    training_mode(env, str(path))
