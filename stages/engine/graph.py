"""The build engine: the stage table (stages/table.py) made into doit tasks, each stage's key
computed from its declared inputs, and a build committed to the store atomically.

Each stage is deps + params + outs, nothing hidden: the recipe paths it reads,
the upstream files it reads (by pattern, so a stage that reads only shards/train/
is not invalidated by a change to shards/stats.json), the library versions that
shape its output, and its code (its module and every stages/ module it imports). Its build
sees only those (stages/engine/declared.py). doit orders and runs the tasks; the store
decides what is up to date. The engine imports no stage: the table names them.
"""
from __future__ import annotations

import ast
import functools
import importlib
import importlib.metadata
import importlib.util
import logging
import platform
import shutil
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from doit.exceptions import InvalidDodoFile, TaskFailed
from doit.reporter import ConsoleReporter

from stages.engine import keys, remote
from stages.engine.declared import UndeclaredInput, recipe_view, upstream_view
from stages.engine.errors import UserError
from stages.engine.recipe import Recipe, check_name, load
from stages.engine.store import UNREADABLE, Store, hash_file, merkle, select

ROOT = Path.cwd()
CODE_ROOT = Path(__file__).resolve().parents[2]  # the directory that holds the stages package


@dataclass(frozen=True)
class Stage:
    """One row of the stage table: what the stage reads (recipe paths, upstream files by
    pattern, library versions) and the module whose build(ctx, out) makes its artifact."""
    name: str
    module: str  # dotted, e.g. stages.shards
    params: tuple[str, ...]
    upstream: dict[str, tuple[str, ...]] = field(default_factory=dict)
    packages: tuple[str, ...] = ()
    doc: str = ""
    after: tuple[str, ...] = ()  # actions (doit tasks that store nothing) run before it builds
    runs: tuple[str, ...] = ()  # upstream stages whose run-time measurements (sidecar "run") it reads
    # recipe paths the build may read that do not decide its artifact, kept out of the key: how to
    # reach the world (a node's URL, where the signing key is), or what the first write of a
    # write-once record says (anchor's uri: anchor.json holds what the chain holds)
    settings: tuple[str, ...] = ()
    # upstream stages read only where built for this build (built_for), with the files read of
    # each: the key says which are absent, and nothing waits on them or builds them (the report
    # shows the manifest's anchor where there is one; anchoring needs a chain, reporting does not)
    optional: dict[str, tuple[str, ...]] = field(default_factory=dict)


def recipe_names() -> list[str]:
    """The recipes of recipes/*.yaml; a file whose name cannot be a recipe name stops doit with
    one line before any task runs."""
    try:
        return sorted(check_name(p.relative_to(ROOT)) for p in (ROOT / "recipes").glob("*.yaml"))
    except UserError as e:
        raise InvalidDodoFile(str(e)) from None


@functools.lru_cache(maxsize=None)
def recipe(name: str) -> Recipe:
    return load(Path("recipes") / f"{name}.yaml")


@functools.lru_cache(maxsize=None)
def store() -> Store:
    return Store(ROOT / "artifacts")


def module(stage: Stage):
    return importlib.import_module(stage.module)


def source_file(module_name: str) -> Path | None:
    """The file of a stages module (None for a package or a name that is not a module)."""
    path = CODE_ROOT.joinpath(*module_name.split(".")).with_suffix(".py")
    return path if path.is_file() else None


