"""The remote cache is untrusted input (issue 36). An attacker who can write the remote recomputes
every hash an entry carries, so each attack here forges a self-consistent entry: a file path that
leaves its object, an `also` (or a pulled manifest) naming what is not in the stage table, a blob
longer than declared or a device, an entry that is not the JSON object push writes. Against a
directory and an S3 remote (moto's server), `doit pull` fails with one line naming the entry, and a
build reading the remote says it rejected it and builds the stage here; nothing is written first:
the store, and a file of the user's that the attacks aim at, keep their bytes."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest
import s3fs
from blake3 import blake3

from conftest import NO_NETWORK, Run, doit, snapshot
from test_remote import pointers, s3_env
from stages.engine import keys
from stages.engine.store import hash_file, merkle

ENTRY_CAP = 4 << 20  # stages/engine/remote.py's ENTRY_CAP: a longer entry is refused unread
SENTINEL = b"a file of the user's, beside the project\n"


def attacked(project: Path, *args, env=None) -> Run:
    """doit as conftest runs it, but unable to write a file past 64 MiB or to map more than 2 GiB:
    code that reads a hostile blob or entry without bound fails fast here, instead of filling the
    disk or the memory of the machine the tests run on."""
    start = time.time()
    p = subprocess.run(["prlimit", f"--fsize={64 << 20}", f"--as={2 << 30}", sys.executable, "-m", "doit", *args],
                       cwd=project, capture_output=True, text=True, timeout=300,
                       env={**os.environ, **NO_NETWORK, **(env or {})})
    return Run(p.returncode, p.stdout + p.stderr, time.time() - start)


@pytest.fixture(scope="module")
def published(built, tmp_path_factory) -> tuple[Path, Path]:
    """A copy of the built project, pushed once to a directory remote that each test copies."""
    project = tmp_path_factory.mktemp("published") / "proj"
    shutil.copytree(built, project, symlinks=True)
    remote = project.parent / "remote"
    run = doit(project, "push:tiny", "--remote", str(remote))
    assert run.rc == 0, run.out[-3000:]
    return project, remote


@pytest.fixture
def victim(published, tmp_path) -> Path:
    """A copy of the built project without its plan, which pull and a build fetch from the remote; and
    beside it, a file of the user's (tmp_path/sentinel) that the attacks aim at."""
    project = tmp_path / "proj"
    shutil.copytree(published[0], project, symlinks=True)
    without(project, "plan")
    (tmp_path / "sentinel").write_bytes(SENTINEL)
    return project


def without(project: Path, stage: str) -> None:
    """Take the stage's current object out of the project's store (its pointer stays)."""
    key, objects = pointers(project)[stage]["key"], project / "artifacts" / "store" / stage
    shutil.rmtree(objects / key)
    (objects / f"{key}.json").unlink()
    (objects / f"{key}.log").unlink()


class Remote:
    """A copy of the published remote that a test rewrites as an attacker would: `url` and `env` for
    doit, and its files read and written by their path under the remote's root."""

    def __init__(self, url: str, env: dict, read, write):
        self.url, self.env, self.read, self.write = url, env, read, write

    def entry(self, stage: str, key: str) -> dict:
        return json.loads(self.read(f"ac/{stage}/{key}.json"))

    def put_entry(self, stage: str, key: str, entry: dict) -> None:
        self.write(f"ac/{stage}/{key}.json", json.dumps(entry, indent=1, sort_keys=True).encode())


def directory_remote(published, tmp_path) -> tuple[Remote, Path]:
    root = tmp_path / "remote"
    shutil.copytree(published[1], root)

    def write(rel: str, data: bytes) -> None:
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).unlink(missing_ok=True)  # never through a link an earlier step left there
        (root / rel).write_bytes(data)

    return Remote(str(root), {}, lambda rel: (root / rel).read_bytes(), write), root


