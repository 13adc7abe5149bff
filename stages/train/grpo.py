"""GRPO: TRL's GRPOTrainer on the shards' prompts, rewarded by the verifiable reward the recipe
names (train.reward, stages/train/verifiers.py) against each prompt's reference answer:
train.num_generations sampled completions per prompt of up to train.max_completion_length
tokens, each scored against the others of its group."""
from __future__ import annotations

from pathlib import Path

from stages.train.pairs import prompt_texts
from stages.train.verifiers import reward_function
from stages.train.settings import peft_config
from stages.train.trainer import plan_args


def dataset(shards: Path, tok):
    return prompt_texts(shards, tok)


def reward_for_trainer(name: str):
    """The named reward as TRL calls a reward function: a batch of completions, with the
    dataset's other columns (the reference answers) as keyword arguments."""
    score = reward_function(name)

    def reward(prompts, completions, reference, **_):
        return [score(c, r) for c, r in zip(completions, reference)]

    reward.__name__ = name  # TRL logs each reward under its function's name
    return reward


def make_trainer(method, model, train, tok, plan: dict, t, output_dir: Path, **settings):
    """GRPOTrainer as the row, plan and recipe say; `settings` are further GRPOConfig fields, for a
    method that is GRPO with other settings of TRL's (stages/train/gspo.py)."""
    config, grpo_trainer = method.trl()
    args = config(**plan_args(plan, t, output_dir), num_generations=t.num_generations,
                  max_completion_length=t.max_completion_length, **settings)
    trainer = grpo_trainer(model=model, reward_funcs=reward_for_trainer(t.reward), args=args, train_dataset=train,
                           processing_class=tok, peft_config=peft_config(t, method.peft_task))
    generate_eagerly(trainer.model, plan)
    return trainer


def generate_eagerly(model, plan: dict) -> None:
    """The plan's decisions are measured on training steps. Sampling runs the same model a token
    at a time, where the compiled layers fail (flex attention: inductor finds no kernel for the
    decode shapes, lent H100), so the model's generate runs its layers eagerly with SDPA, under the
    autocast training runs in (training_context leaves LoRA's inputs in bf16 for it)."""
    from contextlib import nullcontext

    import torch

    generate = model.generate
    autocast = (lambda: torch.autocast(plan["device"], dtype=torch.bfloat16)) if plan["dtype"] == "bfloat16" else nullcontext

    def eager_generate(*args, **kwargs):
        model.set_attn_implementation("sdpa")
        try:
            with torch.compiler.set_stance("force_eager"), autocast():
                return generate(*args, **kwargs)
        finally:
            model.set_attn_implementation(plan["attn_implementation"])

    model.generate = eager_generate
