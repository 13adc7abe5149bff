"""hardware.gpus: 2 on CPU: the checkpoint stage trains in two processes (torchrun, gloo; DDP,
since accelerate runs FSDP on accelerator devices only: stages/train/trainer.distributed_args),
each taking half of the global batch, and writes the artifact a single process writes; killed,
it resumes from its last saved step as one process does; two 'nodes' on one host (NNODES=2 and a
loopback rendezvous) build what two processes on one node build."""
from __future__ import annotations

import json
import math
import os
import re
import shutil
import signal
import subprocess
import sys
import time

import pytest
from safetensors import safe_open

from conftest import NO_NETWORK, REPO, copy_built, doit, free_port
from test_pipeline import artifact

STEPS = 6


def recipe(gpus: int, base: str = "tiny") -> str:
    """`base` for a few steps, saved every 3, in `gpus` processes (profile cpu: one process per 'gpu')."""
    text = (REPO / "recipes" / f"{base}.yaml").read_text()
    text = text.replace("  max_steps: 150\n", f"  max_steps: {STEPS}\n").replace("  save_steps: 20\n", "  save_steps: 3\n")
    return text.replace("  profile: cpu\n", f"  profile: cpu\n  gpus: {gpus}\n")


@pytest.fixture(scope="module")
def trained(built, tmp_path_factory):
    """A project with tiny and tiny_lora trained in 1 and in 2 processes (tiny_gpus1, tiny_gpus2,
    tiny_lora_gpus1, tiny_lora_gpus2: same model, data, seed and global batch). A copy of the
    session's built project: tiny's base and shards are theirs, and tiny's checkpoint GRPO's."""
    project = copy_built(built, tmp_path_factory.mktemp("distributed"))
    runs = {}
    for base in ("tiny", "tiny_lora"):
        for gpus in (1, 2):
            name = f"{base}_gpus{gpus}"
            (project / "recipes" / f"{name}.yaml").write_text(recipe(gpus, base))
            runs[name] = doit(project, f"checkpoint:{name}")
            assert runs[name].rc == 0, runs[name].out[-3000:]
    return project, runs


def losses(project, name: str) -> list[float]:
    lines = (artifact(project, "checkpoint", name) / "metrics.jsonl").read_text().splitlines()
    return [json.loads(line)["loss"] for line in lines]


def tensors(project, name: str) -> dict:
    """Every file of the checkpoint, and for the weights each tensor's dtype and shape."""
    root = artifact(project, "checkpoint", name)
    found = {}
    for p in sorted(root.rglob("*")):
        if p.suffix == ".safetensors":
            with safe_open(p, "pt") as f:
                found[str(p.relative_to(root))] = {k: (f.get_slice(k).get_dtype(), f.get_slice(k).get_shape())
                                                   for k in f.keys()}
        elif p.is_file():
            found[str(p.relative_to(root))] = None
    return found


@pytest.mark.parametrize("base", ["tiny", "tiny_lora"])
def test_two_processes_match_one_on_the_same_global_batch(trained, base):
    project, runs = trained
    assert "training in 2 processes" in runs[f"{base}_gpus2"].out
    assert "rank 1:" not in runs[f"{base}_gpus2"].out  # one writer, one voice
    plans = [json.loads((artifact(project, "plan", f"{base}_gpus{g}") / "plan.json").read_text())["decisions"]
             for g in (1, 2)]
    assert [(p["processes"], p["micro_batch_size"], p["grad_accum"]) for p in plans] == [(1, 8, 1), (2, 4, 1)]
    one, two = losses(project, f"{base}_gpus1"), losses(project, f"{base}_gpus2")
    assert len(one) == len(two) == STEPS
    # the same 8 sequences per step, summed in another order (two halves, then gloo's all-reduce):
    # fp32 rounding, measured 5e-7 over these steps; from one step to the next the loss moves by 1e-2 and more
    assert max(abs(x - y) for x, y in zip(one, two)) < 1e-4, (one, two)
    assert tensors(project, f"{base}_gpus1") == tensors(project, f"{base}_gpus2")  # model/ or adapter/, as one writes
    configs = [(artifact(project, "checkpoint", f"{base}_gpus{g}") / "model" / "config.json") for g in (1, 2)]
    configs += [(artifact(project, "checkpoint", f"{base}_gpus{g}") / "adapter" / "adapter_config.json") for g in (1, 2)]
    texts = [c.read_text() for c in configs if c.exists()]
    assert len(texts) == 2 and texts[0] == texts[1]