@pytest.fixture
def dir_remote(published, tmp_path) -> tuple[Remote, Path]:
    """A directory remote, and its root for what only a filesystem can hold (links to devices)."""
    return directory_remote(published, tmp_path)


@pytest.fixture(params=["directory", "s3"])
def remote(request, published, tmp_path, monkeypatch) -> Remote:
    if request.param == "directory":
        return directory_remote(published, tmp_path)[0]
    endpoint = request.getfixturevalue("moto_url")
    for name in ("NO_PROXY", "no_proxy"):
        monkeypatch.setenv(name, "127.0.0.1")
    fs = s3fs.S3FileSystem(endpoint_url=endpoint, key="testing", secret="testing", skip_instance_cache=True)
    root = f"hostile-{uuid.uuid4().hex[:16]}/team"
    fs.mkdir(root.split("/")[0])
    fs.put(f"{published[1]}/", root, recursive=True)
    assert fs.find(f"{root}/ac")  # the copy holds the entries
    return Remote(f"s3://{root}", s3_env(endpoint), lambda rel: fs.cat_file(f"{root}/{rel}"),
                  lambda rel, data: fs.pipe_file(f"{root}/{rel}", data))


def beside(victim: Path) -> dict[str, bytes | None]:
    """Every file (with its bytes) and folder next to the project and its remote: what an attack
    that gets out of the store would write or overwrite, the sentinel it aims at included."""
    top = victim.parent
    return {str(p.relative_to(top)): p.read_bytes() if p.is_file() else None for p in top.rglob("*")
            if p.relative_to(top).parts[0] not in ("proj", "remote")}


def plan_entry(victim: Path, remote: Remote) -> tuple[str, dict]:
    key = pointers(victim)["plan"]["key"]
    return key, remote.entry("plan", key)


def blob(digest: str) -> str:
    return f"cas/{digest[:2]}/{digest}"


def with_files(remote: Remote, entry: dict, files: dict) -> dict:
    """The entry with another file map, the sizes of its blobs and the tree digest recomputed, as an
    attacker does."""
    sidecar = dict(entry["sidecar"], files=files, digest=merkle(files))
    return dict(entry, sidecar=sidecar, sizes={rel: len(remote.read(blob(d))) for rel, d in files.items()})


def assert_refused(victim: Path, remote: Remote, why: str) -> None:
    """pull fails with one line naming the plan's entry and saying `why`, and writes nothing: the
    store is as it was, and so is everything beside the project. A build reading the remote then
    says it rejected the entry, in that line, and builds the plan here (the key and bytes pushed)."""
    pushed = pointers(victim)["plan"]
    where = f"{remote.url}/ac/plan/{pushed['key']}.json"
    store, around = snapshot(victim), beside(victim)
    run = attacked(victim, "pull:tiny", "--remote", remote.url, env=remote.env)
    assert run.rc != 0 and "Traceback" not in run.out, run.out[-3000:]
    assert snapshot(victim) == store and beside(victim) == around, run.out[-3000:]
    lines = [line for line in run.out.splitlines() if where in line]
    assert len(lines) == 1 and lines[0].startswith(f"error: {where}: ") and why in lines[0], run.out[-3000:]

    build = attacked(victim, "plan:tiny", env={**remote.env, "MINDXTRAIN_REMOTE": remote.url})
    assert build.rc == 0 and "Traceback" not in build.out, build.out[-3000:]
    assert f"plan:tiny: remote entry rejected: {lines[0][len('error: '):]}; building it here" in build.out, \
        build.out[-3000:]
    assert build.stages_ran() == {"plan"} and beside(victim) == around
    assert pointers(victim)["plan"] == pushed