@functools.lru_cache(maxsize=None)
def imported(module_name: str) -> tuple[str, ...]:
    """The stages modules one module imports (anywhere in it: imports inside functions count)."""
    found = set()
    for node in ast.walk(ast.parse(source_file(module_name).read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "stages":
            for name in [node.module] + [f"{node.module}.{a.name}" for a in node.names]:
                if source_file(name):  # `from stages.data import packed` names a module too
                    found.add(name)
    return tuple(sorted(found))


def code_files(module_names) -> dict[str, str]:
    """The code a stage runs: its module, the modules a recipe makes it run (a training
    method's), and every stages module these import, transitively; path -> BLAKE3. A module it
    does not import never changes its key."""
    found, todo = set(), list(module_names)
    while todo:
        name = todo.pop()
        if name not in found:
            found.add(name)
            todo += imported(name)
    return {source_file(m).relative_to(CODE_ROOT).as_posix(): hash_file(source_file(m)) for m in sorted(found)}


def versions(packages) -> dict[str, str]:
    """Installed versions ("python" is the interpreter's)."""
    return {p: platform.python_version() if p == "python" else importlib.metadata.version(p) for p in packages}


@dataclass
class Context:
    """What a stage's build function gets: its declared inputs only (the recipe as a view of
    its declared fields, each upstream artifact as a directory of its declared files), never
    the store to mutate (except through `cached`, which adds whole, content-keyed objects).
    `artifacts` holds each upstream's key, digest, declared files' hashes and key inputs."""
    recipe_name: str
    recipe: Recipe
    root: Path
    key: str
    inputs: dict  # what the key was computed from
    upstream: dict[str, Path]  # an optional upstream is here only where built for this build
    artifacts: dict[str, dict]  # per upstream stage: its key, digest and declared files' hashes
    work: Path
    log: logging.Logger
    run: dict = field(default_factory=dict)  # run-time measurements, kept beside the artifact

    def cached(self, part: str, inputs: dict, make) -> tuple[Path, bool]:
        """A piece of this stage's work (one data file's tokens, say) kept in the store under
        its own key: built by make(dir) once, committed atomically, reused by any later build
        whose inputs for it match, whatever else changed. Returns (its path, whether reused)."""
        stage, key, st = f"{self.inputs['stage']}-{part}", keys.key_of(inputs), store()
        with st.building(stage, key, lambda: self.log.info("%s %s: another build is making it; waiting", stage, key[:12])):
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


def upstream_artifacts(recipe_name: str, stage: Stage, table: dict[str, Stage]) -> dict[str, dict]:
    """Each upstream artifact the recipe resolves to: key, digest, and the files the stage
    declares it reads. A required upstream not built raises UserError; an optional one is
    there only where it is built for this build (built_for)."""
    st, found = store(), {}
    for up, patterns in stage.upstream.items():
        ptr = st.pointer(recipe_name, up)
        meta = ptr and st.sidecar(up, ptr["key"])
        if meta is None:
            raise UserError(f"{stage.name}:{recipe_name}: upstream {up} is not built; run doit {up}:{recipe_name}")
        found[up] = {"key": ptr["key"], "digest": meta["digest"], "files": select(meta["files"], patterns),
                     "inputs": meta["inputs"]}
    for up, patterns in stage.optional.items():
        built = built_for(recipe_name, table[up], table)
        if built is not None:
            found[up] = dict(built, files=select(built["files"], patterns))
    return found


def upstream_digests(stage: Stage, artifacts: dict[str, dict]) -> dict:
    """What a key holds of the upstream artifacts: the digest of the declared files of each, and
    for each optional upstream that digest or None (absent), so that its appearing changes the key."""
    found = {"upstream": {up: merkle(artifacts[up]["files"]) for up in stage.upstream}}
    if stage.optional:
        found["optional"] = {up: merkle(artifacts[up]["files"]) if up in artifacts else None for up in stage.optional}
    return found


def built_for(recipe_name: str, stage: Stage, table: dict[str, Stage]) -> dict | None:
    """The stage's artifact the recipe points at (key, digest, files) if it is intact and was
    built from the upstream artifacts the recipe resolves to now, else None: an anchor of an
    earlier manifest is not this build's. It reads the store only, never the stage's
    extra_inputs (the anchor's ask a chain), so a downstream key needs no network."""
    st = store()
    ptr = st.pointer(recipe_name, stage.name)
    meta = ptr and st.sidecar(stage.name, ptr["key"])
    if meta is None or st.damage(stage.name, ptr["key"]):
        return None
    try:
        now = upstream_digests(stage, upstream_artifacts(recipe_name, stage, table))
    except UserError:
        return None
    if any(meta["inputs"].get(part) != digests for part, digests in now.items()):
        return None
    return {"key": ptr["key"], "digest": meta["digest"], "files": meta["files"], "inputs": meta["inputs"]}


def key_inputs(recipe_name: str, stage: Stage, table: dict[str, Stage], full: Recipe | None = None,
               artifacts: dict[str, dict] | None = None) -> dict:
    """Everything a stage's output depends on, which is all its build may read: the recipe
    fields it declares, the digests of the upstream files it declares (and which optional
    upstreams are absent), its code, the versions of its libraries, and what its module's
    extra_inputs adds (data files' content, device facts). `full` is the recipe (by default
    recipes/<recipe_name>.yaml); `artifacts` the upstream artifacts (by default as
    upstream_artifacts finds them: a build passes those it will read). Raises UserError if an
    input is missing."""
    full = full or recipe(recipe_name)
    r, mod = recipe_view(full, stage.params, stage.name), module(stage)
    inputs = {
        "stage": stage.name,
        "code": code_files([stage.module, *(mod.code_modules(r) if hasattr(mod, "code_modules") else [])]),
        "params": {p: keys.recipe_slice(full, p) for p in stage.params},
        **upstream_digests(stage, artifacts if artifacts is not None else upstream_artifacts(recipe_name, stage, table)),
        "env": versions(stage.packages),
    }
    if hasattr(mod, "extra_inputs"):  # e.g. data files, device facts
        inputs["extra"] = mod.extra_inputs(r, ROOT, store())
    if stage.runs:  # measurements are not content, but a stage that shows them depends on them
        st = store()
        inputs["runs"] = {up: st.sidecar(up, st.pointer(recipe_name, up)["key"])["run"] for up in stage.runs}
    return inputs


def is_built(recipe_name: str, stage: Stage, table: dict[str, Stage]) -> bool:
    """doit uptodate: the key's object is in the store and intact (run-cache included), or a
    remote cache (MINDXTRAIN_REMOTE) has it and it has been installed."""
    st = store()
    try:
        key = keys.key_of(key_inputs(recipe_name, stage, table))
    except (UserError, UndeclaredInput):
        return False  # let the action run and report it
    if st.damage(stage.name, key) and not remote.fill(st, stage.name, key, f"{stage.name}:{recipe_name}", table):
        return False
    st.set_pointer(recipe_name, stage.name, key, st.sidecar(stage.name, key)["digest"])
    return True


def _logger(path: Path, name: str) -> logging.Logger:
    """The stage's log: everything (DEBUG up: per-step lines too) in the file beside the
    artifact; the console gets INFO, what a person follows a build by."""
    log = logging.getLogger(f"mindxtrain.{name}")
    log.handlers.clear()
    log.setLevel(logging.DEBUG)
    log.propagate = False
    fmt = logging.Formatter("%(asctime)s %(message)s")
    for h, level in ((logging.FileHandler(path), logging.DEBUG), (logging.StreamHandler(sys.stdout), logging.INFO)):
        h.setFormatter(fmt)
        h.setLevel(level)
        log.addHandler(h)
    return log


STORAGE_ADVICE = {"No space left on device": "free space on that disk (or move artifacts/ to a larger one)",
                  "Disk quota exceeded": "free space within your quota (or move artifacts/ elsewhere)",
                  "Read-only file system": "build where artifacts/ is writable"}


def storage_problem(e: Exception) -> str | None:
    """The storage failure behind an exception (an OSError, or a library's error wrapping one,
    such as safetensors' 'No space left on device (os error 28)'), or None for any other."""
    text = e.strerror if isinstance(e, OSError) and e.strerror else str(e)
    return next((problem for problem in STORAGE_ADVICE if problem in text), None)


def build(recipe_name: str, stage: Stage, table: dict[str, Stage]):
    """doit action: build one stage into a temp dir, then commit it to the store atomically.
    One build of a key at a time: a second doit building the same key waits, saying so, and
    then takes what the first one stored."""
    st = store()
    try:
        artifacts = upstream_artifacts(recipe_name, stage, table)  # read once: the key covers what the build reads
        inputs = key_inputs(recipe_name, stage, table, artifacts=artifacts)
        key = keys.key_of(inputs)
        waiting = lambda: print(f"{stage.name}:{recipe_name}: another build is making {key[:12]}; waiting for it",  # noqa: E731
                                flush=True)
        with st.building(stage.name, key, waiting):
            damage = st.damage(stage.name, key)
            if not damage:  # the other build finished it
                st.set_pointer(recipe_name, stage.name, key, st.sidecar(stage.name, key)["digest"])
                print(f"{stage.name}:{recipe_name}: built by the other build", flush=True)
                return None
            unreadable = [p for p in damage if UNREADABLE in p]
            if unreadable:  # not damage to rebuild over: the owner's permissions, theirs to mend
                raise UserError(f"{stage.name}:{recipe_name}: {unreadable[0]}; nothing was rebuilt")
            build_key(recipe_name, stage, inputs, key, artifacts)
    except (UserError, UndeclaredInput) as e:
        return TaskFailed(str(e))
    except Exception as e:
        problem = storage_problem(e)
        if problem is None:
            raise
        where = getattr(e, "filename", None) or st.root
        return TaskFailed(f"{stage.name}:{recipe_name}: cannot write {where}: {problem}; nothing was stored "
                          f"and nothing is lost: {STORAGE_ADVICE[problem]}, then run again")


def context(recipe_name: str, stage: Stage, full: Recipe, inputs: dict, key: str, artifacts: dict[str, dict],
            view: Path, log: logging.Logger) -> Context:
    """A build's Context: the recipe as the stage declares it, and under `view` a directory per
    upstream artifact holding links to its declared files."""
    st = store()
    upstream = upstream_view(view, {up: (st.path(up, a["key"]), a["files"]) for up, a in artifacts.items()})
    return Context(recipe_name, recipe_view(full, stage.params + stage.settings, stage.name), ROOT, key, inputs,
                   upstream, artifacts, st.work_dir(stage.name, key), log)


def build_key(recipe_name: str, stage: Stage, inputs: dict, key: str, artifacts: dict[str, dict]) -> None:
    """Build the stage's artifact for this key (its lock held) from the upstream artifacts its
    key was computed from, and commit it."""
    st = store()
    tmp = st.temp_dir(stage.name, key)
    log_tmp, view = tmp.with_suffix(".log"), tmp.with_suffix(".inputs")
    try:
        log = _logger(log_tmp, f"{stage.name}.{recipe_name}")
        log.info("building %s:%s key=%s", stage.name, recipe_name, key)
        ctx = context(recipe_name, stage, recipe(recipe_name), inputs, key, artifacts, view, log)
        start = time.time()
        module(stage).build(ctx, tmp)
        ctx.run["seconds"] = round(time.time() - start, 3)
        meta = st.commit(stage.name, key, tmp, {"inputs": inputs, "run": ctx.run})
        log_tmp.replace(st.path(stage.name, key).with_suffix(".log"))
        st.set_pointer(recipe_name, stage.name, key, meta["digest"])
        log.info("built %s:%s digest=%s in %.1fs", stage.name, recipe_name, meta["digest"][:16],
                 ctx.run["seconds"])
        shutil.rmtree(ctx.work, ignore_errors=True)
    finally:
        for leftover in (tmp, view):
            if leftover.exists():
                shutil.rmtree(leftover, ignore_errors=True)
        if log_tmp.exists():
            log_tmp.unlink()


def stage_tasks(stage: Stage, table: dict[str, Stage]):
    """doit task generator: one subtask per recipe, e.g. checkpoint:tiny. An optional upstream
    is no task_dep (doit has no order-only dependency): `doit anchor:tiny report:tiny` runs
    them in the order named."""
    yield {"basename": stage.name, "name": None, "doc": stage.doc}
    for name in recipe_names():
        yield {
            "basename": stage.name,
            "name": name,
            "actions": [(build, [name, stage, table])],
            "uptodate": [(is_built, [name, stage, table])],
            "task_dep": [f"{up}:{name}" for up in stage.upstream] + [f"{a}:{name}" for a in stage.after],
            "verbosity": 2,
        }


class StageTasks:
    """A doit task creator for one row of the stage table (doit takes any object with a
    create_doit_tasks method), so dodo.py makes every row a task without a function per stage."""

    def __init__(self, stage: Stage, table: dict[str, Stage]):
        self.stage, self.table = stage, table

    def create_doit_tasks(self):
        return stage_tasks(self.stage, self.table)


def task_creators(table: dict[str, Stage]) -> dict[str, StageTasks]:
    """dodo.py's namespace entries for the stage table: one task creator per stage."""
    return {f"stage_{name}": StageTasks(stage, table) for name, stage in table.items()}


class Reporter(ConsoleReporter):
    """doit's console reporter, but a stage's TaskFailed (bad input) prints as its own lines,
    and a run that reached any stage closes with a table: each stage task built or cached, its
    time, its digest, and where the receipt and the report are."""

    def __init__(self, outstream, options):
        super().__init__(outstream, options)
        self.rows: list[tuple[str, str, float | None]] = []
        self.started: dict[str, float] = {}

    def execute_task(self, task):
        self.started[task.name] = time.time()
        super().execute_task(task)

    def add_success(self, task):
        super().add_success(task)
        self.rows.append((task.name, "built", self.took(task)))

    def add_failure(self, task, fail):
        if isinstance(fail, TaskFailed) and fail.report and not fail.traceback:  # bad input: one line, no traceback
            self.write(f"error: {fail.message}\n")
        else:
            super().add_failure(task, fail)
        self.rows.append((task.name, "FAILED", self.took(task)))

    def took(self, task) -> float | None:
        """Seconds since the task began; None for one that never ran (its dependency failed)."""
        return time.time() - self.started[task.name] if task.name in self.started else None

    def skip_uptodate(self, task):
        super().skip_uptodate(task)
        self.rows.append((task.name, "cached", None))

    def complete_run(self):
        super().complete_run()
        st, lines, recipes = store(), [], {}
        for name, how, seconds in self.rows:
            stage, _, recipe_name = name.partition(":")
            ptr = st.pointer(recipe_name, stage) if recipe_name else None
            if ptr is None and how != "FAILED":
                continue  # not a stage task (check, verify, show...)
            took = f"{seconds:7.1f}s" if seconds is not None else " " * 8
            lines.append(f"  {name:<24} {how:<7}{took}  {ptr['digest'][:12] if ptr and how != 'FAILED' else ''}")
            recipes[recipe_name] = None  # in the order they ran
        if not lines:
            return
        self.write("summary\n" + "\n".join(lines) + "\n")
        for r in recipes:
            if st.pointer(r, "manifest"):
                report = "artifacts/%s/latest/report/report.html" % r if st.pointer(r, "report") else f"doit report:{r}"
                self.write(f"  {r}: receipt artifacts/{r}/latest/manifest/manifest.json; report {report}\n")


(ROOT / "artifacts").mkdir(exist_ok=True)  # doit opens its DB there before any task runs
DOIT_CONFIG = {
    "default_tasks": ["manifest:tiny"],
    "backend": "sqlite3",
    "dep_file": "artifacts/doit.sqlite",
    "reporter": Reporter,
    "verbosity": 2,
}
