"""What a doit run prints: doit's console reporter, but a stage's one-line errors stay one
line, and a run that reached any stage closes with a summary of what it built."""
from __future__ import annotations

import time

from doit.exceptions import TaskFailed
from doit.reporter import ConsoleReporter

from stages.engine.project import store


class Reporter(ConsoleReporter):
    """doit's console reporter, but a stage's TaskFailed (bad input) prints as its own lines,
    and a run that reached any stage closes with a table: each stage task built or cached, its
    time, its digest, the library warnings in its log, and where the receipt and the report are.
    Times are taken on the monotonic clock: the wall clock stepping back (NTP, a VM resumed)
    never makes one negative."""

    def __init__(self, outstream, options):
        super().__init__(outstream, options)
        self.rows: list[tuple[str, str, float | None, int]] = []
        self.started: dict[str, float] = {}

    def execute_task(self, task):
        self.started[task.name] = time.monotonic()
        if not task.name.endswith(":+all"):  # a verb's own closing task (status's overview, verify's count):
            super().execute_task(task)  # its lines say what it is, without a title no recipe has

    def add_success(self, task):
        super().add_success(task)
        warned = task.values.get("library_warnings", 0)
        self.rows.append((task.name, "built", self.took(task), warned))

    def add_failure(self, task, fail):
        if isinstance(fail, TaskFailed) and fail.report and not fail.traceback:  # bad input: one line, no traceback
            self.write(f"error: {fail.message}\n")
        else:
            super().add_failure(task, fail)
        self.rows.append((task.name, "FAILED", self.took(task), 0))

    def took(self, task) -> float | None:
        """Seconds since the task began; None for one that never ran (its dependency failed)."""
        return time.monotonic() - self.started[task.name] if task.name in self.started else None

    def skip_uptodate(self, task):
        super().skip_uptodate(task)
        self.rows.append((task.name, "cached", None, 0))

    def complete_run(self):
        super().complete_run()
        st, lines, recipes = store(), [], {}
        for name, how, seconds, warned in self.rows:
            stage, _, recipe_name = name.partition(":")
            ptr = st.pointer(recipe_name, stage) if recipe_name else None
            if ptr is None and how != "FAILED":
                continue  # not a stage task (check, verify, show...)
            took = f"{seconds:7.1f}s" if seconds is not None else " " * 8
            digest = ptr["digest"][:12] if ptr and how != "FAILED" else ""
            warnings = f"  {warned} library warning{'s' if warned != 1 else ''}" if warned else ""
            lines.append(f"  {name:<24} {how:<7}{took}  {digest}{warnings}".rstrip())
            recipes[recipe_name] = None  # in the order they ran
        if not lines:
            return
        self.write("summary\n" + "\n".join(lines) + "\n")
        for r in recipes:
            if st.pointer(r, "manifest"):
                report = "artifacts/%s/latest/report/report.html" % r if st.pointer(r, "report") else f"doit report:{r}"
                self.write(f"  {r}: receipt artifacts/{r}/latest/manifest/manifest.json; report {report}\n")
