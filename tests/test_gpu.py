"""On a CUDA machine only (CI has none; run on the lent GPU): the plan stage's probe times
real training steps per candidate and records the winner as decisions, with the
measurements kept beside the artifact; training then runs with those decisions. With two
GPUs: FSDP2 and DDP replicas against one GPU, DPO and GRPO in two processes, and a killed
two-GPU build resumed to the uninterrupted bytes."""
from __future__ import annotations

import json
import math
import os
import shutil
import signal
import subprocess
import sys
import time

import pytest

from conftest import doit

torch = pytest.importorskip("torch")
pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def test_plan_probes_training_steps_and_training_applies_them(fresh):
    import yaml

    name = torch.cuda.get_device_name(0)
    profile = "h200" if "H200" in name else "h100"
    recipe = yaml.safe_load((fresh / "recipes" / "tiny.yaml").read_text())
    recipe["hardware"] = {"profile": profile}
    recipe["train"]["max_steps"] = 20
    (fresh / "recipes" / "gpu.yaml").write_text(yaml.safe_dump(recipe))
    run = doit(fresh, "checkpoint:gpu")
    plan_log = "".join(p.read_text() for p in (fresh / "artifacts" / "store" / "plan").glob("*.log"))
    assert run.rc == 0, plan_log + "\n".join(line for line in run.out.splitlines()
                                             if "Warning" not in line and "node.target" not in line)[-6000:]
    key = json.loads((fresh / "artifacts" / "gpu" / "plan.json").read_text())["key"]
    plan = json.loads((fresh / "artifacts" / "store" / "plan" / key / "plan.json").read_text())
    probe = json.loads((fresh / "artifacts" / "store" / "plan" / f"{key}.json").read_text())["run"]["probe"]
    d = plan["decisions"]
    print(f"{name}: probe measured {len(probe['measurements'])} settings -> {probe['decisions']}")
    for m in probe["measurements"]:
        print("  ", m)
    assert plan["facts"]["name"] == name and d["dtype"] == "bfloat16"
    measured = [m for m in probe["measurements"] if "error" not in m]
    assert len({m["attn_implementation"] + str(m["sdpa_backend"]) for m in measured}) >= 2
    assert {k: d[k] for k in probe["decisions"]} == probe["decisions"]  # the winner, verbatim
    winner = [m for m in measured if {k: m[k] for k in probe["decisions"]} == probe["decisions"]]
    assert winner and winner[0]["tokens_per_s"] == probe["tokens_per_s"]
    assert d["micro_batch_size"] * d["grad_accum"] == recipe["train"]["micro_batch_size"]
    assert "measurements" not in json.dumps(plan)  # measurements stay out of the hashed artifact
    assert d["env"]["CUBLAS_WORKSPACE_CONFIG"] == ":4096:8"
    ckpt = json.loads((fresh / "artifacts" / "gpu" / "checkpoint.json").read_text())["key"]
    log = (fresh / "artifacts" / "store" / "checkpoint" / f"{ckpt}.log").read_text()
    assert "step 20/20" in log


def test_on_a_gpu_the_eval_stage_scores_every_model(fresh):
    """The base, trained and Quark-exported models are each scored on a GPU, generation in wide
    batches (tests/test_eval_batch.py holds their answers to HFLM's on a GPU too)."""
    import yaml

    recipe = yaml.safe_load((fresh / "recipes" / "tiny.yaml").read_text())
    recipe["hardware"] = {"profile": "h200" if "H200" in torch.cuda.get_device_name(0) else "h100"}
    recipe["train"]["max_steps"] = 5
    (fresh / "recipes" / "gpu.yaml").write_text(yaml.safe_dump(recipe))
    run = doit(fresh, "eval:gpu")
    assert run.rc == 0, run.out[-6000:]
    key = json.loads((fresh / "artifacts" / "gpu" / "eval.json").read_text())["key"]
    log = (fresh / "artifacts" / "store" / "eval" / f"{key}.log").read_text()
    assert len([line for line in log.splitlines() if " scoring " in line]) == 3, log[-4000:]


