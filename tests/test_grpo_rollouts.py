"""GRPO's rollouts through the generation engine (stages/train/grpo.EngineRollouts, TRL's
rollout_func): on the CPU here, where the checkpoint stage keeps TRL's own generate (engine_here),
so the path the GPU takes is run on the tiny shape: every prompt TRL hands over gets one sampled
completion, the end token kept, TRL trains on those completions, and the engine is closed when
training ends."""
from __future__ import annotations

import json

import torch

from conftest import REPO
from stages.engine.recipe import TrainSection
from stages.model.tiny import char_tokenizer
from stages.train import grpo
from stages.train.methods import METHODS


def test_grpo_samples_through_the_engine_and_trains(tmp_path):
    from datasets import Dataset
    from transformers import Qwen3Config, Qwen3ForCausalLM

    tok = char_tokenizer()
    torch.manual_seed(0)
    model = Qwen3ForCausalLM(Qwen3Config(vocab_size=len(tok), hidden_size=32, intermediate_size=64,
                                         num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
                                         head_dim=16, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id))
    rows = [json.loads(line) for line in (REPO / "data" / "tiny" / "prompts.jsonl").read_text().splitlines()[:8]]
    train = Dataset.from_list([{"prompt": f"Q: {r['question']}\nA:", "reference": r["answer"]} for r in rows])
    t = TrainSection(method="grpo", peft="lora", lora={"r": 4, "alpha": 8}, max_steps=2, micro_batch_size=4,
                     num_generations=4, max_completion_length=12, reward="exact_answer", lr=1e-3)
    plan = {"device": "cpu", "dtype": "float32", "processes": 1, "micro_batch_size": 4, "grad_accum": 1,
            "attn_implementation": "sdpa"}
    assert not grpo.engine_here(plan)
    trainer = grpo.make_trainer(METHODS["grpo"], model, train, tok, plan, t, tmp_path / "work", engine=True)
    rollouts, seen = trainer.rollout_func, []

    def recorded(prompts, tr):
        out = rollouts(prompts, tr)
        seen.append((prompts, out))
        return out
    trainer.rollout_func = recorded
    trainer.train()

    assert len(seen) == 2  # one rollout a step
    for prompts, out in seen:
        assert len(prompts) == len(out["completion_ids"]) == 4  # TRL repeats each prompt num_generations times
        assert out["prompt_ids"] == tok(text=prompts)["input_ids"]
        for ids in out["completion_ids"]:
            assert 1 <= len(ids) <= 12
            assert len(ids) == 12 or ids[-1] == tok.eos_token_id  # ended early: by its end token, kept
    assert rollouts.engine is None  # closed at the end of training
    logged = [x["completions/mean_length"] for x in trainer.state.log_history if "completions/mean_length" in x]
    assert logged == [sum(map(len, out["completion_ids"])) / 4 for _, out in seen]  # the steps trained on them