def checkpoint_digest(project, name: str = "tiny_gpus2") -> str:
    """The digest the recipe's checkpoint pointer names: what two builds compare byte for byte."""
    return json.loads((project / "artifacts" / name / "checkpoint.json").read_text())["digest"]


def unbuilt_checkpoint(built, project):
    """A copy of the built project without tiny_gpus2's checkpoint, and the checkpoint stage's work dir."""
    shutil.copytree(built, project, symlinks=True)
    shutil.rmtree(artifact(project, "checkpoint", "tiny_gpus2"))
    (project / "artifacts" / "tiny_gpus2" / "checkpoint.json").unlink()
    return project, project / "artifacts" / "work" / "checkpoint"


def test_killed_distributed_training_resumes_from_its_last_saved_step(trained, tmp_path):
    built, _ = trained
    project, work = unbuilt_checkpoint(built, tmp_path / "proj")
    build = subprocess.Popen([sys.executable, "-m", "doit", "checkpoint:tiny_gpus2"], cwd=project, start_new_session=True,
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env={**os.environ, **NO_NETWORK})
    deadline = time.time() + 300
    while not list(work.glob("*/checkpoint-3/mindxtrain-complete")) and build.poll() is None and time.time() < deadline:
        time.sleep(0.01)
    os.killpg(build.pid, signal.SIGKILL)  # doit, torchrun and both processes
    build.wait()
    assert list(work.glob("*/checkpoint-3/mindxtrain-complete")) and not list(work.glob(f"*/checkpoint-{STEPS}/*"))

    run = doit(project, "checkpoint:tiny_gpus2")
    assert run.rc == 0, run.out[-3000:]
    assert "resuming from checkpoint-3" in run.out
    key = json.loads((project / "artifacts" / "tiny_gpus2" / "checkpoint.json").read_text())["key"]
    assert json.loads((project / "artifacts" / "store" / "checkpoint" / f"{key}.json").read_text())["run"]["resumed_from_step"] == 3
    assert checkpoint_digest(project) == checkpoint_digest(built)  # resumed == uninterrupted, byte for byte


USR1_TWICE = """
import faulthandler, os, signal, threading, time
from stages.train.distributed import stacks_on_usr1
stacks_on_usr1()
threading.Thread(target=time.sleep, args=(5,), daemon=True).start()  # a thread started later, as gloo's are
os.kill(os.getpid(), signal.SIGUSR1)
time.sleep(0.5)
faulthandler.unregister(signal.SIGUSR1)  # what the interpreter does as it exits
os.kill(os.getpid(), signal.SIGUSR1)
time.sleep(0.5)
print("went on")
"""


