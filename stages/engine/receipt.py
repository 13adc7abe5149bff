"""A receipt is self-consistent: every key a manifest names is the hash of the inputs it records
for that artifact, those inputs are the receipt's own recipe and the digests of the upstream
files it records, and manifest.json is what the manifest stage makes of them.

The byte checks (stages/engine/verify.py) find a file that differs from its recorded hash; they
cannot find a manifest edited together with the store's record of its bytes (its recipe's lr,
a score). These checks can: they name the first field that does not match. What no check can
catch: someone with write access to the store who re-keys every object they touch as a rebuild
with other inputs would (docs/security.md says what a receipt proves and what it cannot).
"""
from __future__ import annotations

import json
import logging
import tempfile
from pathlib import Path

from pydantic import ValidationError

from stages.engine import jsontext, keys
from stages.engine.build import context
from stages.engine.inputs import code_files
from stages.engine.names import is_digest, named, path_problem
from stages.engine.project import store
from stages.engine.recipe import Recipe
from stages.engine.stage import module
from stages.engine.store import merkle, select, shown


def first_difference(built, receipt, path: str = "") -> tuple[str, object, object] | None:
    """The first dotted path (sorted) where two JSON values differ, with both values there."""
    if isinstance(built, dict) and isinstance(receipt, dict):
        for k in sorted(set(built) | set(receipt)):
            found = first_difference(built.get(k), receipt.get(k), f"{path}.{k}" if path else k)
            if found:
                return found
        return None
    return None if built == receipt else (path, built, receipt)


def short(value) -> str:
    text = json.dumps(value)
    return shown(text if len(text) <= 60 else text[:57] + "...")


def at(value, dotted: str):
    """The JSON value at a dotted path ('' is the whole), or None where the path is absent."""
    for part in filter(None, dotted.split(".")):
        value = value.get(part) if isinstance(value, dict) else None
    return value


FIELDS = {"params": "recipe", "env": "version of", "code": "code", "upstream": "upstream", "extra": "input",
          "upstream_keys": "key of"}


def shape_problem(manifest, table: dict) -> str | None:
    """Why a manifest cannot be read as a receipt (None if it can): a forged one's stage names,
    keys and file paths become store paths (stages/engine/names.py), and the mappings the checks
    walk must be mappings, so that no field of the wrong shape ends in a traceback."""
    if not isinstance(manifest, dict):
        return "it is not a JSON object; rebuild the manifest"
    artifacts = manifest.get("artifacts")
    if not isinstance(artifacts, dict):
        return "its artifacts are not a mapping of stage to artifact; rebuild the manifest"
    for field in ("recipe", "upstream"):
        if not isinstance(manifest.get(field, {}), dict):
            return f"its {field} is not a mapping"
    for stage, art in artifacts.items():
        if not isinstance(art, dict) or not named(stage, art.get("key"), table):
            return f"its artifacts name {shown(str(stage))} with no key of 32 hex digits, or no such stage"
        files = art.get("files")
        if not isinstance(files, dict) or not all(isinstance(rel, str) and path_problem(rel) is None and is_digest(d)
                                                  for rel, d in files.items()):
            return f"its {stage} artifact's files are not relative paths inside the artifact with BLAKE3 digests"
        inputs = art.get("inputs", {})
        if not isinstance(inputs, dict) or not all(isinstance(inputs.get(f, {}), dict) for f in ("params", "upstream")):
            return f"its {stage} artifact's inputs, or their params or upstream, are not mappings"
    return None


def own_inputs(manifest: dict) -> dict:
    """The manifest's key inputs, which its fields record (the upstream keys: its artifacts'), of a
    manifest shape_problem passed."""
    return {"stage": "manifest", "code": manifest.get("code"), "params": manifest.get("recipe"),
            "upstream": manifest.get("upstream"), "env": manifest.get("versions"),
            "upstream_keys": {up: a["key"] for up, a in manifest["artifacts"].items()}}


def key_problem(what: str, key: str, inputs: dict, stored: dict | None) -> str | None:
    """Why `inputs` do not hash to `key`, naming the first field that differs from the inputs the
    store recorded for the key (stored), where it recorded any; None when they hash to it."""
    if keys.key_of(inputs) == key:
        return None
    found = first_difference(stored, inputs) if isinstance(stored, dict) else None
    if found:
        path, built, now = found
        part, _, rest = path.partition(".")
        named = f"{FIELDS.get(part, part)} {rest}".strip()
        return f"{what}: {shown(named)} is {short(now)} in the receipt, {short(built)} in what built it (key {key[:12]})"
    return f"{what}: its key {key[:12]} is not the hash of the inputs the receipt records for it"


