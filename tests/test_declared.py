"""Declared inputs are the only inputs: a stage's build reads only the recipe fields and the
upstream files its row of the stage table declares, and its key covers exactly those, its
code included. The field-by-field check is generated from the recipe schema, so a new field
is covered without a new test."""
from __future__ import annotations

import json
import subprocess
import sys
import typing
from pathlib import Path

import pytest
import yaml
from pydantic import BaseModel, ValidationError

from conftest import REPO, doit
from stages.engine.declared import UndeclaredInput, covers, recipe_view, upstream_view
from stages.engine.recipe import Recipe
from stages.table import STAGES

TINY = yaml.safe_load((REPO / "recipes" / "tiny.yaml").read_text())
TINY_LORA = yaml.safe_load((REPO / "recipes" / "tiny_lora.yaml").read_text())
# bases whose other sources make the rest of the schema's fields changeable on their own
HUB_MODEL = {**TINY, "model": {"hub": "Qwen/Qwen3-0.6B", "revision": "c1899de289a04d12100db370d81485cdf75e47ca"}}
PATH_MODEL = {**TINY, "model": {"path": "models/qwen3"}}
HUB_DATA = {**TINY, "data": {**TINY["data"], "sources": [{"hub": "openai/gsm8k", "revision": "e53f048856ff4f594e959d75785d2c2d37b678ee", "subset": "main"}]}}
# a registry is pinned with its chain (one without the other does not validate)
ANCHORED = {**TINY, "anchor": {"registry": "0x5FbDB2315678afecb367f032d93F642f64180aa3", "chain_id": 31337}}
BASES = {"tiny": TINY, "tiny_lora": TINY_LORA, "hub_model": HUB_MODEL, "path_model": PATH_MODEL, "hub_data": HUB_DATA,
         "anchored": ANCHORED}


def test_a_view_holds_only_the_declared_fields():
    recipe = Recipe.model_validate(TINY)
    view = recipe_view(recipe, STAGES["plan"].params, "plan")
    assert view.train.micro_batch_size == 8 and view.data.max_length == 256
    assert view.train.global_batch == 8  # a property reads its fields through the view
    assert view.hardware.profile == "cpu" and view.train.lora.r == 8
    with pytest.raises(UndeclaredInput, match="stage plan read recipe field train.lr, which its row"):
        view.train.lr
    with pytest.raises(UndeclaredInput, match="recipe field eval"):
        view.eval
    narrow = recipe_view(recipe, ("train.micro_batch_size",), "demo")
    with pytest.raises(UndeclaredInput, match="train.grad_accum"):
        narrow.train.global_batch
    assert recipe_view(recipe, ("",), "manifest") is recipe  # the whole recipe, as it is


def test_an_upstream_view_holds_only_the_declared_files(tmp_path):
    obj = tmp_path / "store" / "shards" / "k"
    (obj / "train").mkdir(parents=True)
    (obj / "heldout").mkdir()
    for rel in ("stats.json", "train/shard-00000.safetensors", "heldout/heldout.jsonl"):
        (obj / rel).write_text(rel)
    views = upstream_view(tmp_path / "view", {"shards": (obj, {"heldout/heldout.jsonl": "d"})})
    assert (views["shards"] / "heldout" / "heldout.jsonl").read_text() == "heldout/heldout.jsonl"
    assert not (views["shards"] / "stats.json").exists() and not (views["shards"] / "train").exists()


def annotation_values(annotation, value) -> list:
    """Values other than `value` that a field of this annotation may take, most likely valid first."""
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if origin is typing.Literal:
        return [a for a in args if a != value]
    if origin in (typing.Union, getattr(__import__("types"), "UnionType")):
        return [v for a in args if a is not type(None) for v in annotation_values(a, value)]
    if origin is list:
        return [["q_proj", "v_proj"]]
    if annotation is bool:
        return [not value]
    if annotation is int:
        return [1, 2] if value is None else [value + 1, value * 2]
    if annotation is float:
        return [0.5, 0.25] if value is None else [round(value * 0.9, 6), round(value * 0.5 + 0.01, 6)]
    if annotation is str:
        return ["x", "x/y"] if value is None else [value + "x"]  # x/y: a field that takes owner/name
    return []