@pytest.mark.parametrize("path, why", [
    ("../../../../../sentinel", "has an empty, . or .. part"),  # from the temp dir the fetch writes into
    ("{tmp}/sentinel", "is absolute"),
    ("C:/sentinel", "on a drive"),
    ("..\\..\\..\\..\\..\\sentinel", "holds a backslash"),
    ("plan\0.json", "unprintable"),
    ("plan\n.json", "unprintable"),
], ids=["traversal", "absolute", "drive", "backslash", "nul", "newline"])
def test_a_file_path_that_leaves_its_object_is_refused(victim, remote, tmp_path, path, why):
    path = path.format(tmp=tmp_path)
    key, entry = plan_entry(victim, remote)
    files = entry["sidecar"]["files"]
    remote.put_entry("plan", key, with_files(remote, entry, {**files, path: files["plan.json"]}))
    assert_refused(victim, remote, why)


ALSO = pytest.mark.parametrize("stage, key", [
    ("{tmp}/planted", "{base}"), ("nonesuch", "{base}"), ("base", "../../../../../planted"), ("base", "{BASE}"),
], ids=["absolute-stage", "unknown-stage", "traversal-key", "uppercase-key"])


def named(victim: Path, remote: Remote, stage: str, key: str) -> tuple[str, str]:
    """The (stage, key) an attack names, and where a fetch of an absolute stage would read, a copy of
    base's entry for it to install there."""
    base = pointers(victim)["base"]["key"]
    stage, key = stage.format(tmp=victim.parent), key.format(base=base, BASE=base.upper())
    if stage.startswith("/"):
        remote.put_entry(stage, key, dict(remote.entry("base", base), stage=stage))
    return stage, key


@ALSO
def test_an_also_entry_outside_the_stage_table_is_refused_before_anything_is_fetched(victim, remote, stage, key):
    stage, key = named(victim, remote, stage, key)
    plan_key, entry = plan_entry(victim, remote)
    remote.put_entry("plan", plan_key, dict(entry, also=[[stage, key]]))
    assert_refused(victim, remote, "not a stage of the stage table")


def pulled_forged_manifest(victim: Path, remote: Remote, forge) -> str:
    """Pull with the manifest's entry well formed but its manifest.json forged (forge(manifest) gives
    its bytes; an attacker recomputes their digest): pull installs it, then fails with one line naming
    the entry, which it returns, having written nothing beside the project."""
    without(victim, "manifest")
    key = pointers(victim)["manifest"]["key"]
    entry = remote.entry("manifest", key)
    data = forge(json.loads(remote.read(blob(entry["sidecar"]["files"]["manifest.json"]))))
    remote.write(blob(blake3(data).hexdigest()), data)
    remote.put_entry("manifest", key, with_files(remote, entry, {"manifest.json": blake3(data).hexdigest()}))
    around = beside(victim)
    run = attacked(victim, "pull:tiny", "--remote", remote.url, env=remote.env)
    assert run.rc != 0 and "Traceback" not in run.out and beside(victim) == around, run.out[-3000:]
    lines = [line for line in run.out.splitlines() if f"{remote.url}/ac/manifest/{key}.json" in line]
    assert len(lines) == 1 and lines[0].startswith("error: "), run.out[-3000:]
    return lines[0]


@ALSO
def test_a_pulled_manifest_naming_what_is_outside_the_stage_table_is_refused(victim, remote, stage, key):
    stage, key = named(victim, remote, stage, key)
    line = pulled_forged_manifest(victim, remote, lambda manifest: json.dumps(
        dict(manifest, artifacts={**manifest["artifacts"], stage: {"key": key}})).encode())
    assert "its manifest names" in line and "not a stage of the stage table" in line


def test_a_pulled_manifest_that_is_not_one_is_refused(victim, remote):
    assert "its manifest.json is not a manifest" in pulled_forged_manifest(victim, remote, lambda manifest: b"[]")


def test_a_blob_longer_than_its_entry_declares_is_refused(victim, remote):
    _, entry = plan_entry(victim, remote)
    path = blob(entry["sidecar"]["files"]["plan.json"])
    data = remote.read(path)
    remote.write(path, data + b" " * (4 << 20))
    assert_refused(victim, remote, f"is not a file of the {len(data)} bytes declared")


