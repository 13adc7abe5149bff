"""mindxtrain: `doit manifest:<recipe>` builds recipes/<recipe>.yaml; `doit verify` checks receipts.

Thin: every row of the stage table (stages/table.py) becomes a doit task with one subtask
per recipe (stages/engine/tasks.py); verify, show, status, push and pull are the engine's own
tasks; check, serve, publish and coach are actions.
"""
from stages import check, coach, publish, serve
from stages.engine import catalogue, show, status, sync, tasks, verify
from stages.table import STAGES

DOIT_CONFIG = tasks.doit_config()
globals().update(tasks.task_creators(STAGES))


def task_verify():
    return verify.tasks(STAGES)


def task_show():
    return show.tasks(STAGES)


def task_check():
    return check.tasks(STAGES)


def task_status():
    return status.tasks(STAGES)


def task_recipes():
    return catalogue.task()


def task_serve():
    return serve.tasks()


def task_coach():
    return coach.task(STAGES)


def task_publish():
    return publish.tasks(STAGES)


def task_push():
    return sync.tasks(STAGES, "push")


def task_pull():
    return sync.tasks(STAGES, "pull")
