"""The stage table as doit tasks: one task per stage with a subtask per recipe (checkpoint:tiny),
up to date when the store has its key (stages/engine/build.py), and doit's configuration."""
from __future__ import annotations

from stages.engine.build import build, is_built
from stages.engine.console import Reporter
from stages.engine.project import recipe_tasks, root
from stages.engine.stage import Stage


def stage_tasks(stage: Stage, table: dict[str, Stage]):
    """doit task generator: one subtask per recipe, e.g. checkpoint:tiny. An optional upstream
    is no task_dep (doit has no order-only dependency): `doit anchor:tiny report:tiny` runs
    them in the order named."""
    return recipe_tasks(stage.name, stage.doc, lambda name: {
        "actions": [(build, [name, stage, table])],
        "uptodate": [(is_built, [name, stage, table])],
        "task_dep": [f"{up}:{name}" for up in stage.upstream] + [f"{a}:{name}" for a in stage.after],
    })


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


def doit_config() -> dict:
    """dodo.py's DOIT_CONFIG. doit opens its DB in artifacts/ before any task runs, so this
    makes artifacts/ (it runs when doit loads dodo.py)."""
    (root() / "artifacts").mkdir(exist_ok=True)
    return {
        "default_tasks": ["manifest:tiny"],
        "backend": "sqlite3",
        "dep_file": "artifacts/doit.sqlite",
        "reporter": Reporter,
        "verbosity": 2,
    }
