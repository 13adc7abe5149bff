"""The quantized and eval stages build in a worker process that imported Quark (and lm-eval,
PEFT) while training ran (stages/engine/preload.py): the same bytes as built in doit's own
process, their console lines on the run's console, and no process outliving the run."""
from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import ALL_STAGES, NO_NETWORK, doit, snapshot
from stages.engine.preload import wanted
from stages.table import STAGES

ALWAYS = {"PYTHONHASHSEED": "1", "MINDXTRAIN_PRELOAD": "always"}
IN_WORKER = re.compile(r"in the preload worker \(pid (\d+)\)")


def first_line(project: Path, stage: str) -> str:
    pointer = json.loads((project / "artifacts" / "tiny" / f"{stage}.json").read_text())
    return (project / "artifacts" / "store" / stage / f"{pointer['key']}.log").read_text().splitlines()[0]


def gone(pid: int, within: float) -> bool:
    """The process has ended (a zombie that nobody has reaped yet has ended too)."""
    deadline = time.time() + within
    while time.time() < deadline:
        try:
            if Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z":
                return True
        except (FileNotFoundError, ProcessLookupError):
            return True
        time.sleep(0.1)
    return False


def unbuilt(project: Path, *stages: str) -> Path:
    """The project without tiny's `stages` (store objects and pointers), to build them again."""
    for stage in stages:
        key = json.loads((project / "artifacts" / "tiny" / f"{stage}.json").read_text())["key"]
        shutil.rmtree(project / "artifacts" / "store" / stage / key)
        (project / "artifacts" / "tiny" / f"{stage}.json").unlink()
    return project


def test_the_imports_start_with_the_last_stage_the_first_preloading_one_reads():
    quark = ["stages.model.quark", "quark.torch", "peft"]
    every = quark + ["lm_eval.evaluator", "lm_eval.models.huggingface", "lm_eval.tasks"]
    assert wanted(STAGES["checkpoint"], STAGES) == every  # training overlaps them
    assert wanted(STAGES["quantized"], STAGES) == every  # checkpoint was built already
    assert wanted(STAGES["eval"], STAGES) == list(STAGES["eval"].preload)
    for name in ("base", "plan", "shards", "manifest", "report"):  # not during the probe's measurements
        assert wanted(STAGES[name], STAGES) == [], name


def test_preloaded_stages_build_in_the_worker_to_the_same_bytes(fresh, built):
    run = doit(fresh, "manifest:tiny", env=ALWAYS)
    assert run.rc == 0, run.out[-3000:]
    workers = set()
    for stage in ALL_STAGES:
        line = first_line(fresh, stage)
        in_worker = IN_WORKER.search(line)
        assert bool(in_worker) == (stage in ("quantized", "eval")), line
        if in_worker:
            workers.add(int(in_worker.group(1)))
    assert "fp8: quantized loss" in run.out  # the worker's lines reach the run's console
    assert "leaked" not in run.out  # and it ended as a process should (multiprocessing's resource tracker says)
    assert "imported quark.torch" in (fresh / "artifacts" / "work" / "preload.log").read_text()
    for stage in ALL_STAGES:
        assert (json.loads((fresh / "artifacts" / "tiny" / f"{stage}.json").read_text())
                == json.loads((built / "artifacts" / "tiny" / f"{stage}.json").read_text())), stage
    (worker,) = workers  # one worker built both
    assert gone(worker, within=5)  # it ends with the run


def test_the_worker_ends_with_the_run_killed_alone(warm):
    """kill -9 of doit alone (not its process group) ends the worker building quantized, which
    would otherwise build on with nobody to take its work. (From the built project less what
    comes after training: the worker is what is killed here, not the stages before it.)"""
    unbuilt(warm, "quantized", "eval", "manifest")
    env = {**os.environ, **NO_NETWORK, **ALWAYS}
    proc = subprocess.Popen([sys.executable, "-m", "doit", "manifest:tiny"], cwd=warm, env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        deadline, worker = time.time() + 300, None
        while worker is None and time.time() < deadline and proc.poll() is None:
            tmp = [m for p in (warm / "artifacts" / "store").glob("quantized/.tmp-*")
                   if (m := re.fullmatch(r"\.tmp-[0-9a-f]+-(\d+)", p.name))]  # its dir, named by the pid building it
            worker = int(tmp[0].group(1)) if tmp else None
            time.sleep(0.01)
        assert worker is not None and worker != proc.pid, "quantized never started in the worker"
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
        assert gone(worker, within=5)
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)  # whatever is left of its session
        except ProcessLookupError:
            pass
        proc.wait()
    assert not (warm / "artifacts" / "tiny" / "quantized.json").exists()


def test_a_preload_switch_it_does_not_know_is_one_line(fresh):
    run = doit(fresh, "checkpoint:tiny", env={"MINDXTRAIN_PRELOAD": "sometimes"})
    assert run.rc != 0
    assert "MINDXTRAIN_PRELOAD='sometimes': say always, never, or leave it unset" in run.out, run.out[-2000:]
    assert "Traceback" not in run.out


@pytest.mark.parametrize("preload", ["always", "never"])
def test_bad_input_found_in_the_worker_or_not_is_one_line_and_stores_nothing(warm, preload):
    """A calibration that takes every sequence of the first shard leaves none to check the export
    on: one line naming the key, raised in the worker as in the run's process (it had been
    safetensors' error on an empty slice, with a traceback)."""
    recipe = warm / "recipes" / "tiny.yaml"
    recipe.write_text(recipe.read_text().replace("calibration_sequences: 8", "calibration_sequences: 100000"))
    before = {k: v for k, v in snapshot(warm).items() if not k.startswith("work/")}
    run = doit(warm, "quantized:tiny", env={"MINDXTRAIN_PRELOAD": preload})
    assert run.rc != 0
    assert "quantize.calibration_sequences: 100000 leaves none of the first shard's sequences" in run.out, run.out[-2000:]
    assert "Traceback" not in run.out
    assert (warm / "artifacts" / "work" / "preload.log").exists() == (preload == "always")
    assert {k: v for k, v in snapshot(warm).items() if not k.startswith("work/")} == before


def test_the_worker_builds_from_the_recipe_the_run_computed_its_key_from(fresh, built):
    """The recipe edited while training runs: the run computed every key from the recipe it
    loaded at its start, and the worker, which reads the recipe only when it builds, builds from
    that one too, not from the file as it is then."""
    env = {**os.environ, **NO_NETWORK, **ALWAYS}
    proc = subprocess.Popen([sys.executable, "-m", "doit", "manifest:tiny"], cwd=fresh, env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.time() + 300
    while not list((fresh / "artifacts" / "store").glob("checkpoint/.tmp-*")) and time.time() < deadline \
            and proc.poll() is None:  # a build that ended (or failed) before training is not waited on for 300 s
        time.sleep(0.01)
    assert proc.poll() is None, "the build ended before training started: the test did not test"
    recipe = fresh / "recipes" / "tiny.yaml"
    recipe.write_text(recipe.read_text().replace("calibration_sequences: 8", "calibration_sequences: 4"))
    assert proc.wait(timeout=600) == 0
    assert IN_WORKER.search(first_line(fresh, "quantized"))
    for stage in ("quantized", "eval"):
        assert (json.loads((fresh / "artifacts" / "tiny" / f"{stage}.json").read_text())
                == json.loads((built / "artifacts" / "tiny" / f"{stage}.json").read_text())), stage