def mutations(model: type[BaseModel], data: dict, path: tuple = ()):
    """(path, candidate (path, value) changes) for every leaf field of the schema under `model`
    that can take another value (a one-valued Literal cannot)."""
    for name, info in model.model_fields.items():
        value = data.get(name) if isinstance(data, dict) else None
        inner = [a for a in (info.annotation, *typing.get_args(info.annotation)) if isinstance(a, type) and issubclass(a, BaseModel)]
        lists = [a for a in typing.get_args(info.annotation) if isinstance(a, type) and issubclass(a, BaseModel)] \
            if typing.get_origin(info.annotation) is list else []
        if lists:  # a list of sections: the fields of its first element
            yield from ((p, m) for p, m in mutations(lists[0], (value or [{}])[0], path + (name, 0)))
        elif inner:
            yield from mutations(inner[0], value if isinstance(value, dict) else {}, path + (name,))
        elif not (typing.get_origin(info.annotation) is typing.Literal and len(typing.get_args(info.annotation)) == 1):
            value = value if value is not None else info.default
            yield path + (name,), [(path + (name,), v) for v in annotation_values(info.annotation, value) if v != value]


def changed(recipe: dict, path: tuple, value) -> dict:
    out = json.loads(json.dumps(recipe))
    node = out
    for part in path[:-1]:
        node = node.setdefault(part, {}) if isinstance(part, str) else node[part]
    node[path[-1]] = value
    return out


def dotted(path: tuple) -> str:
    return ".".join(str(p) for p in path if not isinstance(p, int))


def key_changes(project: Path) -> dict:
    """In a built project: for every leaf of the schema, on the first base recipe where changing it
    validates, which stages' keys change (a stage whose key cannot be computed for the new value,
    with a one-line UserError, counts as changed: it cannot be reused)."""
    import os

    os.chdir(project)
    from stages.engine import keys
    from stages.engine.errors import UserError
    from stages.engine.inputs import key_inputs

    def stage_keys(recipe: Recipe) -> dict:
        out = {}
        for name, stage in STAGES.items():
            try:
                out[name] = keys.key_of(key_inputs("tiny", stage, STAGES, recipe))
            except UserError as e:
                out[name] = f"error: {e}"
        return out

    before = {name: stage_keys(Recipe.model_validate(base)) for name, base in BASES.items()}
    found = {}
    for path, candidates in mutations(Recipe, TINY):
        for base_name, base in BASES.items():
            try:
                after = next(stage_keys(r) for r in (Recipe.model_validate(changed(base, p, v))
                                                     for p, v in candidates if _valid(changed(base, p, v))))
            except StopIteration:
                continue
            found[dotted(path)] = sorted(s for s in STAGES if after[s] != before[base_name][s])
            break
        else:
            found[dotted(path)] = None
    return found


def _valid(recipe: dict) -> bool:
    try:
        Recipe.model_validate(recipe)
        return True
    except ValidationError:
        return False


def test_every_recipe_field_changes_exactly_the_keys_of_the_stages_that_declare_it(warm):
    out = subprocess.run([sys.executable, "-c", "import json, sys, test_declared as t; "
                          "print(json.dumps(t.key_changes(__import__('pathlib').Path(sys.argv[1]))))", str(warm)],
                         cwd=warm, capture_output=True, text=True, env={**__import__("os").environ,
                                                                         "PYTHONPATH": f"{warm}:{REPO / 'tests'}"})
    assert out.returncode == 0, out.stderr[-3000:]
    found = json.loads(out.stdout.splitlines()[-1])
    assert "train.lora.r" in found and "data.dedupe.num_perm" in found and "serve.port" in found
    wrong = {}
    for field, stages in found.items():
        declared = sorted(s for s, row in STAGES.items() if covers(row.params, field))
        if stages != declared:  # (None: no change of the field validates in any base recipe)
            wrong[field] = {"keys changed": stages, "declared by": declared}
    assert not wrong, wrong