def test_a_blob_that_is_a_link_to_a_device_is_refused_unread(victim, dir_remote):
    remote, root = dir_remote
    _, entry = plan_entry(victim, remote)
    path = root / blob(entry["sidecar"]["files"]["plan.json"])
    path.unlink()
    path.symlink_to("/dev/zero")
    assert_refused(victim, remote, "is not a file of the")


def deep(entry: dict, depth: int) -> bytes:
    """The entry with `depth` nested lists in its run-time measurements (which no hash covers)."""
    text = json.dumps(dict(entry, sidecar=dict(entry["sidecar"], run={"deep": "DEEP"})), sort_keys=True)
    return text.replace('"DEEP"', "[" * depth + "]" * depth).encode()


def padded(entry: dict) -> bytes:
    """The entry as push writes it, then spaces (still JSON) to one byte past the cap."""
    data = json.dumps(entry, indent=1, sort_keys=True).encode()
    return data + b" " * (ENTRY_CAP + 1 - len(data))


@pytest.mark.parametrize("forge, why", [
    (lambda entry: b"{not json", "not JSON"),
    (lambda entry: b"[1, 2]", "not a JSON object"),
    (padded, f"at most {ENTRY_CAP >> 20} MiB"),
    (lambda entry: deep(entry, 40), "nested deeper than"),
    (lambda entry: deep(entry, 100_000), "nested deeper than"),
    (lambda entry: json.dumps(dict(entry, stage="base")).encode(), "it says it is the entry of 'base'"),
], ids=["not-json", "json-list", "over-the-cap", "nested-40", "nested-100000", "another-stage"])
def test_a_malformed_entry_is_refused(victim, remote, forge, why):
    key, entry = plan_entry(victim, remote)
    remote.write(f"ac/plan/{key}.json", forge(entry))
    assert_refused(victim, remote, why)


def test_an_entry_that_is_a_link_to_a_device_is_refused_unread(victim, dir_remote):
    remote, root = dir_remote
    key = pointers(victim)["plan"]["key"]
    (root / "ac" / "plan" / f"{key}.json").unlink()
    (root / "ac" / "plan" / f"{key}.json").symlink_to("/dev/zero")
    assert_refused(victim, remote, "not a file of at most")


def test_an_entry_pushed_without_sizes_is_refused_until_pushed_again(victim, remote, published):
    key, entry = plan_entry(victim, remote)
    log = published[0] / "artifacts" / "store" / "plan" / f"{key}.log"
    remote.put_entry("plan", key, {"stage": "plan", "key": key, "sidecar": entry["sidecar"], "log": hash_file(log),
                                   "also": []})  # as pushes before sizes wrote it
    assert_refused(victim, remote, "push it again with this one")

    again = doit(published[0], "push:tiny", "--remote", remote.url, env=remote.env)
    assert again.rc == 0, again.out[-3000:]
    assert remote.entry("plan", key) == entry


def test_run_measurements_that_readers_cannot_format_are_refused(victim, remote):
    """The sidecar's run (no hash covers it) is what show and the report format: seconds that are not a
    number crashed `doit show` after a fetch, and an entry without run failed the report's key."""
    key, entry = plan_entry(victim, remote)
    remote.put_entry("plan", key, dict(entry, sidecar=dict(entry["sidecar"], run={"seconds": "soon"})))
    assert_refused(victim, remote, "its run-time measurements has seconds 'soon', not a number of seconds")


def test_an_entry_without_run_measurements_is_refused(victim, remote):
    key, entry = plan_entry(victim, remote)
    remote.put_entry("plan", key, dict(entry, sidecar={k: v for k, v in entry["sidecar"].items() if k != "run"}))
    assert_refused(victim, remote, "its sidecar is not an object of inputs, run, files and a digest")


