"""Building a stage: its key computed from its declared inputs (stages/engine/inputs.py), its
module's build(ctx, out) run on a Context that shows it only those, and its artifact committed
to the store atomically, with its log beside it. doit asks is_built whether a stage is up to
date and runs build when it is not.
"""
from __future__ import annotations

import logging
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TextIO

from doit.exceptions import TaskFailed

from stages.engine import keys, preload, remote, terminal
from stages.engine.declared import UndeclaredInput, recipe_view, upstream_view
from stages.engine.errors import UserError
from stages.engine.inputs import key_inputs, upstream_artifacts
from stages.engine.project import located, recipe, root, store
from stages.engine.recipe import Recipe
from stages.engine.stage import Stage, module
from stages.engine.store import UNREADABLE


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
    console: TextIO | None = None  # the terminal doit runs in (the stage's output goes to its log)

    def progress(self, iterable=None, **kwargs):
        """A tqdm progress bar on the console, drawn only where that is a terminal: a build whose
        output goes to a file or a pipe prints no redraws."""
        return terminal.progress(self.console, iterable, **kwargs)

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


def _logger(path: Path, name: str, console: TextIO | None) -> logging.Logger:
    """The stage's log: everything (DEBUG up: per-step lines too) in the file beside the
    artifact, with the time; the console gets INFO, the few lines a person follows a build by."""
    log = logging.getLogger(f"mindxtrain.{name}")
    _close(log)  # an earlier build's handlers in this process
    log.setLevel(logging.DEBUG)
    log.propagate = False
    handlers = [(logging.FileHandler(path, encoding="utf-8"), logging.DEBUG, "%(asctime)s %(message)s")]
    if console is not None:
        handlers.append((logging.StreamHandler(console), logging.INFO, "   %(message)s"))
    for h, level, fmt in handlers:
        h.setFormatter(logging.Formatter(fmt))
        h.setLevel(level)
        log.addHandler(h)
    return log


def _close(log: logging.Logger) -> None:
    for h in list(log.handlers):
        log.removeHandler(h)
        h.close()


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
            preload.start(preload.wanted(stage, table), st.root / "work" / "preload.log")
            warned = preload.run(stage, build_key, recipe_name, stage, recipe(recipe_name), inputs, key, artifacts)
            return {"library_warnings": warned}  # for the run's closing summary (console.py)
    except (UserError, UndeclaredInput) as e:
        return TaskFailed(str(located(recipe_name, e)))
    except Exception as e:
        problem = storage_problem(e)
        if problem is None:
            raise
        where = getattr(e, "filename", None) or st.root
        return TaskFailed(f"{stage.name}:{recipe_name}: cannot write {where}: {problem}; nothing was stored "
                          f"and nothing is lost: {STORAGE_ADVICE[problem]}, then run again")


def context(recipe_name: str, stage: Stage, full: Recipe, inputs: dict, key: str, artifacts: dict[str, dict],
            view: Path, log: logging.Logger, console: TextIO | None = None) -> Context:
    """A build's Context: the recipe as the stage declares it, and under `view` a directory per
    upstream artifact holding links to its declared files."""
    st = store()
    upstream = upstream_view(view, {up: (st.path(up, a["key"]), a["files"]) for up, a in artifacts.items()})
    return Context(recipe_name, recipe_view(full, stage.params + stage.settings, stage.name), root(), key, inputs,
                   upstream, artifacts, st.work_dir(stage.name, key), log, console=console)


def shown_path(path: Path) -> str:
    """A path in the project as a person types it there."""
    return str(path.relative_to(root())) if path.is_relative_to(root()) else str(path)


def build_key(recipe_name: str, stage: Stage, full: Recipe, inputs: dict, key: str, artifacts: dict[str, dict],
              begun: float | None, where: str) -> int:
    """Build the stage's artifact for this key (its lock held) from `full` (the recipe) and the
    upstream artifacts its key was computed from, and commit it. What the libraries print or
    log while it builds goes to its log (stages/engine/terminal.py), which is kept beside the
    artifact, or beside where it would be, as <key>.failed.log, when the build fails other than
    on bad input. The console gets the stage's own lines: what its module's summary() says of
    the artifact, and one line with its time, digest, and the library warnings in its log. The
    time is the module's build's, or from `begun` (time.monotonic()) where the run's process
    handed the build to the preload worker; `where` says which process builds it
    (stages/engine/preload.py). Returns how many warnings there were."""
    st = store()
    tmp = st.temp_dir(stage.name, key)
    log_tmp, view = tmp.with_suffix(".log"), tmp.with_suffix(".inputs")
    final_log, failed_log = st.path(stage.name, key).with_suffix(".log"), st.path(stage.name, key).with_suffix(".failed.log")
    log = None
    try:
        with terminal.captured(log_tmp) as out:
            log = _logger(log_tmp, f"{stage.name}.{recipe_name}", out.console)
            log.debug("building %s:%s key=%s %s", stage.name, recipe_name, key, where)
            ctx = context(recipe_name, stage, full, inputs, key, artifacts, view, log, out.console)
            begun = time.monotonic() if begun is None else begun
            module(stage).build(ctx, tmp)
            ctx.run["seconds"] = round(time.monotonic() - begun, 3)
            meta = st.commit(stage.name, key, tmp, {"inputs": inputs, "run": ctx.run})
            st.set_pointer(recipe_name, stage.name, key, meta["digest"])
            summary = getattr(module(stage), "summary", None)
            for line in summary(st.path(stage.name, key)) if summary else []:
                log.info("%s", line)
            warned = out.warnings
            where = f"; {warned} library warning{'s' if warned != 1 else ''} in {shown_path(final_log)}" if warned else ""
            log.info("built %s:%s in %.1fs, digest %s%s", stage.name, recipe_name, ctx.run["seconds"],
                     meta["digest"][:12], where)
            _close(log)
        log_tmp.replace(final_log)
        failed_log.unlink(missing_ok=True)
        shutil.rmtree(ctx.work, ignore_errors=True)
        return warned
    except (UserError, UndeclaredInput):
        raise  # bad input: its one line is the whole report
    except BaseException as e:
        if log_tmp.exists():  # what the libraries printed before it failed
            log_tmp.replace(failed_log)
        if failed_log.exists() and not (isinstance(e, Exception) and storage_problem(e)):
            print(f"{stage.name}:{recipe_name}: failed; its log, with what the libraries printed: "
                  f"{shown_path(failed_log)}", flush=True)
        raise
    finally:
        if log is not None:
            _close(log)
        for leftover in (tmp, view):
            if leftover.exists():
                shutil.rmtree(leftover, ignore_errors=True)
        if log_tmp.exists():
            log_tmp.unlink()
