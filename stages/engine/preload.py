"""Stages whose libraries are slow to import build in a worker process that imported them
while the stages before them built.

Quark's import takes 12-20 s on the lent GPU hosts (it parses every transformers modeling file
to find MoE expert classes, and builds its C++ kernels on a new machine), a third of the
quantized and eval stages of an 8B build. The imports are the same whatever the model, so they
need not wait for training: when the last stage a preloading row reads starts to build
(checkpoint, for quantized), a worker process starts and imports the rows' modules (`preload`),
on a core training leaves idle and not on the building process's GIL; the preloading stages
then build in that worker, one after another, from the recipe the run's process computed their
keys from, as they would in the run's process. Such a stage's `seconds` count from when the
run's process handed it over, so time spent waiting for the imports is in them. Where the
machine has fewer than MIN_CPUS, training needs every core, and nothing is preloaded;
MINDXTRAIN_PRELOAD=always or never overrides that. Tasks run in processes of their own (doit -n N)
build in themselves.

The worker is spawned, not forked: Quark's import initializes CUDA, which a process forked after
it cannot use (measured on an H100). So in the worker CUDA starts before a stage applies the
plan's environment block: what the runtime reads only as it starts (ROCm's HIP_FORCE_DEV_KERNARG,
a launch-latency setting) does not take effect there; cuBLAS's workspace, read at the first
matmul, does (the 8B shape's quantized and eval digests were the same on an H100). Its imports'
output (Quark's lines) goes to artifacts/work/preload.log; while it builds it writes to the
console the run started with, and builds as any stage does (stages/engine/build.py). It ends with
the run's process, however that ends (killed, ^C, done); ^C is the run's to act on.
"""
from __future__ import annotations

import atexit
import os
import pickle
import signal
import sys
import threading
import time
import traceback
from pathlib import Path

from stages.engine import terminal
from stages.engine.errors import UserError

SWITCH = "MINDXTRAIN_PRELOAD"  # always, never, or (unset) where the machine has MIN_CPUS
# Below this many usable CPUs the worker's imports take a share of the machine training needs (tiny
# on 2 cores: 26 s for the whole build against 23 s without); from it on they take a core training leaves idle
MIN_CPUS = 4
worker = None  # in the run's process: the Worker, once started
STARTING = threading.Lock()  # doit -n N -P thread: two tasks may start at once
ENDING_S = 30  # how long the run's exit waits for a worker that built to end


class RemoteFailure(Exception):
    """The worker's traceback of an exception raised there (the exception itself is raised here)."""


class Worker:
    """A spawned process that imports `modules` and then runs calls sent to it, one at a time."""

    def __init__(self, modules: list[str], log_path: str):
        import multiprocessing

        spawn = multiprocessing.get_context("spawn")
        self.conn, theirs = spawn.Pipe()
        # it takes this process's environment and file descriptors (the console) as they are now
        self.process = spawn.Process(target=_serve, args=(theirs, modules, log_path), name="mindxtrain-preload")
        self.process.start()
        theirs.close()
        self.called, self.lock = False, threading.Lock()  # one call at a time (doit -n N -P thread runs tasks on threads)
        atexit.register(self.end)  # before multiprocessing's own exit joins it

    def end(self) -> None:
        """At the run's exit. One that built leaves its loop as its pipe closes and exits as a
        process should: terminated, it left a lock (tqdm's) to the resource tracker, which warned
        of a leaked semaphore on the console. One that only imported (the run ended before a
        preloading stage) is terminated, not waited for."""
        self.conn.close()
        if self.called:
            self.process.join(ENDING_S)
        self.process.terminate()

    def call(self, function, *args):
        self.called = True
        try:
            with self.lock:
                self.conn.send((function, args))
                ok, value, trace = self.conn.recv()
        except EOFError:
            self.process.join(5)
            raise RuntimeError(f"the preload worker ended (exit code {self.process.exitcode}) while it built; "
                               f"run again (the store commits whole objects, so it holds that build whole or "
                               f"not at all)") from None
        except BaseException:  # ^C here: the build there is no one's now
            self.process.terminate()
            raise
        if ok:
            return value
        raise value from RemoteFailure(trace)


