"""Stages whose libraries are slow to import build in a process forked from one that imported
them while the stages before them built.

Quark's import takes 12-20 s on the lent GPU hosts (it parses every transformers modeling file
to find MoE expert classes, and builds its C++ kernels on a new machine), a third of the
quantized and eval stages of an 8B build. The imports are the same whatever the model, so they
need not wait for training: when the last stage a preloading row reads starts to build
(checkpoint, for quantized), multiprocessing's fork server starts and imports the rows' modules
(`preload`) in a process of its own, on a core training leaves idle and not on the building
process's GIL; each such stage then builds in a child forked from it, which finds them
imported. A stage's `seconds` count from when its build began in the run's process, so time
spent waiting for the imports is in them. Where the machine has fewer than MIN_CPUS, training
needs every core, and nothing is preloaded; MINDXTRAIN_PRELOAD=always or never overrides that.

The server's own output (Quark's lines as it imports) goes to artifacts/work/preload.log; each
child writes to the console the run started with, and builds as any stage does
(stages/engine/build.py). A child ends as soon as the run's process does (killed, or ^C), and
the server too. Where the server cannot give a usable child (its imports initialized CUDA,
which a forked process cannot use, or the server is gone), the stage builds in the run's
process, as it would without preloading, and its log's first line says so.
"""
from __future__ import annotations

import json
import os
import sys
import threading
import time
import traceback

from stages.engine.errors import UserError

SWITCH = "MINDXTRAIN_PRELOAD"  # always, never, or (unset) where the machine has MIN_CPUS
# Below this many usable CPUs the server's imports take a share of the machine training needs (tiny
# on 2 cores: 26 s for the whole build against 23 s without); from it on they take a core training leaves idle
MIN_CPUS = 4
SERVER_ENV = "MINDXTRAIN_PRELOAD_SERVER"  # set only while the server starts: the modules, and where its output goes
CONSOLE: tuple[int, int] | None = None  # in the server and its children: the run's file descriptors 1 and 2
CUDA_TAKEN = False  # in the server: an import initialized CUDA, so its children cannot use the GPU
started = False  # in the run's process: the server is running


class NotForkable(Exception):
    """This server's children cannot build the stage (CUDA was initialized in it): build in the run's process."""


def wanted(stage, table: dict) -> list[str]:
    """The modules to preload when `stage` starts to build: where it is a stage that preloads, or
    the last stage (in table order) that one reads (checkpoint, for quantized: the imports then
    overlap training, the longest stage, and not the probe's measurements), those of every
    stage at or after it that preloads; else none."""
    order = list(table)
    preloading = [row for row in table.values() if row.preload]
    starts = {row.name for row in preloading} | {max(row.upstream, key=order.index) for row in preloading if row.upstream}
    if stage.name not in starts:
        return []

    def reaches(start, goal) -> bool:
        return start == goal or any(reaches(start, up) for up in (*table[goal].upstream, *table[goal].optional))

    modules: list[str] = []
    for row in preloading:
        if reaches(stage.name, row.name):
            modules += [m for m in row.preload if m not in modules]
    return modules


def start(modules: list[str], log_path) -> None:
    """Start the fork server (once a process), which imports `modules` in the background: where
    the machine has MIN_CPUS or more, or MINDXTRAIN_PRELOAD says always (never: not at all)."""
    global started
    switch = os.environ.get(SWITCH, "")
    if switch not in ("", "always", "never"):
        raise UserError(f"{SWITCH}={switch!r}: say always, never, or leave it unset (preload where the machine "
                        f"has {MIN_CPUS} CPUs or more)")
    if started or not modules or switch == "never" or (not switch and len(os.sched_getaffinity(0)) < MIN_CPUS):
        return
    import multiprocessing
    import multiprocessing.forkserver

    multiprocessing.get_context("forkserver").set_forkserver_preload([__name__])
    os.environ[SERVER_ENV] = json.dumps({"modules": modules, "log": str(log_path)})
    try:  # the server takes this process's environment and file descriptors as they are now
        multiprocessing.forkserver.ensure_running()
    finally:
        del os.environ[SERVER_ENV]
    started = True


def _serve() -> None:
    """In the fork server, at its import of this module: the run's console kept aside for the
    children, the server's own output to its log, and the modules imported. An import that fails
    is in the log and is tried again by the stage, which then reports it as its own failure."""
    global CONSOLE, CUDA_TAKEN
    spec = json.loads(os.environ.pop(SERVER_ENV))
    CONSOLE = os.dup(1), os.dup(2)
    os.makedirs(os.path.dirname(spec["log"]), exist_ok=True)
    log = os.open(spec["log"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(log, 1)
    os.dup2(log, 2)
    os.close(log)
    run = os.getppid()

    def watch():  # the run's process gone (its importing reparents this one): stop, even mid-import
        while os.getppid() == run:
            time.sleep(0.5)
        os._exit(0)

    threading.Thread(target=watch, daemon=True, name="run-watch").start()
    os.environ.setdefault("PYTORCH_NVML_BASED_CUDA_CHECK", "1")  # torch.cuda.is_available() without initializing CUDA
    for module in spec["modules"]:
        begun = time.monotonic()
        try:
            __import__(module)
            print(f"imported {module} in {time.monotonic() - begun:.1f}s", flush=True)
        except BaseException:  # noqa: BLE001 - the server must live on; the stage imports it again and says why
            traceback.print_exc()
    torch = sys.modules.get("torch")
    CUDA_TAKEN = bool(torch is not None and torch.cuda.is_initialized())
    if CUDA_TAKEN:
        print("an import initialized CUDA: stages build in the run's process instead", flush=True)
    sys.stdout.flush()
    sys.stderr.flush()


if SERVER_ENV in os.environ and CONSOLE is None:
    _serve()


def _child(function, args, cwd: str, begun: float):
    """In a child of the server: the run's console back on 1 and 2, its working directory, a
    watch that ends this process with the run's, then function(*args, begun, where)."""
    if CUDA_TAKEN or CONSOLE is None:
        raise NotForkable()
    os.dup2(CONSOLE[0], 1)
    os.dup2(CONSOLE[1], 2)
    os.chdir(cwd)
    import multiprocessing

    run = multiprocessing.parent_process()

    def watch():
        run.join()
        os._exit(1)  # the run is gone: nobody will take this build; its temporary directory is left as a kill leaves it

    threading.Thread(target=watch, daemon=True, name="run-watch").start()
    return function(*args, begun, f"in a process forked from the preload server (pid {os.getppid()})")


def run(stage, function, *args):
    """function(*args, begun, where) in a child of the fork server where `stage` preloads and the
    server runs, else here; `begun` is when this started (time.monotonic(), the same clock in every
    process), `where` a few words on which process runs it. Its result, or its exception raised here."""
    begun = time.monotonic()
    if not (stage.preload and started):
        return function(*args, begun, "in the run's process")
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor

    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_initialized():
        torch.cuda.empty_cache()  # what this process's allocator holds from earlier stages is the child's to use
    with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("forkserver"), max_tasks_per_child=1) as pool:
        try:
            future = pool.submit(_child, function, args, os.getcwd(), begun)  # forks the child, or fails
        except (OSError, EOFError) as e:  # the server is gone: build here, as without preloading
            return function(*args, begun, f"in the run's process (the preload server is gone: {e})")
        try:
            return future.result()
        except NotForkable:
            return function(*args, begun, "in the run's process (an import in the preload server initialized CUDA, "
                                          "which a forked process cannot use: artifacts/work/preload.log)")
