"""Where a build's output goes while a stage builds: the stage's own lines and its progress bars
to the terminal doit was started from; everything the libraries it calls print or log (Quark's
INFO lines and its config dump, transformers', PEFT's and lm-eval's warnings and progress bars, a
JIT compiler's lines, a subprocess's stderr) to the stage's log beside its artifact, with their
warnings counted so the stage's last line can say how many there were and where.

Library output is taken at the file descriptors (1 and 2), so what a C extension or a child
process writes goes to the log too. Progress bars are drawn only where the console is a
terminal: in a CI log or a pipe a build prints its stage lines and nothing that redraws, and no
colour codes. The log keeps each progress bar's last state and no colour codes either.
"""
from __future__ import annotations

import logging
import os
import re
import sys
import threading
from contextlib import contextmanager
from pathlib import Path

ANSI = re.compile(r"\x1b\[[0-?]*[ -/]*[@-~]")  # a colour (or cursor) control sequence
ONE_AT_A_TIME = threading.Lock()  # file descriptors are the process's: doit -P thread captures one stage at a time


def progress(console, iterable=None, **kwargs):
    """A tqdm progress bar on `console`, drawn only where that is a terminal (none at all where
    console is None: a stage built outside doit, as verify re-derives a manifest)."""
    from tqdm import tqdm

    shown = console is not None and console.isatty()
    return tqdm(iterable, file=console if shown else None, disable=not shown, **kwargs)


class Counter:
    """Counts the warnings libraries log while a stage builds: every log record of WARNING or
    above made by a logger that is not the project's (warnings.warn's too, while captured),
    whichever handlers the library gave its loggers and whatever it set them to propagate."""

    def __init__(self):
        self.warnings = 0
        self.make = logging.getLogRecordFactory()

    def __call__(self, *args, **kwargs):
        record = self.make(*args, **kwargs)
        if record.levelno >= logging.WARNING and not record.name.startswith("mindxtrain"):
            self.warnings += 1
        return record


def flush() -> None:
    for stream in {id(s): s for s in (sys.stdout, sys.stderr, sys.__stdout__, sys.__stderr__) if s}.values():
        try:
            stream.flush()
        except (OSError, ValueError):
            pass


class Captured:
    """What captured() gives a stage build: the console to print its own lines on, and the count
    of library warnings so far."""

    def __init__(self, console, counter: Counter):
        self.console, self.counter = console, counter

    @property
    def warnings(self) -> int:
        return self.counter.warnings


@contextmanager
def captured(log_path: Path):
    """While the block runs, file descriptors 1 and 2 (and so sys.stdout, sys.stderr, the handlers
    libraries made on them, and child processes) write to the end of log_path, warnings.warn and
    library log records of WARNING and above go there through the root logger, and each warning
    is counted. Yields a Captured whose console is where stdout was. Afterwards the log is tidied
    (tidy) and everything is as it was."""
    with ONE_AT_A_TIME:
        with _captured(log_path) as out:
            yield out


@contextmanager
def _captured(log_path: Path):
    flush()
    saved = os.dup(1), os.dup(2)
    console = os.fdopen(os.dup(saved[0]), "w", buffering=1, encoding="utf-8", errors="replace")
    target = os.open(log_path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    os.dup2(target, 1)
    os.dup2(target, 2)
    os.close(target)
    stdout = sys.__stdout__
    line_buffered = stdout.line_buffering if stdout else None
    if stdout:
        stdout.reconfigure(line_buffering=True)  # a library's print lands in the log in its place
    handler = logging.FileHandler(log_path, encoding="utf-8")
    handler.setFormatter(logging.Formatter("%(asctime)s %(name)s %(levelname)s: %(message)s"))
    logging.root.addHandler(handler)
    counter = Counter()
    logging.setLogRecordFactory(counter)
    logging.captureWarnings(True)
    try:
        yield Captured(console, counter)
    finally:
        logging.captureWarnings(False)
        logging.setLogRecordFactory(counter.make)
        logging.root.removeHandler(handler)
        handler.close()
        flush()
        os.dup2(saved[0], 1)
        os.dup2(saved[1], 2)
        for fd in saved:
            os.close(fd)
        if stdout:
            stdout.reconfigure(line_buffering=line_buffered)
        console.close()
        tidy(log_path)


def tidy(log_path: Path) -> None:
    """The log as a person reads it: no colour codes, each progress bar's redraws (carriage
    returns) down to its last state, no blank lines."""
    try:
        text = log_path.read_bytes().decode("utf-8", errors="replace")  # carriage returns as they are
    except FileNotFoundError:
        return
    lines = []
    for line in ANSI.sub("", text).split("\n"):
        line = next((part for part in reversed(line.split("\r")) if part.strip()), "").rstrip()
        if line:
            lines.append(line)
    log_path.write_text("\n".join(lines) + "\n" if lines else "", encoding="utf-8")
