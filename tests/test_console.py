"""What a build prints: a stage's own lines on the console, what its libraries print or log in
its log (stages/engine/terminal.py), and the closing summary's times (stages/engine/console.py).
A whole build's console is checked in test_builds.py (a fresh tiny_lora build); these check the
parts without building anything."""
from __future__ import annotations

import io
import os
import subprocess
import sys
import time

from conftest import REPO

LIBRARIES = r'''
import logging, subprocess, sys, warnings
from pathlib import Path
from stages.engine import terminal

# as AMD Quark logs: its own logger, a handler on stderr with colours, no propagation
screen = logging.getLogger("somelib_screen")
handler = logging.StreamHandler()
handler.setFormatter(logging.Formatter("\x1b[32m\n[LIB-%(levelname)s]: %(message)s\x1b[0m"))
screen.addHandler(handler)
screen.setLevel(logging.INFO)
screen.propagate = False
with terminal.captured(Path(sys.argv[1])) as out:
    print("a library's print")
    screen.info("an info line")
    screen.warning("a warning line")
    logging.getLogger("otherlib").warning("a warning through the root logger")
    warnings.warn("a warnings.warn")
    subprocess.run(["sh", "-c", "echo a child process on its stderr >&2"])
    sys.stderr.write("\rloading: 1/2\rloading: 2/2\n")
    bar = terminal.progress(out.console, range(3), desc="a stage's bar")
    list(bar)
    out.console.write("the stage's own line\n")
    out.console.write(f"{out.warnings} warnings\n")
print("after the stage")
'''


def test_library_output_goes_to_the_stage_log_and_its_warnings_are_counted(tmp_path):
    log = tmp_path / "stage.log"
    run = subprocess.run([sys.executable, "-c", LIBRARIES, str(log)], capture_output=True, text=True,
                         env={**os.environ, "PYTHONPATH": str(REPO)}, cwd=tmp_path)
    assert run.returncode == 0, run.stderr
    # the console (not a terminal here): the stage's own lines only, no progress bar, no colour
    assert run.stdout == "the stage's own line\n3 warnings\nafter the stage\n" and run.stderr == ""
    text = log.read_text()
    for line in ("a library's print", "[LIB-INFO]: an info line", "[LIB-WARNING]: a warning line",
                 "otherlib WARNING: a warning through the root logger", "UserWarning: a warnings.warn",
                 "a child process on its stderr", "loading: 2/2"):
        assert line in text, (line, text)
    assert "loading: 1/2" not in text and "\x1b" not in text and "\r" not in text and "\n\n" not in text


def test_on_a_terminal_the_stage_draws_its_progress_bar_and_libraries_still_go_to_the_log(tmp_path):
    import pty

    log = tmp_path / "stage.log"
    main, terminal = pty.openpty()
    run = subprocess.run([sys.executable, "-c", LIBRARIES, str(log)], stdout=terminal, stderr=subprocess.PIPE,
                         env={**os.environ, "PYTHONPATH": str(REPO)}, cwd=tmp_path, timeout=60)
    os.close(terminal)
    shown = b""
    while True:
        try:
            chunk = os.read(main, 1 << 16)
        except OSError:  # the terminal's other end is closed: all read
            break
        if not chunk:
            break
        shown += chunk
    os.close(main)
    assert run.returncode == 0, run.stderr
    text = shown.decode()
    assert "a stage's bar: 100%" in text and "the stage's own line" in text, text
    assert "a library's print" not in text and "LIB-" not in text and "child process" not in text, text
    assert "a library's print" in log.read_text() and "a stage's bar" not in log.read_text()


def test_times_in_the_summary_are_never_negative(tmp_path, monkeypatch):
    """The wall clock can step back while a task runs (NTP, a resumed VM): the summary's times
    come from the monotonic clock."""
    from doit.exceptions import TaskFailed
    from doit.task import Task

    from stages.engine import project
    from stages.engine.console import Reporter

    monkeypatch.chdir(tmp_path)  # a project with nothing built
    project.store.cache_clear()
    clock = iter([1000.0, 999.5])
    monkeypatch.setattr(time, "time", lambda: next(clock, 999.5))
    out = io.StringIO()
    reporter = Reporter(out, {})
    task = Task("verify:tiny", [(lambda: None, [])])
    reporter.execute_task(task)
    reporter.add_failure(task, TaskFailed("verify: tiny: something differs"))
    reporter.complete_run()
    project.store.cache_clear()
    row = out.getvalue().splitlines()[-1].split()
    assert row[:2] == ["verify:tiny", "FAILED"] and float(row[2].rstrip("s")) >= 0, out.getvalue()