def test_quantized_and_eval_rebuilt_alone_write_what_they_wrote_after_training(fresh):
    """The stages downstream of training run in training's numeric mode (stages/model/numerics.py)
    whatever ran before them in the process: rebuilt in a `doit` of their own (the checkpoint cached), quantized and eval write
    the bytes they wrote when training ran first in the same process."""
    import yaml

    recipe = yaml.safe_load((fresh / "recipes" / "tiny.yaml").read_text())
    recipe["hardware"] = {"profile": "h200" if "H200" in torch.cuda.get_device_name(0) else "h100"}
    recipe["train"]["max_steps"] = 5
    (fresh / "recipes" / "gpu.yaml").write_text(yaml.safe_dump(recipe))

    def digests():
        return {s: json.loads((fresh / "artifacts" / "gpu" / f"{s}.json").read_text())["digest"]
                for s in ("checkpoint", "quantized", "eval")}

    run = doit(fresh, "eval:gpu")
    assert run.rc == 0, run.out[-6000:]
    after_training = digests()
    for stage in ("quantized", "eval"):
        shutil.rmtree(fresh / "artifacts" / "store" / stage)
    run = doit(fresh, "eval:gpu")
    assert run.rc == 0 and run.stages_ran("gpu") == {"quantized", "eval"}, run.out[-6000:]
    assert digests() == after_training


def link_qwen3_inputs(project) -> None:
    """Qwen3's tokenizer and GSM8K train where recipes/qwen3_*.yaml look for them: from
    ../shared, or from the copies bench/gpu_pipeline.sh unpacks on the lent GPU."""
    from pathlib import Path

    repo = Path(__file__).resolve().parent.parent
    for link, sources in ((project / "models" / "qwen3-tokenizer", (repo.parent / "shared" / "tokenizers" / "qwen3",
                                                                     repo / "models" / "qwen3-tokenizer")),
                          (project / "data" / "gsm8k", (repo.parent / "shared" / "datasets" / "gsm8k",
                                                         repo / "data" / "gsm8k"))):
        found = [s for s in sources if s.is_dir()]
        if link.exists():  # copied with the project (bench/gpu_pipeline.sh unpacked it there)
            continue
        if not found:
            pytest.skip(f"no {link.name} in {' or '.join(map(str, sources))}")
        link.parent.mkdir(parents=True, exist_ok=True)
        link.symlink_to(found[0].resolve())


def test_qlora_trains_lora_over_a_4bit_base(fresh):
    """peft: qlora: the base in 4-bit NF4 through bitsandbytes, LoRA trained over it (the loss
    goes down), the adapter saved in PEFT's format, merged and evaluated downstream."""
    pytest.importorskip("bitsandbytes")
    link_qwen3_inputs(fresh)
    run = doit(fresh, "manifest:qwen3_small_qlora")
    assert run.rc == 0, "\n".join(line for line in run.out.splitlines() if "Warning" not in line)[-6000:]
    ckpt = json.loads((fresh / "artifacts" / "qwen3_small_qlora" / "checkpoint.json").read_text())["key"]
    art = fresh / "artifacts" / "store" / "checkpoint" / ckpt
    assert "base loaded in 4-bit NF4 (bitsandbytes)" in (art.parent / f"{ckpt}.log").read_text()
    config = json.loads((art / "adapter" / "adapter_config.json").read_text())
    assert config["peft_type"] == "LORA" and config["r"] == 16
    assert (art / "adapter" / "adapter_model.safetensors").is_file() and not (art / "model").exists()
    losses = [json.loads(line)["loss"] for line in (art / "metrics.jsonl").read_text().splitlines()]
    # a random-weight base: the loss starts at ln(vocab) ~ 12 and LoRA alone brings it to ~7.4 in 60 steps
    # (lent H100, 2026-11-25); a quarter down is learning, not noise
    assert len(losses) == 60 and sum(losses[-5:]) / 5 < 0.75 * sum(losses[:5]) / 5
    print(f"QLoRA loss {losses[0]:.3f} -> {losses[-1]:.3f}")
    assert doit(fresh, "verify:qwen3_small_qlora").rc == 0


