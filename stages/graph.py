"""The stage table and the doit tasks made from it.

Each stage is deps + params + outs, nothing hidden: the recipe paths it reads,
the upstream files it reads (by pattern, so a stage that reads only shards/train/
is not invalidated by a change to shards/stats.json), the library versions that
shape its output, and its module. doit orders and runs the tasks; the store
decides what is up to date.
"""
from __future__ import annotations

import ast
import functools
import importlib
import importlib.metadata
import logging
import shutil
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from doit.exceptions import TaskFailed
from doit.reporter import ConsoleReporter

from stages import keys
from stages.errors import UserError
from stages.recipe import Recipe, load
from stages.store import Store, hash_file, merkle, select

ROOT = Path.cwd()
CODE_DIR = Path(__file__).resolve().parent


@dataclass(frozen=True)
class Stage:
    name: str
    module: str
    params: tuple[str, ...]
    upstream: dict[str, tuple[str, ...]] = field(default_factory=dict)
    packages: tuple[str, ...] = ()
    doc: str = ""


MODEL_FILES = ("config.json", "generation_config.json", "*.safetensors", "tokenizer*",
               "chat_template.jinja", "special_tokens_map.json")
TOKENIZER_FILES = ("tokenizer*", "chat_template.jinja", "special_tokens_map.json")
TRAINED = ("model/*", "adapter/*")

STAGES = {s.name: s for s in [
    Stage("base", "base", ("model",), {}, ("torch", "transformers"),
          "the base model + tokenizer as an artifact"),
    Stage("plan", "plan", ("hardware", "autotune", "train.method", "train.peft",
                           "train.micro_batch_size", "data.max_length"),
          {"base": ("config.json",)}, ("torch",),
          "plan.json: the decisions training applies verbatim"),
    Stage("shards", "shards", ("data", "train.method"), {"base": TOKENIZER_FILES},
          ("transformers", "tokenizers", "datasets", "datasketch", "blake3"),
          "tokenized, masked, packed shards + stats.json"),
    Stage("checkpoint", "checkpoint", ("train",),
          {"base": MODEL_FILES, "shards": ("train/*",), "plan": ("plan.json",)},
          ("torch", "transformers", "trl", "peft", "accelerate"),
          "trained weights or PEFT adapter + metrics.jsonl"),
    Stage("quantized", "quantized", ("quantize", "train.peft"),
          {"base": MODEL_FILES, "checkpoint": TRAINED, "shards": ("train/*",)},
          ("torch", "transformers", "peft", "amd-quark"),
          "Quark FP8 export in HF format (LoRA merged first)"),
    Stage("eval", "evaluate", ("eval", "train.peft"),
          {"base": MODEL_FILES, "checkpoint": TRAINED, "quantized": ("model/*",),
           "shards": ("heldout/*",)},
          ("torch", "transformers", "peft", "lm-eval", "amd-quark"),
          "eval.json from lm-eval: base, trained and quantized scored"),
    Stage("manifest", "manifest", ("",),
          {s: ("*",) for s in ("base", "plan", "shards", "checkpoint", "quantized", "eval")},
          (), "manifest.json: BLAKE3 of everything"),
]}


def recipe_names() -> list[str]:
    return sorted(p.stem for p in (ROOT / "recipes").glob("*.yaml"))


@functools.lru_cache(maxsize=None)
def recipe(name: str) -> Recipe:
    return load(Path("recipes") / f"{name}.yaml")


@functools.lru_cache(maxsize=None)
def store() -> Store:
    return Store(ROOT / "artifacts")


def module(stage: Stage):
    return importlib.import_module(f"stages.{stage.module}")


