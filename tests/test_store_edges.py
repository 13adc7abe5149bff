"""The store's edges, as a hostile or unlucky user finds them: an object holds regular files only
(a FIFO, a directory, a symlink added inside one is damage, named); a file name cannot write lines
of its own into verify's output; an unreadable file is one line from verify, serve and a build;
a killed build's leftovers are removed by the next build of its key."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time

import pytest

from conftest import NO_NETWORK, Run, doit, snapshot


def object_of(project, stage: str):
    key = json.loads((project / "artifacts" / "tiny" / f"{stage}.json").read_text())["key"]
    return project / "artifacts" / "store" / stage / key


def verify_lines(run) -> list[str]:
    return [line for line in run.out.splitlines() if line.startswith(("error: verify:", "verify:"))]


def add_fifo(obj, tmp_path):
    os.mkfifo(obj / "extra.fifo")
    return "extra.fifo, a FIFO, is not part of the artifact"


def add_directory(obj, tmp_path):
    (obj / "extra").mkdir()
    return "extra/, a directory, is not part of the artifact"


def add_dangling_symlink(obj, tmp_path):
    (obj / "extra.json").symlink_to(tmp_path / "nowhere.json")
    return "extra.json, a symlink, is not part of the artifact"


def replace_by_symlink_to_a_copy(obj, tmp_path):
    """metrics.jsonl moved out of the store, an identical copy linked in its place."""
    outside = tmp_path / "metrics.jsonl"
    shutil.copy(obj / "metrics.jsonl", outside)
    obj.chmod(0o755)
    (obj / "metrics.jsonl").unlink()
    (obj / "metrics.jsonl").symlink_to(outside)
    return "metrics.jsonl is a symlink, not a regular file"


@pytest.mark.parametrize("damage", [add_fifo, add_directory, add_dangling_symlink, replace_by_symlink_to_a_copy])
def test_an_object_holds_regular_files_only(warm, tmp_path, damage):
    obj = object_of(warm, "checkpoint")
    obj.chmod(0o755)
    problem = damage(obj, tmp_path)
    for args in (["verify:tiny"], ["verify:tiny", "--full"]):
        run = doit(warm, *args, timeout=120)
        assert run.rc != 0 and "Traceback" not in run.out, run.out[-2000:]
        assert verify_lines(run) == [f"error: verify: tiny: checkpoint: {problem}"], run.out[-2000:]


def test_a_file_name_cannot_write_lines_into_verifys_output(warm):
    obj = object_of(warm, "eval")
    obj.chmod(0o755)
    (obj / "x\nverify: tiny: intact").write_text("")
    run = doit(warm, "verify:tiny", timeout=120)
    assert run.rc != 0, run.out[-2000:]
    assert verify_lines(run) == ["error: verify: tiny: eval: x\\nverify: tiny: intact is not part of the artifact"]
    assert "verify: tiny: intact" not in run.out.splitlines()


def without_dac_override(project, *args) -> Run:
    """doit as root without the capabilities that let root read any file, so that a file with
    mode 000 is unreadable to it, as it would be to any other user."""
    start = time.time()
    p = subprocess.run(["setpriv", "--bounding-set=-dac_override,-dac_read_search", sys.executable, "-m", "doit",
                        *args], cwd=project, capture_output=True, text=True, timeout=300,
                       env={**os.environ, **NO_NETWORK})
    if "setpriv:" in p.stderr:
        pytest.skip(f"cannot drop capabilities here: {p.stderr.strip()}")
    return Run(p.returncode, p.stdout + p.stderr, time.time() - start)


def test_an_unreadable_store_file_is_one_line_from_verify_serve_and_a_build(warm):
    weights = object_of(warm, "checkpoint") / "model" / "model.safetensors"
    weights.chmod(0o000)
    before = snapshot(warm)
    where = os.path.relpath(weights, warm)
    for args in (["verify:tiny"], ["serve:tiny", "--port", "9"], ["manifest:tiny"]):
        run = without_dac_override(warm, *args)
        errors = [line for line in run.out.splitlines() if line.startswith("error: ")]
        assert run.rc != 0 and "Traceback" not in run.out and len(errors) == 1, (args, run.out[-3000:])
        assert f"{where} cannot be read (Permission denied)" in errors[0], (args, errors)
    assert snapshot(warm) == before  # nothing rebuilt over it, nothing moved aside


def test_a_killed_builds_leftovers_are_removed_by_the_next_build_of_its_key(warm):
    plan = object_of(warm, "plan")
    parent, key = plan.parent, plan.name
    dead = 2 ** 22 + 1  # above the default pid_max: no live process has it
    leftovers = [parent / f".tmp-{key}-{dead}", parent / f".tmp-{key}-{dead}.log", parent / f".tmp-{key}-{dead}.inputs"]
    leftovers[0].mkdir()
    leftovers[1].write_text("a killed build's log\n")
    leftovers[2].mkdir()
    plan.chmod(0o755)
    (plan / "plan.json").chmod(0o644)
    (plan / "plan.json").write_text("{}")  # damaged: the next build of this key rebuilds it
    run = doit(warm, "plan:tiny", timeout=300)
    assert run.rc == 0 and "plan:tiny" in run.ran, run.out[-2000:]
    assert not any(p.exists() for p in leftovers), [p.name for p in parent.iterdir()]