two_gpus = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA GPUs")


def gpu_recipe(project, base: str, name: str, gpus: int, sharding: str = "auto", **train) -> None:
    """recipes/<name>.yaml: recipes/<base>.yaml on this GPU's profile in `gpus` processes, autotune
    off (so the plans of one and of two processes differ only in the split), train.* as given."""
    import yaml

    recipe = yaml.safe_load((project / "recipes" / f"{base}.yaml").read_text())
    profile = "h200" if "H200" in torch.cuda.get_device_name(0) else "h100"
    recipe["hardware"] = {"profile": profile, "gpus": gpus, "sharding": sharding}
    recipe["autotune"] = {"enabled": False}
    recipe["train"].update(train)
    (project / "recipes" / f"{name}.yaml").write_text(yaml.safe_dump(recipe))


def build(project, target: str) -> None:
    run = doit(project, target)
    assert run.rc == 0, "\n".join(line for line in run.out.splitlines() if "Warning" not in line)[-6000:]


def stored(project, name: str, stage: str = "checkpoint"):
    key = json.loads((project / "artifacts" / name / f"{stage}.json").read_text())["key"]
    return project / "artifacts" / "store" / stage / key


def metrics(project, name: str) -> list[dict]:
    return [json.loads(line) for line in (stored(project, name) / "metrics.jsonl").read_text().splitlines()]


def files(project, name: str) -> list[str]:
    root = stored(project, name)
    return sorted(str(p.relative_to(root)) for p in root.rglob("*"))


# bf16 (8 mantissa bits, 4e-3 relative): step 1 is the same weights on the same data, summed in
# another order; later steps add the reduced gradients' rounding, hence the wider bound
FIRST_STEP, LATER_STEPS = 1e-2, 5e-2


def dtypes(project, name: str) -> dict[str, str]:
    """Each saved tensor's dtype, as the safetensors files hold it."""
    from safetensors import safe_open

    found = {}
    for path in sorted(stored(project, name).rglob("*.safetensors")):
        with safe_open(path, "pt") as f:
            found.update({k: f.get_slice(k).get_dtype() for k in f.keys()})
    return found


def near(one: list[float], two: list[float]) -> bool:
    return abs(one[0] - two[0]) < FIRST_STEP and max(abs(x - y) for x, y in zip(one, two)) < LATER_STEPS


def one_gpu_and_two(project, base: str, name: str) -> None:
    """recipes/<base>.yaml for 6 steps as <name>1 on one GPU and <name>2 on two: the losses within
    bf16's bounds of each other, and the same files."""
    for gpus in (1, 2):
        gpu_recipe(project, base, f"{name}{gpus}", gpus, max_steps=6, save_steps=3)
        build(project, f"checkpoint:{name}{gpus}")
    one, two = ([m["loss"] for m in metrics(project, f"{name}{g}")] for g in (1, 2))
    print(f"{name} losses, 1 GPU: {one}, 2 GPUs: {two}")
    assert len(one) == len(two) == 6 and near(one, two)
    assert files(project, f"{name}1") == files(project, f"{name}2")
    assert dtypes(project, f"{name}1") == dtypes(project, f"{name}2")  # FSDP2's fp32 master weights saved in bf16


@two_gpus
def test_fsdp2_on_two_gpus_matches_one_gpu(fresh):
    """hardware.gpus: 2 on CUDA, a full fine-tune: FSDP2 through the Trainer
    (stages/train/trainer.distributed_args), each GPU half of the global batch; the loss per step
    is one GPU's on the same sequences, and rank 0 writes the same files."""
    one_gpu_and_two(fresh, "tiny", "gpus")
    assert json.loads((stored(fresh, "gpus2", "plan") / "plan.json").read_text())["decisions"]["sharding"]["version"] == 2


