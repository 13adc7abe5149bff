"""A receipt is self-consistent: a manifest edited after it was built, with the store's record of
its bytes recomputed so that every byte check passes, fails `doit verify` naming the first field
that does not match, however far the forger goes short of re-keying every artifact."""
from __future__ import annotations

import json
import os
import stat

import blake3

from conftest import doit
from stages.engine.keys import key_of
from stages.engine.store import merkle


def verify_lines(run) -> list[str]:
    return [line for line in run.out.splitlines() if line.startswith(("error: verify:", "verify:"))]


def forge(project, edit, rekey: bool = False) -> None:
    """Edit the recipe's manifest.json in the store and make the store's record agree: the
    file's BLAKE3 and the tree digest in its sidecar and pointer (and with rekey, its key too:
    the object moved to the hash of the inputs the edited manifest records)."""
    art = project / "artifacts"
    pointer = art / "tiny" / "manifest.json"
    key = json.loads(pointer.read_text())["key"]
    obj = art / "store" / "manifest" / key
    manifest = json.loads((obj / "manifest.json").read_text())
    replaced = edit(manifest)  # None: edited in place; else the new manifest, or its text
    manifest = manifest if replaced is None else replaced
    obj.chmod(0o755)
    (obj / "manifest.json").chmod(stat.S_IWUSR | stat.S_IRUSR)
    (obj / "manifest.json").write_text(manifest if isinstance(manifest, str) else
                                       json.dumps(manifest, indent=1, sort_keys=True) + "\n")
    sidecar = obj.with_suffix(".json")
    meta = json.loads(sidecar.read_text())
    meta["files"] = {"manifest.json": blake3.blake3((obj / "manifest.json").read_bytes()).hexdigest()}
    meta["digest"] = merkle(meta["files"])
    if rekey:
        meta["inputs"] = {"stage": "manifest", "code": manifest["code"], "params": manifest["recipe"],
                          "upstream": manifest["upstream"], "env": manifest["versions"],
                          "upstream_keys": {up: a["key"] for up, a in manifest["artifacts"].items()}}
        key = key_of(meta["inputs"])
        os.replace(obj, obj.with_name(key))
        sidecar.unlink()
        sidecar = obj.with_name(f"{key}.json")
        (art / "tiny" / "latest" / "manifest").unlink()
        (art / "tiny" / "latest" / "manifest").symlink_to(f"../../store/manifest/{key}")
    sidecar.write_text(json.dumps(meta))
    pointer.write_text(json.dumps({"key": key, "digest": meta["digest"]}))
    (art / "statcache.sqlite").unlink()


def set_lr(manifest):
    manifest["recipe"]["train"]["lr"] = 0.004


def test_an_intact_receipt_verifies(warm):
    run = doit(warm, "verify:tiny", "--full")
    assert run.rc == 0 and verify_lines(run) == ["verify: tiny: intact (every byte re-read)"], run.out[-2000:]


def test_an_edited_recipe_with_its_record_recomputed_fails_naming_the_field(warm):
    forge(warm, set_lr)
    for args in (["verify:tiny"], ["verify:tiny", "--full"]):
        run = doit(warm, *args)
        assert run.rc != 0 and "Traceback" not in run.out, run.out[-2000:]
        lines = verify_lines(run)
        assert lines[0].startswith("error: verify: tiny: manifest: recipe train.lr is 0.004 in the receipt, "
                                   "0.005 in what built it"), lines
        assert "verify: tiny: checkpoint: built from recipe train.lr 0.005, the receipt's recipe says 0.004" in lines


def test_a_receipt_rekeyed_to_its_edited_recipe_fails_at_the_artifact_built_from_the_old_one(warm):
    forge(warm, set_lr, rekey=True)
    run = doit(warm, "verify:tiny")
    assert run.rc != 0 and verify_lines(run) == [
        "error: verify: tiny: checkpoint: built from recipe train.lr 0.005, the receipt's recipe says 0.004"], run.out


def test_an_artifacts_recorded_inputs_edited_to_match_fail_its_key(warm):
    def edit(manifest):
        set_lr(manifest)
        manifest["artifacts"]["checkpoint"]["inputs"]["params"]["train"]["lr"] = 0.004

    forge(warm, edit, rekey=True)
    run = doit(warm, "verify:tiny")
    key = json.loads((warm / "artifacts" / "tiny" / "checkpoint.json").read_text())["key"]
    assert run.rc != 0 and verify_lines(run) == [
        f"error: verify: tiny: checkpoint: recipe train.lr is 0.004 in the receipt, 0.005 in what built it "
        f"(key {key[:12]})"], run.out


