"""Crash safety: kill -9 in the middle of any stage leaves nothing half-built in view, the next
run finishes the job, and a killed training run resumes from its last saved step."""
from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

from conftest import ALL_STAGES, NO_NETWORK, doit
from stages.engine.store import hash_file, list_files

ORDER = ["base", "plan", "shards", "checkpoint", "quantized", "eval", "manifest"]


class Build:
    """`doit manifest:tiny` in its own process group, its output collected as it comes."""

    def __init__(self, project: Path):
        self.proc = subprocess.Popen([sys.executable, "-m", "doit", "manifest:tiny"], cwd=project,
                                     stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                     start_new_session=True, env={**os.environ, **NO_NETWORK})
        self.lines: list[str] = []
        self.reader = threading.Thread(target=lambda: self.lines.extend(self.proc.stdout), daemon=True)
        self.reader.start()

    def wait_for(self, ready, timeout=300) -> bool:
        deadline = time.time() + timeout
        while time.time() < deadline and self.proc.poll() is None:
            if ready():
                return True
            time.sleep(0.01)
        self.reader.join(timeout=10)  # a build that ended may have printed what we wait for last
        return ready()

    def kill(self):
        os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait()


def visible_objects_are_whole(project: Path) -> list[str]:
    """Every object directory in the store has a sidecar, and its files are exactly the recorded ones."""
    seen, store = [], project / "artifacts" / "store"
    if not store.is_dir():  # killed as the first stage started, before it made anything
        return seen
    for stage_dir in store.iterdir():
        for obj in stage_dir.iterdir():
            if obj.name.startswith(".") or not obj.is_dir():
                continue
            sidecar = json.loads(obj.with_suffix(".json").read_text())
            assert {rel: hash_file(obj / rel) for rel in list_files(obj)} == sidecar["files"], obj
            seen.append(stage_dir.name)
    return seen


def digests(project: Path) -> dict[str, str]:
    return {s: json.loads((project / "artifacts" / "tiny" / f"{s}.json").read_text())["digest"]
            for s in ALL_STAGES}


def test_kill_during_each_stage_then_rebuild(fresh, built):
    for stage in ORDER:
        build = Build(fresh)
        # killed once the stage writes its temporary directory (its work under way), or as soon
        # as it starts where it is too quick to catch there; either way before it is done
        started = build.wait_for(lambda: any((fresh / "artifacts" / "store").glob(f"{stage}*/.tmp-*"))
                                 or (stage in ("base", "plan", "manifest")
                                     and any(l.startswith(f".  {stage}:tiny") for l in build.lines)))
        assert started, "".join(build.lines[-40:])
        build.kill()
        whole = visible_objects_are_whole(fresh)
        if stage in ("shards", "checkpoint", "quantized", "eval"):  # stages that outlast the 0.5 s
            assert stage not in whole, f"{stage} finished before the kill; the test did not test"
    run = doit(fresh, "manifest:tiny")
    assert run.rc == 0, run.out[-3000:]
    visible_objects_are_whole(fresh)
    assert digests(fresh) == digests(built)  # and the rebuilt artifacts are the clean build's bytes


def test_killed_training_resumes_from_the_last_saved_step(warm, built):
    shutil.rmtree(warm / "artifacts" / "store" / "checkpoint")  # train again, from a warm store
    build = Build(warm)
    work = warm / "artifacts" / "work" / "checkpoint"
    saved = lambda: list(work.glob("*/checkpoint-*/mindxtrain-complete"))  # noqa: E731
    assert build.wait_for(saved), "".join(build.lines[-40:])
    build.kill()
    step = max(int(p.parent.name.split("-")[1]) for p in saved())
    assert step >= 20

    run = doit(warm, "manifest:tiny")
    assert run.rc == 0, run.out[-3000:]
    assert f"resuming from checkpoint-{step}" in run.out
    key = json.loads((warm / "artifacts" / "tiny" / "checkpoint.json").read_text())["key"]
    sidecar = json.loads((warm / "artifacts" / "store" / "checkpoint" / f"{key}.json").read_text())
    assert sidecar["run"]["resumed_from_step"] == step
    metrics = (warm / "artifacts" / "store" / "checkpoint" / key / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(m)["step"] for m in metrics] == list(range(1, 151))
    assert not (work / key).exists()  # scratch space goes once the artifact is in the store
    assert digests(warm)["checkpoint"] == digests(built)["checkpoint"]  # resumed == uninterrupted


def test_training_saves_every_save_steps_and_not_again_at_the_end():
    """Resume points come every train.save_steps; transformers' extra save at the last step (which
    the artifact, saved right after, makes useless, and which gathers a sharded full fine-tune's
    whole optimizer state) is turned off, unless that step is a save step anyway."""
    from types import SimpleNamespace

    from transformers import TrainerControl, TrainerState

    from stages.train.trainer import mark_complete_callback

    callback, args = mark_complete_callback(), SimpleNamespace(save_steps=20)
    for step, last, saves in ((140, 150, True), (150, 150, False), (160, 160, True)):
        control = TrainerControl(should_save=True)  # as transformers' flow callback left it
        callback.on_step_end(args, TrainerState(global_step=step, max_steps=last), control)
        assert control.should_save == saves, (step, last)