@two_gpus
def test_lora_on_two_gpus_replicates_the_model_or_shards_it_as_asked(fresh):
    """A LoRA run whose model fits one GPU is replicated (DDP: plan.json's sharding null, only the
    adapter's gradients cross the GPUs); hardware.sharding: fsdp2 shards it. Both match one GPU's
    losses within bf16's bounds and write the same adapter files."""
    gpu_recipe(fresh, "tiny_lora", "lora1", 1, max_steps=6, save_steps=3)
    gpu_recipe(fresh, "tiny_lora", "lora2", 2, max_steps=6, save_steps=3)
    gpu_recipe(fresh, "tiny_lora", "lora2_fsdp2", 2, "fsdp2", max_steps=6, save_steps=3)
    for name in ("lora1", "lora2", "lora2_fsdp2"):
        build(fresh, f"checkpoint:{name}")
    split = {n: json.loads((stored(fresh, n, "plan") / "plan.json").read_text())["decisions"]["sharding"]
             for n in ("lora2", "lora2_fsdp2")}
    assert split["lora2"] is None and split["lora2_fsdp2"]["version"] == 2
    one = [m["loss"] for m in metrics(fresh, "lora1")]
    for name in ("lora2", "lora2_fsdp2"):
        two = [m["loss"] for m in metrics(fresh, name)]
        print(f"losses, 1 GPU: {one}, {name}: {two}")
        assert len(two) == 6 and near(one, two), name
        assert files(fresh, name) == files(fresh, "lora1")