def wanted(stage, table: dict) -> list[str]:
    """The modules to preload when `stage` starts to build: where it is a stage that preloads, or
    the last stage (in table order) that one reads (checkpoint, for quantized: the imports then
    overlap training, the longest stage, and not the probe's measurements), those of every
    preloading stage it leads to; else none."""
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


def usable_cpus() -> int:
    """The CPUs this process may run on (its affinity, which a container or taskset narrows; all
    of them on macOS, which has no affinity call)."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def start(modules: list[str], log_path) -> None:
    """Start the worker (once a process), which imports `modules` in the background: where the
    machine has MIN_CPUS or more, or MINDXTRAIN_PRELOAD says always (never: not at all)."""
    global worker
    switch = os.environ.get(SWITCH, "")
    if switch not in ("", "always", "never"):
        raise UserError(f"{SWITCH}={switch!r}: say always, never, or leave it unset (preload where the machine "
                        f"has {MIN_CPUS} CPUs or more)")
    import multiprocessing

    if (not modules or switch == "never" or (not switch and usable_cpus() < MIN_CPUS)
            or multiprocessing.parent_process() is not None):  # a task process of doit -n N: it would outlive its task
        return
    # spawned while no other task's build has the file descriptors on its log (doit -n N -P thread)
    with terminal.ONE_AT_A_TIME, STARTING:
        if worker is None:
            worker = Worker(modules, str(log_path))


def _serve(conn, modules: list[str], log_path: str) -> None:
    """The worker: a watch that ends it with the run's process, the imports (their output to
    log_path; one that fails is in that log, and the stage imports it again and says why), then
    each call sent, answered with its result or its exception and traceback."""
    import multiprocessing

    signal.signal(signal.SIGINT, signal.SIG_IGN)  # ^C reaches the whole process group: the run decides
    run = multiprocessing.parent_process()

    def watch():
        run.join()
        os._exit(1)  # the run is gone: nobody will take what this builds; a temporary directory is left as a kill leaves it

    threading.Thread(target=watch, daemon=True, name="run-watch").start()
    log = Path(log_path)
    log.parent.mkdir(parents=True, exist_ok=True)
    log.write_text("")  # this run's imports only
    with terminal.captured(log):  # as a stage's library output goes to its log
        for module in modules:
            begun = time.monotonic()
            try:
                __import__(module)
                print(f"imported {module} in {time.monotonic() - begun:.1f}s", flush=True)
            except Exception:  # noqa: BLE001 - the worker must live on to build
                traceback.print_exc()
    while True:
        try:
            function, args = conn.recv()
        except EOFError:
            return
        try:
            conn.send((True, function(*args), None))
        except BaseException as e:  # noqa: BLE001 - every failure goes back to the run, as it would be raised there
            trace = traceback.format_exc()
            try:
                pickle.loads(pickle.dumps(e))  # what the run's process will unpickle
            except Exception:  # noqa: BLE001 - an exception that does not come back whole goes back as its text
                e = RuntimeError(f"{type(e).__name__}: {e}")
            conn.send((False, e, trace))


def _build(function, args, cwd: str, begun: float):
    os.chdir(cwd)
    return function(*args, begun, f"in the preload worker (pid {os.getpid()})")


def run(stage, function, *args):
    """function(*args, begun, where) in the worker where `stage` preloads and the worker runs, with
    `begun` when this process handed it over (time.monotonic(), the same clock in every process);
    else here, with begun None. `where` says which process runs it. Its result, or its exception
    raised here."""
    if not (stage.preload and worker is not None):
        return function(*args, None, "in the run's process")
    if not worker.process.is_alive():
        return function(*args, None, f"in the run's process (the preload worker ended, exit code {worker.process.exitcode})")
    with terminal.ONE_AT_A_TIME:  # one build at a time, as captured() keeps them in this process
        torch = sys.modules.get("torch")
        if torch is not None and torch.cuda.is_initialized():
            torch.cuda.empty_cache()  # what this process's allocator holds from earlier stages is the worker's to use
        return worker.call(_build, function, args, os.getcwd(), time.monotonic())