@functools.lru_cache(maxsize=None)
def code_files(module_name: str) -> tuple[str, ...]:
    """The stage module and every stages/ module it imports, transitively: a change to a
    helper it calls (checkpoint.load_trained for eval) changes its key too."""
    found, todo = set(), [module_name]
    while todo:
        name = todo.pop()
        if name in found:
            continue
        found.add(name)
        tree = ast.parse((CODE_DIR / f"{name}.py").read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("stages"):
                named = [node.module.split(".", 1)[1]] if "." in node.module else [a.name for a in node.names]
                todo += [n for n in named if (CODE_DIR / f"{n}.py").is_file()]
    return tuple(sorted(found))


def versions(packages) -> dict[str, str]:
    return {p: importlib.metadata.version(p) for p in packages}


@dataclass
class Context:
    """What a stage's build function gets: its inputs, never the store to mutate
    (except through `cached`, which adds whole, content-keyed objects)."""
    recipe_name: str
    recipe: Recipe
    root: Path
    key: str
    inputs: dict  # what the key was computed from
    upstream: dict[str, Path]
    work: Path
    log: logging.Logger
    run: dict = field(default_factory=dict)  # run-time measurements, kept beside the artifact

    def cached(self, part: str, inputs: dict, make) -> tuple[Path, bool]:
        """A piece of this stage's work (one data file's tokens, say) kept in the store under
        its own key: built by make(dir) once, committed atomically, reused by any later build
        whose inputs for it match, whatever else changed. Returns (its path, whether reused)."""
        stage, key, st = f"{self.inputs['stage']}-{part}", keys.key_of(inputs), store()
        reused = not st.damage(stage, key)
        if not reused:
            tmp = st.temp_dir(stage, key)
            try:
                make(tmp)
                st.commit(stage, key, tmp, {"inputs": inputs})
            finally:
                shutil.rmtree(tmp, ignore_errors=True)
        self.run.setdefault(part, {})[key] = "reused" if reused else "built"
        return st.path(stage, key), reused


def key_inputs(recipe_name: str, stage: Stage) -> dict:
    """Everything a stage's output depends on; raises UserError if an input is missing."""
    r, st, mod = recipe(recipe_name), store(), module(stage)
    upstream = {}
    for up, patterns in stage.upstream.items():
        ptr = st.pointer(recipe_name, up)
        meta = ptr and st.sidecar(up, ptr["key"])
        if meta is None:
            raise UserError(f"{stage.name}:{recipe_name}: upstream {up} is not built; run doit {up}:{recipe_name}")
        upstream[up] = merkle(select(meta["files"], patterns))
    inputs = {
        "stage": stage.name,
        "code": {f"stages/{m}.py": hash_file(CODE_DIR / f"{m}.py") for m in code_files(stage.module)},
        "params": {p: keys.recipe_slice(r, p) for p in stage.params},
        "upstream": upstream,
        "env": versions(stage.packages),
    }
    if hasattr(mod, "extra_inputs"):  # e.g. data files, device facts
        inputs["extra"] = mod.extra_inputs(r, ROOT, st)
    return inputs


def is_built(recipe_name: str, stage_name: str) -> bool:
    """doit uptodate: the key's object is in the store and intact (run-cache included)."""
    stage, st = STAGES[stage_name], store()
    try:
        key = keys.key_of(key_inputs(recipe_name, stage))
    except UserError:
        return False  # let the action run and report it
    if st.damage(stage.name, key):
        return False
    st.set_pointer(recipe_name, stage.name, key, st.sidecar(stage.name, key)["digest"])
    return True


def _logger(path: Path, name: str) -> logging.Logger:
    log = logging.getLogger(f"mindxtrain.{name}")
    log.handlers.clear()
    log.setLevel(logging.INFO)
    log.propagate = False
    fmt = logging.Formatter("%(asctime)s %(message)s")
    for h in (logging.FileHandler(path), logging.StreamHandler(sys.stdout)):
        h.setFormatter(fmt)
        log.addHandler(h)
    return log


def build(recipe_name: str, stage_name: str):
    """doit action: build one stage into a temp dir, then commit it to the store atomically."""
    stage, st = STAGES[stage_name], store()
    tmp = log_tmp = None
    try:
        inputs = key_inputs(recipe_name, stage)
        key = keys.key_of(inputs)
        tmp = st.temp_dir(stage.name, key)
        log_tmp = tmp.with_suffix(".log")
        log = _logger(log_tmp, f"{stage.name}.{recipe_name}")
        log.info("building %s:%s key=%s", stage.name, recipe_name, key)
        ptrs = {up: st.pointer(recipe_name, up) for up in stage.upstream}
        ctx = Context(recipe_name, recipe(recipe_name), ROOT, key, inputs,
                      {up: st.path(up, p["key"]) for up, p in ptrs.items()},
                      st.work_dir(stage.name, key), log)
        start = time.time()
        module(stage).build(ctx, tmp)
        ctx.run["seconds"] = round(time.time() - start, 3)
        meta = st.commit(stage.name, key, tmp, {"inputs": inputs, "run": ctx.run})
        log_tmp.replace(st.path(stage.name, key).with_suffix(".log"))
        st.set_pointer(recipe_name, stage.name, key, meta["digest"])
        log.info("built %s:%s digest=%s in %.1fs", stage.name, recipe_name, meta["digest"][:16],
                 ctx.run["seconds"])
        shutil.rmtree(ctx.work, ignore_errors=True)
    except UserError as e:
        return TaskFailed(str(e))
    finally:
        if tmp is not None and tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
        if log_tmp is not None and log_tmp.exists():
            log_tmp.unlink()


def stage_tasks(stage_name: str):
    """doit task generator: one subtask per recipe, e.g. checkpoint:tiny."""
    stage = STAGES[stage_name]
    yield {"basename": stage.name, "name": None, "doc": stage.doc}
    for name in recipe_names():
        yield {
            "name": name,
            "actions": [(build, [name, stage.name])],
            "uptodate": [(is_built, [name, stage.name])],
            "task_dep": [f"{up}:{name}" for up in stage.upstream],
            "verbosity": 2,
        }


class Reporter(ConsoleReporter):
    """doit's console reporter, but a stage's TaskFailed (bad input) prints as its own lines."""

    def _write_failure(self, result, write_exception=True):
        fail = result["exception"]
        if isinstance(fail, TaskFailed) and not fail.traceback:
            self.write(f"error: {fail.message}\n" if write_exception else "")
        else:
            super()._write_failure(result, write_exception)


(ROOT / "artifacts").mkdir(exist_ok=True)  # doit opens its DB there before any task runs
DOIT_CONFIG = {
    "default_tasks": ["manifest:tiny"],
    "backend": "sqlite3",
    "dep_file": "artifacts/doit.sqlite",
    "reporter": Reporter,
    "verbosity": 2,
}