@two_gpus
def test_a_two_gpu_run_killed_mid_way_resumes_to_the_uninterrupted_bytes(fresh):
    """kill -9 a 2-GPU build (doit, torchrun and both processes) once its step-3 checkpoint is
    complete; the next build resumes from it and ends with the bytes the uninterrupted build wrote."""
    gpu_recipe(fresh, "tiny", "killed", 2, max_steps=9, save_steps=3)
    build(fresh, "checkpoint:killed")
    uninterrupted = json.loads((fresh / "artifacts" / "killed" / "checkpoint.json").read_text())["digest"]
    shutil.rmtree(stored(fresh, "killed"))
    (fresh / "artifacts" / "killed" / "checkpoint.json").unlink()
    work = fresh / "artifacts" / "work" / "checkpoint"
    proc = subprocess.Popen([sys.executable, "-m", "doit", "checkpoint:killed"], cwd=fresh, start_new_session=True,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.time() + 300
    while not list(work.glob("*/checkpoint-3/mindxtrain-complete")) and proc.poll() is None and time.time() < deadline:
        time.sleep(0.01)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    assert list(work.glob("*/checkpoint-3/mindxtrain-complete")) and not list(work.glob("*/checkpoint-9/*"))
    run = doit(fresh, "checkpoint:killed")
    assert run.rc == 0 and "resuming from checkpoint-3" in run.out, run.out[-3000:]
    resumed = json.loads((fresh / "artifacts" / "killed" / "checkpoint.json").read_text())["digest"]
    assert resumed == uninterrupted


@two_gpus
def test_dpo_in_two_gpu_processes_matches_one(fresh):
    """DPO in two GPU processes (FSDP2: a full fine-tune), each half of every step's pairs: its
    losses are one GPU's within bf16's bounds, and rank 0 writes what one process writes."""
    one_gpu_and_two(fresh, "tiny_dpo", "dpo")


@two_gpus
def test_grpo_in_two_gpu_processes_trains_and_writes_what_one_writes(fresh):
    """GRPO in two GPU processes (FSDP2: a full fine-tune; TRL's generate, the engine being for one
    process): each process samples its half of the prompts' completions from its own random
    stream, so its losses cannot match one process's step for step; it finishes every step with
    finite figures and writes what one process writes. It starts from tiny's SFT model, trained
    here on the GPU. With LoRA the two processes are replicas (DDP) and it trains too."""
    gpu_recipe(fresh, "tiny", "tiny", 1, max_steps=60)  # recipes/tiny_grpo.yaml reads artifacts/tiny/latest
    build(fresh, "checkpoint:tiny")
    for gpus in (1, 2):
        gpu_recipe(fresh, "tiny_grpo", f"grpo{gpus}", gpus, max_steps=4, save_steps=2)
        build(fresh, f"checkpoint:grpo{gpus}")
    rows = metrics(fresh, "grpo2")
    print("GRPO, 2 GPUs:", rows)
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    assert all(math.isfinite(r["loss"]) and 0 <= r["reward"] <= 1 for r in rows)
    assert any(r["grad_norm"] > 0 for r in rows)  # some step moved the weights (a reward to learn from)
    assert files(fresh, "grpo1") == files(fresh, "grpo2")
    gpu_recipe(fresh, "tiny_grpo", "grpo2_lora", 2, max_steps=4, save_steps=2, peft="lora", lr=0.002)
    build(fresh, "checkpoint:grpo2_lora")  # LoRA: each process a whole replica (DDP), TRL's generate on it
    assert json.loads((stored(fresh, "grpo2_lora", "plan") / "plan.json").read_text())["decisions"]["sharding"] is None
    rows = metrics(fresh, "grpo2_lora")
    print("GRPO LoRA, 2 GPUs:", rows)
    assert [r["step"] for r in rows] == [1, 2, 3, 4] and all(math.isfinite(r["loss"]) for r in rows)
    assert (stored(fresh, "grpo2_lora") / "adapter" / "adapter_model.safetensors").is_file()


@two_gpus
def test_a_sharded_run_is_planned_for_its_shards_and_stays_inside_what_it_expected(fresh):
    """A full fine-tune over two GPUs with autotune on (a 0.8B Qwen3 shape, so the memory is
    weights, gradients and optimizer state): the plan shards it, its probe times slices of the model
    (autotune.sharded_estimate), and training's measured peak per GPU is within what the plan
    expected: at most 10% above it (what the probe picked fits), and at least 60% of it."""
    import yaml

    recipe = yaml.safe_load((fresh / "recipes" / "tiny.yaml").read_text())
    recipe["model"]["config"].update(hidden_size=2048, intermediate_size=6144, num_hidden_layers=16,
                                     num_attention_heads=16, num_key_value_heads=8, head_dim=128, dtype="bfloat16")
    recipe["hardware"] = {"profile": "h200" if "H200" in torch.cuda.get_device_name(0) else "h100", "gpus": 2}
    recipe["autotune"] = {"enabled": True, "budget_seconds": 120}
    recipe["train"].update(max_steps=6, save_steps=100)
    (fresh / "recipes" / "sharded.yaml").write_text(yaml.safe_dump(recipe))
    build(fresh, "checkpoint:sharded")
    decisions = json.loads((stored(fresh, "sharded", "plan") / "plan.json").read_text())["decisions"]
    plan_key = stored(fresh, "sharded", "plan").name
    probe = json.loads((fresh / "artifacts" / "store" / "plan" / f"{plan_key}.json").read_text())["run"]["probe"]
    run = json.loads((fresh / "artifacts" / "store" / "checkpoint" / f"{stored(fresh, 'sharded').name}.json")
                     .read_text())["run"]
    measured, expected = run["peak_gpu_memory_bytes"], probe["peak_bytes"]
    print(f"sharded probe chose {probe['decisions']}; peak per GPU expected {expected / 2**30:.2f} GiB, "
          f"measured {measured / 2**30:.2f} GiB ({measured / expected:.0%})")
    for m in probe["measurements"]:
        print("  ", m)
    assert decisions["processes"] == 2 and decisions["sharding"]["version"] == 2
    assert all("slices" in m for m in probe["measurements"] if "error" not in m)
    assert 0.6 * expected <= measured <= 1.1 * expected