def test_a_stage_that_reads_an_undeclared_field_fails_naming_it(warm):
    plan = warm / "stages" / "plan.py"
    plan.write_text(plan.read_text().replace('    facts = device_facts(r.hardware)\n',
                                             '    facts = device_facts(r.hardware)\n    r.train.lr\n'))
    run = doit(warm, "plan:tiny")  # (its code changed: a new key, so it builds)
    assert run.rc != 0
    assert "error: stage plan read recipe field train.lr, which its row of the stage table" in run.out, run.out


def test_a_stage_cannot_open_an_upstream_file_it_does_not_declare(warm):
    evaluate = warm / "stages" / "eval.py"
    evaluate.write_text(evaluate.read_text().replace(
        "    settings = ctx.recipe.eval\n", "    settings = ctx.recipe.eval\n    (ctx.upstream['shards'] / 'stats.json').read_text()\n"))
    run = doit(warm, "eval:tiny")
    assert run.rc != 0 and "FileNotFoundError" in run.out and "stats.json" in run.out, run.out[-2000:]
    assert any((warm / "artifacts" / "store" / "shards").glob("*/stats.json"))  # the file is there, unseen


def code_of(project: Path, stage: str) -> list[str]:
    key = json.loads((project / "artifacts" / "tiny" / f"{stage}.json").read_text())["key"]
    return sorted(json.loads((project / "artifacts" / "store" / stage / f"{key}.json").read_text())["inputs"]["code"])


def test_a_stage_key_covers_the_code_it_runs_and_nothing_else(warm):
    plan, evaluate = code_of(warm, "plan"), code_of(warm, "eval")
    assert {"stages/train/autotune.py", "stages/train/settings.py", "stages/train/methods.py"} <= set(plan)
    assert not {"stages/checkpoint.py", "stages/train/trainer.py"} & set(plan)
    assert not [f for f in plan if f.startswith("stages/data/")]  # editing a data reader never re-plans
    assert {"stages/data/render.py", "stages/model/trained.py", "stages/data/kinds/chat.py"} <= set(evaluate)
    assert not {"stages/data/word_cache.py", "stages/data/skeleton.py", "stages/data/template.py",
                "stages/checkpoint.py", "stages/data/kinds/prompt.py"} & set(evaluate)  # only the recipe's kind
    assert "stages/data/kinds/chat.py" in code_of(warm, "shards")
    checkpoint = code_of(warm, "checkpoint")
    assert "stages/train/sft.py" in checkpoint and "stages/train/dpo.py" not in checkpoint  # the recipe's method's
    assert not [f for f in checkpoint if f.startswith("stages/data/kinds/")]  # a kind's code never retrains

    trainer = warm / "stages" / "train" / "trainer.py"
    trainer.write_text(trainer.read_text() + "\n# a change to the trainer's code\n")
    run = doit(warm, "manifest:tiny")
    assert run.rc == 0, run.out[-2000:]
    assert run.stages_ran() >= {"checkpoint"} and not run.stages_ran() & {"base", "plan", "shards"}


def test_the_device_that_runs_a_model_is_in_the_keys_of_the_stages_that_run_one():
    """quantized and eval run on a GPU in bf16 where there is one, on the CPU in fp32 otherwise:
    different bytes from the same inputs, so the device is part of their keys (and the plan's)."""
    from stages import eval as evaluate
    from stages import plan, quantized
    from stages.engine.recipe import HardwareSection

    assert quantized.extra_inputs(None, REPO, None) == evaluate.extra_inputs(None, REPO, None) == {"device": "cpu"}
    assert plan.device_facts(HardwareSection(profile="cpu"))["device"] == "cpu"
