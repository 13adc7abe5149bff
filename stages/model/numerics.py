"""The numeric mode a build's process computes in, one definition for training and for the stages
after it: deterministic kernels only, no cuDNN benchmarking, and the plan's environment block
(ops/hardware.yaml's profile: cuBLAS's workspace, no GEMM tuning, ...; the ROCm flash-attention
switch the probe chose). The mode holds for the whole process, so a stage after training that did
not set it would compute in whatever mode ran before it: on an H100 the quantized stage rebuilt
alone wrote other FP8 scales (training loss 3.7445 against 3.7443) under the same key as when it
followed training in one `doit` run."""
from __future__ import annotations

import json
import os
from pathlib import Path


def training_mode(env: dict[str, str] | None = None) -> None:
    """Put the process in training's mode; `env`: the plan's environment block (the probe, which
    measures one setting after another, sets its own). Set by the probe as by training, so the
    probe never picks a kernel that training would refuse."""
    import torch

    os.environ.update(env or {})  # before the process's first cuBLAS call, which reads its workspace setting
    torch.use_deterministic_algorithms(True)
    torch.backends.cudnn.benchmark = False


def as_planned(plan: Path) -> None:
    """training_mode with the environment block of the plan artifact at `plan` (its plan.json):
    how the stages after training set it."""
    training_mode(json.loads((plan / "plan.json").read_text())["decisions"]["env"])