def forged_base(remote: Remote, n: int, also: list) -> str:
    """A self-consistent base entry with no files (inputs {"n": n} hashed to its key), naming `also`:
    what an attacker can write without any real artifact. Returns its key."""
    inputs = {"n": n}
    key = keys.key_of(inputs)
    remote.put_entry("base", key, {"stage": "base", "key": key, "log": None, "sizes": {}, "also": also,
                                   "sidecar": {"inputs": inputs, "run": {}, "files": {}, "digest": merkle({})}})
    return key


def test_only_a_manifests_entry_names_entries_to_install_with_it(victim, remote):
    base = forged_base(remote, 1, [])
    key, entry = plan_entry(victim, remote)
    remote.put_entry("plan", key, dict(entry, also=[["base", base]]))
    assert_refused(victim, remote, "it names entries to install with it, which only a manifest's entry does")


@pytest.mark.parametrize("attack", ["not-named-by-its-manifest", "a-chain", "missing"])
def test_a_manifests_also_installs_only_what_its_manifest_names_and_nothing_on_refusal(victim, remote, published,
                                                                                      attack):
    """A manifest's entry names, in `also`, upstream entries its manifest.json names under earlier keys.
    Naming anything else (a chain of forged entries each naming the next recursed until a
    RecursionError, installing hundreds first), or an entry the remote lacks, fails the pull in one line
    before anything of the manifest or of what it names is installed."""
    plan = pointers(victim)["plan"]["key"]
    for made in (published[0] / "artifacts" / "store" / "plan").glob(f"{plan}*"):  # only the manifest to pull
        (shutil.copytree if made.is_dir() else shutil.copy2)(made, victim / "artifacts" / "store" / "plan" / made.name)
    without(victim, "manifest")
    manifest_key = pointers(victim)["manifest"]["key"]
    if attack == "a-chain":
        forged = forged_base(remote, 0, [])
        for n in range(1, 4):
            forged = forged_base(remote, n, [["base", forged]])
        why = "it names entries to install with it, which only a manifest's entry does"
    elif attack == "missing":
        forged, why = "f" * 32, "which the remote lacks"
    else:
        forged, why = forged_base(remote, 0, []), "which its manifest.json does not name"
    remote.put_entry("manifest", manifest_key, dict(remote.entry("manifest", manifest_key), also=[["base", forged]]))
    store, around = snapshot(victim), beside(victim)
    run = attacked(victim, "pull:tiny", "--remote", remote.url, env=remote.env)
    assert run.rc != 0 and "Traceback" not in run.out and why in run.out, run.out[-3000:]
    lines = [line for line in run.out.splitlines() if line.startswith("error: ")]
    assert len(lines) == 1 and "/ac/" in lines[0], run.out[-3000:]
    objects = victim / "artifacts" / "store"
    assert not (objects / "manifest" / manifest_key).exists() and not (objects / "base" / forged).exists()
    assert snapshot(victim) == store and beside(victim) == around


def test_an_entry_swapped_for_a_fifo_after_the_look_is_refused_not_waited_on(tmp_path, monkeypatch):
    """A directory remote's entry checked by name, then opened by name, could be swapped for a FIFO in
    between: the open then waited for a writer forever (a build hung). The entry is opened first,
    without blocking, and checked on its handle: here the filesystem's look says a file (as it would
    before the swap) and the path is a FIFO."""
    import threading

    from stages.engine.remote import Rejected, Remote as Cache

    cache = Cache(str(tmp_path / "remote"))
    path = tmp_path / "remote" / "ac" / "plan" / f"{'0' * 32}.json"
    path.parent.mkdir(parents=True)
    os.mkfifo(path)
    monkeypatch.setattr(cache.fs, "info", lambda p, **kw: {"type": "file", "size": 100, "name": p})
    outcome = []
    reader = threading.Thread(target=lambda: outcome.append(pytest.raises(Rejected, cache.read_entry, "plan", "0" * 32)),
                              daemon=True)
    reader.start()
    reader.join(10)
    assert not reader.is_alive(), "read_entry waited on the FIFO"
    assert outcome and "not a file of at most" in str(outcome[0].value)
