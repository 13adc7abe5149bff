"""Each step's figures without a host sync between steps (stages/train/trainer.StepRecords): the
Trainer logs only every LOG_EVERY steps, and at saves and the last step, yet its log history holds
one entry per step with exactly the loss, gradient norm and learning rate it logs when it logs
every step; with gradient accumulation, a save between two of its logs, and a run resumed from
that save."""
from __future__ import annotations

import torch

from stages.data.packed import IGNORE
from stages.engine.recipe import TrainSection
from stages.model.tiny import char_tokenizer
from stages.train import sft
from stages.train.methods import METHODS
from stages.train.trainer import LOG_EVERY, StepRecords

STEPS, SAVE = 13, 7  # the Trainer's own logs come at 7 (a save), 10 and 13 (the last step)
FIGURES = ("step", "loss", "grad_norm", "learning_rate")


def rows(vocab: int, n: int = 4 * STEPS) -> list[dict]:
    """Packed rows of two documents, prompts masked."""
    g = torch.Generator().manual_seed(0)
    out = []
    for _ in range(n):
        ids, labels, pos = [], [], []
        for size in (29, 19):
            doc = torch.randint(10, vocab, (size,), generator=g).tolist()
            ids, labels, pos = ids + doc, labels + [IGNORE] * 5 + doc[5:], pos + list(range(size))
        out.append({"input_ids": ids, "labels": labels, "position_ids": pos})
    return out


def trainer(work, records: bool):
    """A tiny Qwen3 with LoRA, 2 micro-batches of 2 rows a step, the recipe's warm-up and cosine
    rate; records=False: the Trainer's own log every step, the reference."""
    from datasets import Dataset
    from transformers import Qwen3Config, Qwen3ForCausalLM

    tok = char_tokenizer()
    torch.manual_seed(0)
    model = Qwen3ForCausalLM(Qwen3Config(vocab_size=len(tok), hidden_size=32, intermediate_size=64,
                                         num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
                                         head_dim=16, use_cache=False))
    t = TrainSection(peft="lora", lora={"r": 4, "alpha": 8}, max_steps=STEPS, micro_batch_size=2, save_steps=SAVE,
                     warmup_steps=3)
    plan = {"device": "cpu", "dtype": "float32", "processes": 1, "micro_batch_size": 2, "grad_accum": 2}
    run = sft.make_trainer(METHODS["sft"], model, Dataset.from_list(rows(len(tok))), tok, plan, t, work)
    assert run.args.logging_steps == LOG_EVERY
    if records:
        StepRecords(run)
    else:
        run.args.logging_steps = 1
    return run


def figures(run) -> list[dict]:
    return [{k: e[k] for k in FIGURES} for e in run.state.log_history if "loss" in e]


def test_every_step_is_logged_as_the_trainer_logs_it_every_step(tmp_path):
    reference = trainer(tmp_path / "reference", records=False)
    reference.train()
    expected = figures(reference)
    assert [e["step"] for e in expected] == list(range(1, STEPS + 1))
    assert len({e["learning_rate"] for e in expected}) > 3  # warm-up and decay: each step's own rate

    ours = trainer(tmp_path / "ours", records=True)
    ours.train()
    assert figures(ours) == expected  # the same floats, bit for bit

    resumed = trainer(tmp_path / "ours", records=True)  # from the save at step 7, in the same work dir
    resumed.train(resume_from_checkpoint=str(tmp_path / "ours" / f"checkpoint-{SAVE}"))
    assert figures(resumed) == expected
