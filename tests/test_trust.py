"""Trust the store, as a hostile or unlucky user tries it: names that would be paths, keys given
twice, data outside the project, one huge row, an empty file, a read-only store and a full disk.
Each ends in one line naming the file and what to do, with nothing in the store changed."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import NO_NETWORK, doit, snapshot
from test_pipeline import artifact, one_error_line
from stages.engine import recipe
from stages.engine.errors import UserError


@pytest.mark.parametrize("name", ["bad:colon", "..", "a b", ".hidden"])
def test_a_recipe_file_whose_name_is_not_a_name_stops_doit_in_one_line(warm, name):
    shutil.copy(warm / "recipes" / "tiny.yaml", warm / "recipes" / f"{name}.yaml")
    before = snapshot(warm)
    run = doit(warm, "manifest:tiny")
    assert run.rc != 0 and run.out.strip().splitlines()[-1] == (
        f"ERROR: recipes/{name}.yaml: a recipe name is letters, digits, _ and - only; rename the file "
        f"(e.g. {''.join(c if c.isalnum() or c in '_-' else '_' for c in name).strip('_') or 'recipe'}.yaml)"), run.out
    assert snapshot(warm) == before and not (warm / "artifacts" / ".." / "manifest.json").exists()


def test_a_key_given_twice_is_an_error_naming_both_lines(warm):
    recipe = warm / "recipes" / "tiny.yaml"
    lines = recipe.read_text().splitlines(keepends=True)
    at = lines.index("  lr: 0.005\n")
    recipe.write_text("".join(lines[:at + 1] + ["  lr: 0.5\n"] + lines[at + 1:]))
    line = one_error_line(doit(warm, "manifest:tiny"))
    assert line == f"error: recipes/tiny.yaml:{at + 2}: train.lr is given twice (lines {at + 1} and {at + 2}); keep one"


def billion_laughs() -> str:
    """Nine levels of ten aliases: 40 lines that stand for a billion strings."""
    lines = ['a0: &a0 ["lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol"]']
    lines += [f"a{i}: &a{i} [{', '.join([f'*a{i - 1}'] * 10)}]" for i in range(1, 9)]
    return "\n".join(lines) + "\nmodel:\n  config: {}\ndata:\n  sources: *a8\n"


HOSTILE_YAML = {
    "laughs": (billion_laughs(), "recipes/laughs.yaml:5: the YAML expands to more than 100,000 values"),
    "deep": ("model: " + "[" * 10_000 + "]" * 10_000 + "\n", "recipes/deep.yaml:1: the YAML is nested more than 32 levels"),
    "huge": ("# " + "x" * (2 << 20) + "\n", "recipes/huge.yaml: over 1 MiB; a recipe is a page of settings"),
    # an alias inside the node it names: a cyclic object the size bound counted as one value
    "recursive": ("model:\n  config: &a\n    hidden_size: 64\n    again: *a\ndata:\n  sources: []\n",
                  "recipes/recursive.yaml:4: *a repeats a node inside itself"),
    # plain values PyYAML reads as a date or a number, then cannot build
    "date": ("model:\n  config: {}\ndata:\n  sources: []\n  when: 2001-02-30\n",
             "recipes/date.yaml:5: YAML cannot build a value (a date or number that cannot be one, or a tag that does not fit it: day is out of range"),
}


@pytest.mark.parametrize("value, error", [
    ("9" * 5000, "Exceeds the limit (4300 digits) for integer string conversion: value has 5000 digits)"),
    ("2001-12-14t21:59:43.10+99:00", "offset must be a timedelta"),
    ("!!bool maybe", "maybe"),
    ("!!timestamp soon", "has no attribute"),
])
def test_a_value_yaml_cannot_build_is_one_line_naming_its_line(tmp_path, value, error):
    plain = f"model:\n  config: {{}}\ndata:\n  sources:\n    - path: a.jsonl\n      when: [1, {value}]\n"
    merged = "base: &b {x: 1}\n" + plain.replace("  config: {}\n", "  config: {}\n  <<: *b\n")  # a merge key's
    for text, line in ((plain, 6), (merged, 8)):  # own scalar, before the value, is no value to build
        path = tmp_path / "r.yaml"
        path.write_text(text)
        with pytest.raises(UserError) as e:
            recipe.load(path)
        assert str(e.value).startswith(f"{path}:{line}: YAML cannot build a value ("), str(e.value)
        assert error in str(e.value) and "\n" not in str(e.value)


@pytest.mark.parametrize("name", sorted(HOSTILE_YAML))
def test_a_hostile_yaml_recipe_is_one_line_and_the_others_go_on(warm, name):
    text, error = HOSTILE_YAML[name]
    (warm / "recipes" / f"{name}.yaml").write_text(text)
    before = snapshot(warm)
    run = doit(warm, f"manifest:{name}")
    assert one_error_line(run).startswith(f"error: {error}"), run.out[-2000:]
    assert "Traceback" not in run.out and len(run.out.splitlines()) < 10, run.out[-2000:]

    # the other recipes are listed, built, shown, checked and verified as if it were not there
    status = doit(warm, "status")
    assert status.rc == 0 and f"{name}: cannot build: {error}" in status.out, status.out[-2000:]
    assert "\ntiny: up to date\n" in status.out and "Traceback" not in status.out
    assert doit(warm, "manifest:tiny").ran == []
    listed = doit(warm, "list", "--all")
    assert listed.rc == 0 and f"manifest:{name}" in listed.out and "manifest:tiny" in listed.out
    shown = doit(warm, "show:tiny")
    assert shown.rc == 0 and "digest" in shown.out
    check = doit(warm, "verify")
    assert check.rc == 0 and "verify: tiny: intact" in check.out, check.out[-2000:]
    assert snapshot(warm) == before


@pytest.mark.parametrize("path", ["/etc/hosts", "../outside.jsonl", "data/../../outside.jsonl"])
def test_data_outside_the_project_is_refused(warm, path):
    recipe = warm / "recipes" / "tiny.yaml"
    recipe.write_text(recipe.read_text().replace("path: data/tiny/chat.jsonl", f"path: {path}"))
    line = one_error_line(doit(warm, "manifest:tiny"))
    assert f"data.sources.0.path: {path} is outside the project" in line and "tiny.yaml:" in line


def test_data_linked_into_the_project_gives_the_same_receipt(warm, tmp_path):
    outside = tmp_path / "elsewhere" / "chat.jsonl"
    outside.parent.mkdir()
    data = warm / "data" / "tiny" / "chat.jsonl"
    shutil.move(data, outside)
    data.symlink_to(outside)
    run = doit(warm, "manifest:tiny")
    assert run.rc == 0 and run.ran == [], run.out  # same content, same keys: nothing to build
    assert str(tmp_path) not in (artifact(warm, "manifest") / "manifest.json").read_text()


def peak_rss_kib(project: Path, *args) -> tuple[int, str]:
    """Run doit in a process of its own; the largest resident set of it and its workers."""
    script = ("import resource, subprocess, sys; p = subprocess.run([sys.executable, '-m', 'doit', *sys.argv[1:]], "
              "capture_output=True, text=True); print(p.stdout + p.stderr); "
              "print(p.returncode, resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss)")
    out = subprocess.run([sys.executable, "-c", script, *args], cwd=project, capture_output=True, text=True,
                         env={**os.environ, **NO_NETWORK}).stdout
    rc, peak = out.strip().splitlines()[-1].split()
    assert rc == "0", out[-3000:]
    return int(peak), out


def test_a_200_mb_row_is_dropped_unread_with_flat_memory(warm):
    recipe = warm / "recipes" / "tiny.yaml"
    recipe.write_text(recipe.read_text().replace("  max_length: 256\n", "  max_length: 250\n"))
    baseline, _ = peak_rss_kib(warm, "shards:tiny")
    data = warm / "data" / "tiny" / "chat.jsonl"
    with open(data, "a") as f:
        f.write('{"messages": [{"role": "user", "content": "')
        for _ in range(200):
            f.write("words " * 174763)  # 1 MiB
        f.write('"}, {"role": "assistant", "content": "ok"}]}\n')
    peak, out = peak_rss_kib(warm, "shards:tiny")
    assert peak < baseline + 64 * 1024, (peak, baseline)  # KiB: not the row's 200 MB, nor a copy of it
    stats = json.loads((artifact(warm, "shards") / "stats.json").read_text())
    assert stats["dropped"]["oversized"] == 1 and stats["rows_in_total"] == 3001
    pieces = sum(p.stat().st_size for p in (warm / "artifacts" / "store").glob("shards-source/*/*"))
    assert pieces < 50 << 20  # the row left nothing of its size in the store


def test_an_empty_data_file_is_named(warm):
    (warm / "data" / "tiny" / "chat.jsonl").write_text("")
    line = one_error_line(doit(warm, "manifest:tiny"))
    assert line == "error: data/tiny/chat.jsonl: no rows (the source is empty); fill it or remove it from data.sources"


@pytest.fixture
def mount(tmp_path):
    """mount(dir, options): a small tmpfs there for the test (root and mount(8) needed)."""
    mounted = []

    def do(where: Path, options: str):
        where.mkdir(parents=True, exist_ok=True)
        p = subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(where)], capture_output=True, text=True)
        if p.returncode:
            pytest.skip(f"cannot mount a tmpfs here: {p.stderr.strip()}")
        mounted.append(where)

    yield do
    for where in reversed(mounted):
        subprocess.run(["umount", str(where)], check=True)


def test_a_full_disk_ends_in_one_line_and_loses_nothing(warm, mount):
    recipe = warm / "recipes" / "tiny.yaml"
    recipe.write_text(recipe.read_text().replace("lr: 0.005", "lr: 0.004"))  # checkpoint must rebuild
    before = snapshot(warm)
    mount(warm / "artifacts" / "store" / "checkpoint", "size=64k")  # room for the log, not the weights
    line = one_error_line(doit(warm, "manifest:tiny"))
    assert line.startswith("error: checkpoint:tiny: cannot write ") and "No space left on device" in line, line
    assert "free space on that disk" in line
    kept = lambda files: {k: v for k, v in files.items() if not k.startswith(("store/checkpoint/", "work/"))}  # noqa: E731
    assert kept(snapshot(warm)) == kept(before)  # (work/ keeps the training steps saved, to resume from)
    assert list((warm / "artifacts" / "work" / "checkpoint").glob("*/checkpoint-*/mindxtrain-complete"))


def test_a_read_only_store_ends_in_one_line(warm, mount):
    recipe = warm / "recipes" / "tiny.yaml"
    recipe.write_text(recipe.read_text().replace("max_new_tokens: 12", "max_new_tokens: 10"))  # eval must rebuild
    mount(warm / "artifacts" / "store" / "eval", "ro,size=64k")
    line = one_error_line(doit(warm, "manifest:tiny"))
    assert line.startswith("error: eval:tiny: cannot write ") and "Read-only file system" in line, line
    assert "build where artifacts/ is writable" in line
