"""On a CUDA machine only (CI has none; run on the lent GPU): the plan stage times the SDPA
backends on the run's real attention shapes and records the winner as a decision, with the
timings kept beside the artifact."""
from __future__ import annotations

import json

import pytest

from conftest import doit

torch = pytest.importorskip("torch")
pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def test_plan_times_sdpa_backends_on_the_gpu(fresh):
    import yaml

    name = torch.cuda.get_device_name(0)
    profile = "h200" if "H200" in name else "h100"
    recipe = yaml.safe_load((fresh / "recipes" / "tiny.yaml").read_text())
    recipe["hardware"] = {"profile": profile}
    (fresh / "recipes" / "gpu.yaml").write_text(yaml.safe_dump(recipe))
    run = doit(fresh, "plan:gpu")
    assert run.rc == 0, run.out[-3000:]
    key = json.loads((fresh / "artifacts" / "gpu" / "plan.json").read_text())["key"]
    plan = json.loads((fresh / "artifacts" / "store" / "plan" / key / "plan.json").read_text())
    timings = json.loads((fresh / "artifacts" / "store" / "plan" / f"{key}.json").read_text())["run"]["sdpa_ms"]
    print(f"{name}: SDPA forward+backward ms {timings} -> {plan['decisions']['sdpa_backend']}")
    assert plan["facts"]["name"] == name and plan["decisions"]["dtype"] == "bfloat16"
    assert len(timings) >= 2 and plan["decisions"]["sdpa_backend"] == min(timings, key=timings.get)
    assert "sdpa_ms" not in json.dumps(plan)  # timings stay out of the hashed artifact
    assert plan["decisions"]["env"]["CUBLAS_WORKSPACE_CONFIG"] == ":4096:8"