def test_sigusr1_is_taken_by_one_waiting_thread_and_ignored_once_faulthandler_lets_go():
    """The signal lands in the thread that only waits for it, never in the main thread or one
    started later (where it could cut short a system call), and one that comes after faulthandler
    has given it back (the interpreter exiting) does not end the process."""
    done = subprocess.run([sys.executable, "-c", USR1_TWICE], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0 and done.stdout == "went on\n", (done.returncode, done.stderr[-3000:])
    threads = done.stderr.split("\n\n")
    current = [t for t in threads if t.startswith("Current thread")]
    assert len(current) == 1 and " in take" in current[0], done.stderr[-3000:]
    assert any("<module>" in t for t in threads if t.startswith("Thread")), done.stderr[-3000:]  # the main thread, listed


def test_sigusr1_prints_each_training_process_stacks_and_training_goes_on(trained, tmp_path):
    """`kill -USR1` of a training process mid-run (what to do when one seems stuck): every
    thread's stack goes to the stage log, and the build ends with the bytes of one never
    signalled."""
    import psutil

    built, _ = trained
    project, work = unbuilt_checkpoint(built, tmp_path / "proj")
    with open(tmp_path / "out.txt", "w") as out:
        build = subprocess.Popen([sys.executable, "-m", "doit", "checkpoint:tiny_gpus2"], cwd=project, stdout=out,
                                 stderr=subprocess.STDOUT, env={**os.environ, **NO_NETWORK})
        deadline = time.time() + 300
        while not list(work.glob("*/checkpoint-3/mindxtrain-complete")) and build.poll() is None and time.time() < deadline:
            time.sleep(0.01)
        signalled = 0
        for child in psutil.Process(build.pid).children(recursive=True):
            try:
                if "stages.train.distributed" in child.cmdline() and "torch.distributed.run" not in child.cmdline():
                    child.send_signal(signal.SIGUSR1)
                    signalled += 1
            except psutil.NoSuchProcess:
                pass
        failed = project / "artifacts" / "store" / "checkpoint"
        assert build.wait(300) == 0, ((tmp_path / "out.txt").read_text()[-3000:],
                                      [f.read_text()[-3000:] for f in failed.glob("*.failed.log")])
    assert signalled == 2
    key = json.loads((project / "artifacts" / "tiny_gpus2" / "checkpoint.json").read_text())["key"]
    log = (project / "artifacts" / "store" / "checkpoint" / f"{key}.log").read_text()
    assert log.count("most recent call first") >= 2 and "stages/train/" in log, log[-3000:]
    assert checkpoint_digest(project) == checkpoint_digest(built)


def test_a_global_batch_that_does_not_split_over_the_processes_stops_the_plan(trained):
    project, _ = trained
    (project / "recipes" / "tiny_gpus3.yaml").write_text(recipe(3))
    run = doit(project, "plan:tiny_gpus3")
    assert run.rc != 0
    assert "train.micro_batch_size x train.grad_accum = 8 sequences per step cannot be split evenly over 3 processes" in run.out


def test_two_nodes_on_one_host_train_as_two_processes_do(trained, tmp_path):
    """NNODES=2 and a rendezvous in the environment, each 'node' a copy of the project with
    gpus: 1 (so 2 processes in all): node 0 builds the artifact tiny_gpus2 built, byte for byte;
    node 1 trains its rank and says where the artifact is."""
    built, _ = trained
    nodes, port = [], free_port()  # both nodes' rendezvous; a port nothing else holds
    for rank in (0, 1):
        project = tmp_path / f"node{rank}"
        shutil.copytree(built, project, symlinks=True)
        shutil.rmtree(project / "artifacts" / "store" / "checkpoint")
        (project / "recipes" / "tiny_node.yaml").write_text(recipe(1))
        env = {**os.environ, **NO_NETWORK, "NNODES": "2", "NODE_RANK": str(rank), "MASTER_ADDR": "127.0.0.1",
               "MASTER_PORT": str(port)}
        nodes.append(subprocess.Popen([sys.executable, "-m", "doit", "checkpoint:tiny_node"], cwd=project, env=env,
                                      stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    out = [n.communicate(timeout=300)[0] for n in nodes]
    assert nodes[0].returncode == 0, out[0][-3000:]
    assert nodes[1].returncode != 0 and "the artifact is written on node 0" in out[1], out[1][-3000:]
    assert checkpoint_digest(tmp_path / "node0", "tiny_node") == checkpoint_digest(built)


def test_two_processes_train_where_the_host_name_points_elsewhere(trained, tmp_path):
    """A host whose own name resolves to an address it does not have (a sandbox, a stale
    /etc/hosts): one node's processes meet on the loopback address, so the build neither waits on
    that name nor fails on it, and writes the bytes tiny_gpus2 wrote. Run in its own mount and UTS
    namespaces, where the test sets the name and /etc/hosts."""
    if shutil.which("unshare") is None or subprocess.run(["unshare", "-m", "-u", "true"], capture_output=True).returncode:
        pytest.skip("needs unshare's mount and UTS namespaces (root)")
    built, _ = trained
    project, _ = unbuilt_checkpoint(built, tmp_path / "proj")
    hosts = tmp_path / "hosts"
    hosts.write_text("127.0.0.1 localhost\n192.0.2.99 elsewhere\n")  # TEST-NET-1: not this host's address
    script = f"mount --bind {hosts} /etc/hosts && hostname elsewhere && exec {sys.executable} -m doit checkpoint:tiny_gpus2"
    build = subprocess.Popen(["unshare", "-m", "-u", "sh", "-c", script], cwd=project, start_new_session=True, text=True,
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env={**os.environ, **NO_NETWORK})
    try:
        out = build.communicate(timeout=240)[0]
    except subprocess.TimeoutExpired:
        os.killpg(build.pid, signal.SIGKILL)  # doit, torchrun and the processes waiting on the name
        pytest.fail("training waited on the host's name for 4 minutes")
    assert build.returncode == 0, out[-3000:]
    assert checkpoint_digest(project) == checkpoint_digest(built)


def test_a_failed_training_process_is_named_by_its_first_error(trained, tmp_path):
    """Processes that raise: the stage's one line carries the first exception they printed (here
    the base folder is gone), not only torchrun's exit code and its ChildFailedError."""
    import logging

    import yaml

    from stages.engine.recipe import Recipe
    from stages.train.distributed import launch

    built, _ = trained
    train = Recipe.model_validate(yaml.safe_load((built / "recipes" / "tiny_gpus2.yaml").read_text())).train
    spec = {"method": train.method, "train": train.model_dump(mode="json"), "resume": None,
            "plan": json.loads((artifact(built, "plan", "tiny_gpus2") / "plan.json").read_text())["decisions"],
            "base": str(tmp_path / "gone"), "shards": str(artifact(built, "shards", "tiny_gpus2")),
            "work": str(tmp_path / "work"), "out": str(tmp_path / "out")}
    with pytest.raises(RuntimeError) as failure:
        launch(spec, 2, tmp_path / "work", logging.getLogger("test"), {})
    line = str(failure.value)
    assert "training in 2 process(es) failed (exit 1), first error: " in line and str(tmp_path / "gone") in line, line
    assert "ChildFailedError" not in line and "\n" not in line


def test_one_process_on_a_node_of_several_gpus_runs_as_a_child_that_sees_one():
    """hardware.gpus: 1 on a bigger node: run in doit's process, the Trainer would wrap the model in
    nn.DataParallel over every visible GPU (TRL's trainers stop with an error, found on the lent
    two-GPU H100 machine), so the checkpoint stage launches one child process instead."""
    from stages.train.distributed import one_of_several_gpus

    one, two = {"processes": 1, "device": "cuda"}, {"processes": 2, "device": "cuda"}
    assert one_of_several_gpus(one, 2) and one_of_several_gpus(one, 8)
    assert not one_of_several_gpus(one, 1) and not one_of_several_gpus(one, 0)
    assert not one_of_several_gpus(two, 8)  # torchrun gives each process its own GPU
    assert not one_of_several_gpus({"processes": 1, "device": "cpu"}, 0)


def test_a_single_child_process_writes_what_training_in_process_writes(trained, tmp_path):
    """launch() with one process (no torchrun: no RANK or LOCAL_RANK) trains as the stage does in
    its own process: same losses, the same files, the same weights byte for byte."""
    import logging

    from stages.engine.recipe import load
    from stages.train import distributed

    project, _ = trained
    name = "tiny_gpus1"
    plan = json.loads((artifact(project, "plan", name) / "plan.json").read_text())["decisions"]
    out, work = tmp_path / "out", tmp_path / "work"
    out.mkdir()
    spec = {"method": "sft", "plan": plan, "resume": None,
            "train": load(project / "recipes" / f"{name}.yaml").train.model_dump(mode="json"),
            "base": str(artifact(project, "base", name)), "shards": str(artifact(project, "shards", name)),
            "work": str(work), "out": str(out)}
    run = {}
    distributed.launch(spec, 1, work, logging.getLogger("test"), run)
    assert run  # the child's run-time figures came back
    child = [json.loads(line)["loss"] for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert child == losses(project, name)
    in_process = artifact(project, "checkpoint", name)
    files = sorted(str(p.relative_to(in_process)) for p in in_process.rglob("*") if p.is_file())
    assert sorted(str(p.relative_to(out)) for p in out.rglob("*") if p.is_file()) == files
    assert all((out / f).read_bytes() == (in_process / f).read_bytes() for f in files if f.endswith(".safetensors"))


def method_recipe(base: str, gpus: int, steps: int) -> str:
    """recipes/<base>.yaml for `steps` steps, saved every 3, in `gpus` processes."""
    text = (REPO / "recipes" / f"{base}.yaml").read_text()
    text = re.sub(r"  max_steps: \d+\n", f"  max_steps: {steps}\n", text)
    text = re.sub(r"  save_steps: \d+\n", "  save_steps: 3\n", text)
    return text.replace("  profile: cpu\n", f"  profile: cpu\n  gpus: {gpus}\n")


@pytest.fixture(scope="module")
def methods(trained):
    """DPO (6 steps) and GRPO (4 steps, from tiny's SFT model) trained in 1 and in 2 processes."""
    project, _ = trained
    run = doit(project, "checkpoint:tiny")  # GRPO's starting model, in the store since `built`
    assert run.rc == 0 and run.ran == [], run.out[-3000:]
    for base, steps in (("tiny_dpo", 6), ("tiny_grpo", 4)):
        for gpus in (1, 2):
            name = f"{base}_gpus{gpus}"
            (project / "recipes" / f"{name}.yaml").write_text(method_recipe(base, gpus, steps))
            run = doit(project, f"checkpoint:{name}")
            assert run.rc == 0, run.out[-3000:]
            assert gpus == 1 or "training in 2 processes" in run.out
    return project


def test_dpo_in_two_processes_matches_one(methods):
    """Each process takes half of each step's pairs; the losses and reward margins are one
    process's up to fp32 summation order (measured 1e-6 on CPU)."""
    def metrics(name):
        return [json.loads(line) for line in (artifact(methods, "checkpoint", name) / "metrics.jsonl").read_text().splitlines()]

    one, two = metrics("tiny_dpo_gpus1"), metrics("tiny_dpo_gpus2")
    assert len(one) == len(two) == 6
    assert one[-1]["loss"] < one[0]["loss"] - 0.1  # it learns, so matching means something
    for key in ("loss", "rewards/margins"):
        assert max(abs(a[key] - b[key]) for a, b in zip(one, two)) < 1e-4, key
    assert tensors(methods, "tiny_dpo_gpus1") == tensors(methods, "tiny_dpo_gpus2")


def test_grpo_in_two_processes_trains_and_writes_what_one_writes(methods):
    """Each process samples the completions of its half of the prompts from its own random
    stream, so the two runs draw different completions and their losses cannot match step for
    step (as DPO's do); both finish every step with finite figures and write the same tensors."""
    rows = [json.loads(line) for line in
            (artifact(methods, "checkpoint", "tiny_grpo_gpus2") / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    assert all(math.isfinite(r["loss"]) and 0 <= r["reward"] <= 1 for r in rows)
    assert tensors(methods, "tiny_grpo_gpus1") == tensors(methods, "tiny_grpo_gpus2")


def test_the_plan_of_several_gpu_processes_names_its_sharding():
    """plan.json's `sharding` is what the Trainer is given: FSDP2 for several GPU processes,
    nothing (DDP over gloo) on the CPU or for one process, and nothing (DDP replicas) for a LoRA
    run whose replica fits one GPU: probed there, or a base of at most half its memory without a
    probe. A full fine-tune, or hardware.sharding: fsdp2, is always sharded."""
    import yaml

    from stages.engine.recipe import Recipe
    from stages.plan import replica_fits
    from stages.train.settings import sharding
    from stages.train.trainer import distributed_args

    fsdp = distributed_args({"sharding": sharding(4, "cuda")})
    assert fsdp["fsdp"] is True and fsdp["fsdp_config"]["version"] == 2
    assert distributed_args({"sharding": sharding(1, "cuda")}) == distributed_args({"sharding": sharding(2, "cpu")}) == {}
    assert sharding(4, "cuda", replica_fits=True) is None

    def recipe(peft: str, split: str = "auto"):
        raw = yaml.safe_load((REPO / "recipes" / "tiny_lora.yaml").read_text())
        raw["train"]["peft"] = peft
        raw["hardware"] = {"profile": "h100", "gpus": 4, "sharding": split}
        return Recipe.model_validate(raw)

    gib = 2**30
    assert replica_fits(recipe("lora"), False, 16 * gib, 80 * gib)  # Qwen3-8B's weights on an H100
    assert not replica_fits(recipe("lora"), False, 61 * gib, 80 * gib)  # Qwen3-32B's
    assert replica_fits(recipe("lora"), True, 61 * gib, 141 * gib)  # the probe runs it whole on one GPU
    assert replica_fits(recipe("lora"), True, 61 * gib, 80 * gib)  # inside the probe's memory limit: it tries
    assert not replica_fits(recipe("lora"), True, 75 * gib, 80 * gib)  # past it: sharded, planned as such
    assert not replica_fits(recipe("none"), True, 1 * gib, 80 * gib)  # a full fine-tune shards its optimizer state
    assert not replica_fits(recipe("lora", "fsdp2"), True, 1 * gib, 80 * gib)


def test_the_plan_splits_by_the_base_weights_and_the_gpu_memory_without_a_probe(tmp_path, monkeypatch):
    """plan.split reads the base's weight files and the first GPU's memory: an 8B's 16 GB of
    safetensors on an 80 GB card is replicated, on a 24 GB card sharded; one process is never split."""
    from types import SimpleNamespace

    import torch
    import yaml

    from stages.engine.recipe import Recipe
    from stages.plan import split

    raw = yaml.safe_load((REPO / "recipes" / "tiny_lora.yaml").read_text())
    raw["hardware"] = {"profile": "h100", "gpus": 2}
    recipe = Recipe.model_validate(raw)
    with open(tmp_path / "model-00001-of-00002.safetensors", "wb") as f:
        f.truncate(8 * 10**9)  # sparse: sizes are what split reads
    with open(tmp_path / "model-00002-of-00002.safetensors", "wb") as f:
        f.truncate(8 * 10**9)
    for gib, replicated in ((80, True), (24, False)):
        monkeypatch.setattr(torch.cuda, "get_device_properties", lambda _: SimpleNamespace(total_memory=gib * 2**30))
        assert (split(recipe, 2, tmp_path, probed=False) is None) == replicated, gib
    assert split(recipe, 1, tmp_path, probed=False) is None


def test_replicas_that_ran_out_of_memory_are_told_to_shard():
    """A replicated GPU run (plan.json's sharding null, several processes) that ran out of memory
    is told to set hardware.sharding: fsdp2; a sharded, single-process or CPU run, or another
    failure, gets the plain line."""
    from stages.train.distributed import failed

    replicas = {"device": "cuda", "sharding": None}
    assert "hardware.sharding: fsdp2" in failed(2, 1, replicas, out_of_memory=True)
    assert "hardware.sharding" not in failed(2, 1, replicas, out_of_memory=False)
    assert "hardware.sharding" not in failed(1, 1, replicas, out_of_memory=True)
    assert "hardware.sharding" not in failed(2, 1, {"device": "cuda", "sharding": {"version": 2}}, out_of_memory=True)
    assert "hardware.sharding" not in failed(2, 1, {"device": "cpu", "sharding": None}, out_of_memory=True)


def test_the_first_exception_a_process_printed_is_found_in_its_line():
    """raised(): a traceback's last line, bare or with torchrun's rank prefix, dotted or not, cut
    at 300 characters; torchrun's ChildFailedError and ordinary lines are not exceptions."""
    from stages.train.distributed import raised

    assert raised("KeyError: 'env'\n") == "KeyError: 'env'"
    assert raised("[rank1]: torch.OutOfMemoryError: CUDA out of memory.") == "torch.OutOfMemoryError: CUDA out of memory."
    assert raised("KeyboardInterrupt") == "KeyboardInterrupt"
    assert raised("torch.distributed.elastic.multiprocessing.errors.ChildFailedError: ") is None
    assert raised("  File \"x.py\", line 3, in main") is None
    assert raised("rank 0: loss 2.31 at step 4") is None
    assert raised("ValueError: " + "x" * 10**6) == ("ValueError: " + "x" * 300)[:300]  # one line, however long its cause


def test_no_setting_that_fits_is_told_in_one_line_naming_where():
    """Where every probed setting ran out of memory, the plan's line says whether that was on one
    GPU or sharded over the run's processes, and what to change; anything else gets the general line."""
    from stages.plan import nothing_ran

    oom = [{"error": "OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB"}] * 3
    told = nothing_ran(oom, 4, sharded=True)
    assert "sharded over 4 GPUs" in told and "hardware.gpus" in told and "data.max_length" in told
    assert "on one GPU" in nothing_ran(oom, 1, sharded=False)
    assert "no attention implementation" in nothing_ran(oom + [{"error": "RuntimeError: no kernel"}], 4, True)


def test_replicas_that_fit_no_gpu_are_probed_sharded(tmp_path, monkeypatch):
    """plan.probe: a run of replicas is probed whole on one GPU; where every setting ran out of
    memory there, the run is sharded (FSDP2) and probed again through the memory model of its
    shards (not where a kernel failed); a run the plan shards from the start is probed that way at once. Here autotune.probe's GPU steps are stood in
    for by a table: a whole replica never fits, a shard at micro-batch 1 does."""
    from types import SimpleNamespace

    from stages import plan
    from stages.engine.errors import UserError
    from stages.train import autotune

    asked, oom = [], {"error": "OutOfMemoryError: CUDA out of memory"}
    whole = [oom]  # what the whole replica's settings did

    def probe(base, recipe, log, batch, shards=1, deadline=None):
        asked.append(shards)
        assert deadline is not None  # both probes share the recipe's one budget
        if shards == 1:
            return {"decisions": None, "measurements": whole}
        setting = {"micro_batch_size": 1, "compile": True}
        return {"decisions": setting, "tokens_per_s": 900.0,
                "measurements": [oom, {**setting, "tokens_per_s": 900.0, "peak_bytes": 70 * 2**30}]}

    monkeypatch.setattr(autotune, "probe", probe)
    ctx = SimpleNamespace(upstream={"base": tmp_path}, recipe=SimpleNamespace(autotune=SimpleNamespace(budget_seconds=60)),
                          log=SimpleNamespace(info=lambda *a: None))
    found, sharding = plan.probe(ctx, 4, 4, None)
    assert asked == [1, 4] and sharding["version"] == 2 and found["peak_bytes"] == 70 * 2**30
    asked.clear()
    found, sharding = plan.probe(ctx, 4, 4, {"version": 2})
    assert asked == [4] and sharding == {"version": 2}
    with pytest.raises(UserError, match="on one GPU"):
        plan.probe(ctx, 1, 4, None)
    asked.clear()
    whole[:] = [{"error": "RuntimeError: No available kernel"}]  # not memory: sharding would not help
    with pytest.raises(UserError, match="no attention implementation"):
        plan.probe(ctx, 4, 4, None)
    assert asked == [1]


@pytest.fixture
def fsdp_on_cpu(monkeypatch):
    """One gloo process, enough for torch's fully_shard on the CPU (accelerate turns FSDP on for
    accelerators only, so trainer.gathered_state is reached here through a stand-in Trainer): the
    fixture shards a model per decoder layer and whole, as accelerate does, and gives the stand-in."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(free_port()))
    dist.init_process_group("gloo", rank=0, world_size=1)

    def sharded_trainer(model, layers):
        mesh = init_device_mesh("cpu", (1,))
        for layer in layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)

        class Trainer:
            is_fsdp_enabled = True

        Trainer.model = model
        return Trainer()

    yield sharded_trainer
    dist.destroy_process_group()


def small_qwen3(**config):
    import torch
    from transformers import AutoModelForCausalLM, Qwen3Config

    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(Qwen3Config(
        vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=1, head_dim=16, **config), dtype=torch.float32)


def test_an_adapter_under_fsdp_gathers_its_trainable_tensors_whole(tmp_path, fsdp_on_cpu):
    """trainer.gathered_state on a LoRA model sharded by torch's fully_shard: each trainable tensor
    whole (a DTensor's full_tensor), under the names the unsharded model gives it, so PEFT saves
    the adapter the unsharded model saves, byte for byte."""
    import torch
    from peft import LoraConfig, get_peft_model
    from torch.distributed.tensor import DTensor

    from stages.train.trainer import gathered_state

    def lora_model():
        model = get_peft_model(small_qwen3(), LoraConfig(r=4, target_modules="all-linear"))
        with torch.no_grad():  # LoRA's B starts at zero: make every trainable tensor tell itself apart
            for p in model.parameters():
                if p.requires_grad:
                    p.copy_(torch.randn_like(p))
        return model

    plain, sharded = lora_model(), lora_model()
    trainer = fsdp_on_cpu(sharded, sharded.base_model.model.model.layers)
    assert any(isinstance(p, DTensor) for p in sharded.parameters())
    state = gathered_state(trainer, "lora", "float32")
    expected = {n: p.detach() for n, p in plain.named_parameters() if p.requires_grad}
    assert state.keys() == expected.keys() and all(torch.equal(state[n], expected[n]) for n in state)
    plain.save_pretrained(tmp_path / "one", save_embedding_layers=False)
    sharded.save_pretrained(tmp_path / "sharded", state_dict=state, save_embedding_layers=False)
    assert ((tmp_path / "one" / "adapter_model.safetensors").read_bytes() ==
            (tmp_path / "sharded" / "adapter_model.safetensors").read_bytes())


def test_a_full_model_under_fsdp_gathers_what_one_process_saves(tmp_path, fsdp_on_cpu):
    """trainer.gathered_state for a full fine-tune, on a Qwen3 with tied embeddings in fp32 (as
    FSDP2's master weights are): the gathered weights come back in the plan's dtype and without
    the tied head's second name, so save_pretrained writes the bytes the unsharded model writes in
    that dtype (on two GPUs the tied head was written twice, and in fp32)."""
    import torch

    from stages.train.trainer import gathered_state

    plain, sharded = small_qwen3(tie_word_embeddings=True), small_qwen3(tie_word_embeddings=True)
    state = gathered_state(fsdp_on_cpu(sharded, sharded.model.layers), "none", "bfloat16")
    assert "lm_head.weight" not in state and state["model.embed_tokens.weight"].dtype == torch.bfloat16
    plain.to(torch.bfloat16).save_pretrained(tmp_path / "one")
    sharded.save_pretrained(tmp_path / "sharded", state_dict=state)
    assert ((tmp_path / "one" / "model.safetensors").read_bytes() ==
            (tmp_path / "sharded" / "model.safetensors").read_bytes())
