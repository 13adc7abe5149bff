"""mindxtrain: `doit manifest:<recipe>` builds recipes/<recipe>.yaml; `doit verify` checks receipts.

A thin table: every stage's logic lives in stages/, and stages.graph turns the
stage table into doit tasks (one subtask per recipe).
"""
from stages import graph, verify

DOIT_CONFIG = graph.DOIT_CONFIG


def task_base():
    return graph.stage_tasks("base")


def task_plan():
    return graph.stage_tasks("plan")


def task_shards():
    return graph.stage_tasks("shards")


def task_checkpoint():
    return graph.stage_tasks("checkpoint")


def task_quantized():
    return graph.stage_tasks("quantized")


def task_eval():
    return graph.stage_tasks("eval")


def task_manifest():
    return graph.stage_tasks("manifest")


def task_verify():
    return verify.tasks()
