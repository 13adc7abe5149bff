"""The table of training methods: one row per value of train.method, every fact about a method
in one place, read by the plan (the step shape its probe measures), the shards stage (the data
kind), the checkpoint stage (the module, TRL's trainer, the head, the logs kept) and the eval
stage (the kind's held-out scoring, the metrics reported).

Adding a method whose data kind exists is one module and one row: write
stages/train/<method>.py with `dataset(shards, tok)` (its TRL dataset from the shards) and
`make_trainer(method, model, dataset, tok, plan, t, output_dir)` (TRL's trainer, built from
this row), add its row here and its name to train.method's values in stages/engine/recipe.py
(tests/test_methods.py holds the two lists equal). A method with a data kind of its own also
adds the kind's module, stages/data/kinds/<kind>.py (that package's docstring says what it holds).

This module imports no other stages module and names the kinds and method modules as strings:
the plan's key covers this table, and so neither the data kinds' code nor the trainers'.
"""
from __future__ import annotations

import importlib
from dataclasses import dataclass

PEFT_TASKS = {"causal_lm": "CAUSAL_LM", "score": "SEQ_CLS"}  # PEFT's task type for each head


@dataclass(frozen=True)
class Method:
    name: str
    module: str  # dotted: dataset(shards, tok) and make_trainer(method, model, dataset, tok, plan, t, output_dir)
    kind: str  # what its shards hold: the module stages/data/kinds/<kind>.py
    trainer: str  # TRL's trainer class, dotted
    config: str  # TRL's config class for it, dotted
    metrics: tuple[str, ...]  # what eval.json reports of each model on the held-out rows
    sequences: int = 1  # sequences one example runs through the model at once: a preference pair is two
    sampled: bool = False  # a completion of up to train.max_completion_length tokens is sampled after each prompt
    head: str = "causal_lm"  # or "score": a one-output scoring head on the base (a reward model)
    logs: tuple[str, ...] = ()  # TRL's own per-step figures kept in metrics.jsonl beside the loss

    @property
    def kind_module(self) -> str:
        return f"stages.data.kinds.{self.kind}"

    @property
    def peft_task(self) -> str:
        return PEFT_TASKS[self.head]

    def step_shape(self, t, max_length: int) -> tuple[int, int]:
        """(sequences per example, tokens per sequence) of one training micro-batch row, as the
        method runs it: what the plan's probe measures, so the micro-batch it picks fits."""
        return self.sequences, max_length + (t.max_completion_length if self.sampled else 0)

    def trl(self) -> tuple[type, type]:
        """TRL's (config class, trainer class) for the method."""
        found = []
        for dotted in (self.config, self.trainer):
            module, _, name = dotted.rpartition(".")
            found.append(getattr(importlib.import_module(module), name))
        return found[0], found[1]


PREFERENCE = ("margin", "preference_accuracy")
METHODS = {m.name: m for m in [
    Method("sft", "stages.train.sft", "chat", "trl.SFTTrainer", "trl.SFTConfig", ("exact_match", "perplexity")),
    # continued pretraining: SFT's trainer on packed plain text, loss on every token
    Method("cpt", "stages.train.sft", "text", "trl.SFTTrainer", "trl.SFTConfig", ("perplexity",)),
    Method("dpo", "stages.train.dpo", "preference", "trl.DPOTrainer", "trl.DPOConfig", PREFERENCE, sequences=2,
           logs=("rewards/margins", "rewards/accuracies")),
    Method("orpo", "stages.train.dpo", "preference", "trl.experimental.orpo.ORPOTrainer",
           "trl.experimental.orpo.ORPOConfig", PREFERENCE, sequences=2, logs=("rewards/margins", "rewards/accuracies")),
    Method("grpo", "stages.train.grpo", "prompt", "trl.GRPOTrainer", "trl.GRPOConfig", ("reward", "exact_match"),
           sampled=True, logs=("reward", "reward_std")),
    # GRPO's trainer with one importance ratio per sequence (its module sets GRPOConfig as TRL documents GSPO)
    Method("gspo", "stages.train.gspo", "prompt", "trl.GRPOTrainer", "trl.GRPOConfig", ("reward", "exact_match"),
           sampled=True, logs=("reward", "reward_std")),
    Method("reward", "stages.train.reward", "preference", "trl.RewardTrainer", "trl.RewardConfig",
           ("reward_accuracy", "reward_margin"), sequences=2, head="score", logs=("accuracy", "margin")),
    # unpaired rows: one completion per example (the KL estimate's forward runs without gradients)
    Method("kto", "stages.train.kto", "unpaired", "trl.KTOTrainer", "trl.KTOConfig",
           ("label_margin", "desirable_logprob", "undesirable_logprob"), logs=("kl", "rewards/margins")),
]}