def upstream_problem(what: str, recorded: dict, patterns: dict, artifacts: dict) -> str | None:
    """Whether the upstream digests an artifact was built from are those of the upstream files the
    receipt records (as the stage table selects them)."""
    for up, digest in sorted(recorded.items()):
        if up not in artifacts:
            return f"{what}: built from {shown(up)}, which the receipt does not record"
        if up in patterns and merkle(select(artifacts[up]["files"], patterns[up])) != digest:
            return f"{what}: built from other {up} files than the receipt's {up} holds"
    return None


def artifact_problems(manifest: dict, table: dict) -> list[str]:
    """For each artifact the manifest names: its key is the hash of its recorded inputs, which
    were computed from the receipt's recipe and upstream files. The first problem of each."""
    st, found = store(), []
    artifacts = manifest.get("artifacts") or {}
    for stage in sorted(artifacts, key=lambda s: list(table).index(s) if s in table else len(table)):
        art, what = artifacts[stage], shown(stage)
        inputs = art.get("inputs")
        if not isinstance(inputs, dict):
            found.append(f"{what}: the receipt records no inputs for it; rebuild the manifest")
            continue
        stored = st.sidecar(stage, art["key"]) or {}
        problem = key_problem(what, art["key"], inputs, stored.get("inputs"))
        for param, value in sorted((inputs.get("params") or {}).items()):
            if problem is None and at(manifest["recipe"], param) != value:
                path, built, now = first_difference(value, at(manifest["recipe"], param), param)
                problem = (f"{what}: built from recipe {shown(path)} {short(built)}, the receipt's recipe says "
                           f"{short(now)}")
        row = table.get(stage)
        problem = problem or upstream_problem(what, inputs.get("upstream") or {}, row.upstream if row else {}, artifacts)
        if problem:
            found.append(problem)
    return found


def rederived(recipe_name: str, manifest: dict, key: str, text: str, table: dict) -> str | None:
    """Build manifest.json again from the receipt's recorded inputs and upstream artifacts, as a
    rebuild would, and name the first field of the stored one that differs (None if none)."""
    stage = table["manifest"]
    try:
        recipe = Recipe.model_validate(manifest["recipe"])
    except ValidationError as e:
        return f"manifest: its recipe is not a valid recipe ({e.errors()[0]['msg']})"
    artifacts = {up: dict(art, files=select(art["files"], stage.upstream.get(up, ())))
                 for up, art in manifest["artifacts"].items()}
    log = logging.getLogger("mindxtrain.verify.receipt")
    log.addHandler(logging.NullHandler())
    log.propagate = False
    with tempfile.TemporaryDirectory(prefix="receipt-") as tmp:
        ctx = context(manifest.get("recipe_name", recipe_name), stage, recipe, own_inputs(manifest), key,
                            artifacts, Path(tmp) / "inputs", log)
        (Path(tmp) / "out").mkdir()
        module(stage).build(ctx, Path(tmp) / "out")
        again = (Path(tmp) / "out" / "manifest.json").read_text()
    if again == text:
        return None
    found = first_difference(json.loads(again), json.loads(text))
    if found is None:
        return "manifest: manifest.json is not laid out as the manifest stage writes it (edited by hand?)"
    path, built, now = found
    return f"manifest: {shown(path)} is {short(now)} in the receipt; its inputs and artifacts give {short(built)}"


def problems(recipe_name: str, key: str, text: str, table: dict) -> tuple[list[str], list[str]]:
    """(problems, notes) of the receipt manifest.json (text) stored under `key`: the manifest's own
    key, each artifact's, and the manifest re-derived from them. Its files are intact already."""
    try:
        manifest = jsontext.loads(text)
    except ValueError:  # not JSON, or nested deeper than jsontext lets the parser go
        return ["manifest: manifest.json is not JSON"], []
    shape = shape_problem(manifest, table)
    if shape:
        return [f"manifest: {shape}"], []
    inputs = own_inputs(manifest)
    if any(v is None for v in inputs.values()):
        return [f"manifest: the receipt records no inputs (made before receipts did); rebuild it with "
                f"doit manifest:{recipe_name}"], []
    stored = store().sidecar("manifest", key) or {}
    found = [p for p in (key_problem("manifest", key, inputs, stored.get("inputs")),
                         upstream_problem("manifest", inputs["upstream"], table["manifest"].upstream,
                                          manifest["artifacts"])) if p]
    found += artifact_problems(manifest, table)
    if found:
        return found, []
    if code_files([table["manifest"].module]) != manifest["code"]:
        return [], ["manifest: made by other code than this checkout's stages/manifest.py: its fields were not "
                    "re-derived (doit manifest:%s rebuilds it)" % recipe_name]
    problem = rederived(recipe_name, manifest, key, text, table)
    return ([problem] if problem else []), []
