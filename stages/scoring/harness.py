"""lm-eval's evaluation harness over the held-out docs, in memory (no YAML, no hub): the task
configs a data kind gives (stages/data/kinds/: what to measure on its rows) made into lm-eval
tasks over the docs, and run for one model."""
from __future__ import annotations

COMMON = {"test_split": "test", "num_fewshot": 0, "target_delimiter": "", "metadata": {"version": 1}}


def task_configs(tasks: list[dict], docs: list[dict]) -> list[dict]:
    """The kind's task configs over the docs as lm-eval's test split."""
    from datasets import Dataset

    data = Dataset.from_list(docs)

    def dataset(**_):  # lm-eval calls it with the task metadata as keyword arguments
        return {"test": data}

    return [{"custom_dataset": dataset, **COMMON, **task} for task in tasks]


def results(model, tok, configs: list[dict], settings) -> dict:
    """lm-eval's results of the task configs for one model (settings: the recipe's eval). Through
    lm-eval's evaluate, seeded as its simple_evaluate seeds, not simple_evaluate itself: that
    also gathers the machine's description for its report (torch's collect_env: nvidia-smi and
    pip in subprocesses, 0.5-1 s a model) which eval.json never shows."""
    import random

    import numpy as np
    import torch
    from lm_eval.evaluator import evaluate
    from lm_eval.tasks import TaskManager

    from stages.scoring.wide_lm import WideLM

    random.seed(0)
    np.random.seed(0)
    torch.manual_seed(0)
    lm = WideLM(pretrained=model.eval(), tokenizer=tok, batch_size=settings.batch_size,
                max_length=model.config.max_position_embeddings)
    tasks = TaskManager(include_defaults=False).load(configs)
    for task in tasks["tasks"].values():
        task.set_fewshot_seed(seed=0)
    return evaluate(lm=lm, task_dict=tasks, bootstrap_iters=0, log_samples=False, cache_requests=False,
                    apply_chat_template=False)["results"]
