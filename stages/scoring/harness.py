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
    """lm-eval's results of the task configs for one model (settings: the recipe's eval)."""
    import lm_eval
    from lm_eval.tasks import TaskManager

    from stages.scoring.wide_lm import WideLM

    lm = WideLM(pretrained=model.eval(), tokenizer=tok, batch_size=settings.batch_size,
                max_length=model.config.max_position_embeddings)
    out = lm_eval.simple_evaluate(
        model=lm, tasks=configs,
        task_manager=TaskManager(include_defaults=False), num_fewshot=0, apply_chat_template=False,
        bootstrap_iters=0, log_samples=False, cache_requests=False,
        random_seed=0, numpy_random_seed=0, torch_random_seed=0, fewshot_random_seed=0)
    return out["results"]