def test_an_edited_score_fails_naming_it(warm):
    def edit(manifest):
        manifest["eval"]["trained"] = {k: 1.0 for k in manifest["eval"]["trained"]}

    forge(warm, edit)  # scores are no input of any key: only re-deriving them finds this
    run = doit(warm, "verify:tiny")
    lines = verify_lines(run)
    assert run.rc != 0 and len(lines) == 1 and lines[0].startswith("error: verify: tiny: manifest: eval.trained.") \
        and "is 1.0 in the receipt; its inputs and artifacts give" in lines[0], run.out


def test_a_receipt_made_by_other_code_is_checked_and_says_it_was_not_re_derived(warm):
    manifest_code = warm / "stages" / "manifest.py"
    manifest_code.write_text(manifest_code.read_text() + "\n# a later edit\n")
    run = doit(warm, "verify:tiny")
    assert run.rc == 0 and verify_lines(run) == [
        "verify: tiny: intact (stat cache)",
        "verify: tiny: manifest: made by other code than this checkout's stages/manifest.py: its fields were not "
        "re-derived (doit manifest:tiny rebuilds it)"], run.out


def test_an_upstream_rebuilt_to_the_same_bytes_under_a_new_key_makes_a_new_receipt(warm):
    """Early cutoff keeps what reads only bytes, but the receipt records each artifact's key and
    the code that made it: new code in the quantized stage that writes the same export leaves eval
    cached and makes a manifest that names the new key, not one that still names the old."""
    module = warm / "stages" / "quantized.py"
    module.write_text(module.read_text() + "\n# the same exports, by code of another hash\n")
    run = doit(warm, "manifest:tiny")
    assert run.rc == 0, run.out[-2000:]
    assert run.stages_ran("tiny") == {"quantized", "manifest"}, run.out[-2000:]
    art = warm / "artifacts" / "tiny"
    recorded = json.loads((art / "latest" / "manifest" / "manifest.json").read_text())["artifacts"]
    assert recorded["quantized"]["key"] == json.loads((art / "quantized.json").read_text())["key"]
    run = doit(warm, "verify:tiny", "--full")
    assert run.rc == 0 and verify_lines(run) == ["verify: tiny: intact (every byte re-read)"], run.out[-2000:]


def test_a_receipt_with_malformed_artifacts_fails_in_one_line_each(warm, monkeypatch):
    """A hostile receipt of the wrong shape (artifacts not a mapping, an entry that is not one, a
    key that is not a key, a path out of the store, the manifest or a mapping the checks walk
    not a mapping, JSON nested past the parser's stack) fails verify with a line naming what is
    wrong: no traceback, nothing read outside the store. The first through `doit verify`, the
    rest through verify's own checks in this process (an exception would fail the test)."""
    import shutil

    from stages.engine import verify
    from stages.table import STAGES

    shapes = [
        lambda m: m.update(artifacts=["base", "plan"]),
        lambda m: m["artifacts"].update(plan="not an artifact"),
        lambda m: m["artifacts"]["plan"].update(key=["not", "a", "key"]),
        lambda m: m["artifacts"]["plan"].update(key="../../../../../../etc/hostname"),
        lambda m: m["artifacts"].update({"../escape": dict(m["artifacts"]["plan"])}),
        lambda m: [m],
        lambda m: m.update(upstream=["base"]),
        lambda m: m["artifacts"]["plan"]["inputs"].update(params=["hardware"]),
        lambda m: m["artifacts"]["eval"]["inputs"].update(upstream="shards"),
        lambda m: "[" * 100_000 + "]" * 100_000,  # deeper than the JSON parser's stack
    ]
    for n, edit in enumerate(shapes):
        project = warm.parent / f"malformed{n}"
        shutil.copytree(warm, project, symlinks=True)
        forge(project, edit)
        if n == 0:
            run = doit(project, "verify:tiny")
            assert run.rc != 0 and "Traceback" not in run.out, run.out[-3000:]
            assert verify_lines(run), run.out[-2000:]
            continue
        monkeypatch.chdir(project)
        found = verify.problems("tiny", False, STAGES) + verify.self_consistent("tiny", STAGES)[0]
        assert found and all(line.startswith("tiny: manifest: ") for line in found), (n, found)
