"""SFT's loss on the target rows only (stages/train/sft.TargetRowsHead) is the model's own loss:
the same value and the same gradients as the model's forward with labels, for LoRA and for
full weights, on packed rows with prompts, documents and padding; from the second step on,
with the head's own output kept for the loss and the model returning an empty slice of it,
except for a model that caps its logits after the head."""
from __future__ import annotations

import pytest
import torch

from stages.data.packed import IGNORE
from stages.engine.recipe import TrainSection
from stages.model.tiny import char_tokenizer
from stages.train import sft
from stages.train.methods import METHODS


def packed_batch(vocab: int, rows: int = 3, length: int = 64, seed: int = 0) -> list[dict]:
    """Rows of two or three documents each (prompt masked, completion labelled) and padding."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(rows):
        ids, labels, pos = [], [], []
        for n in (20, 17, 11):
            doc = torch.randint(10, vocab, (n,), generator=g).tolist()
            prompt = n // 3
            ids += doc
            labels += [IGNORE] * prompt + doc[prompt:]
            pos += list(range(n))
        pad = length - len(ids)
        out.append({"input_ids": ids + [0] * pad, "labels": labels + [IGNORE] * pad,
                    "position_ids": pos + list(range(pad))})
    return out


def model_and_trainer(tmp_path, peft: str, kind: str = "qwen3", plan_dtype: str = "float32"):
    from datasets import Dataset
    from transformers import Gemma2Config, Gemma2ForCausalLM, Qwen3Config, Qwen3ForCausalLM

    tok = char_tokenizer()
    torch.manual_seed(0)
    shape = dict(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                 num_attention_heads=2, num_key_value_heads=1, head_dim=16, use_cache=False)
    model = (Qwen3ForCausalLM(Qwen3Config(**shape)) if kind == "qwen3"  # Gemma 2 caps its logits after the head
             else Gemma2ForCausalLM(Gemma2Config(**shape, final_logit_softcapping=2.0)))
    rows = packed_batch(len(tok))
    t = TrainSection(peft=peft, lora={"r": 4, "alpha": 8}, max_steps=1, micro_batch_size=len(rows))
    plan = {"device": "cpu", "dtype": plan_dtype, "processes": 1, "micro_batch_size": len(rows), "grad_accum": 1}
    run = sft.make_trainer(METHODS["sft"], model, Dataset.from_list(rows), tok, plan, t, tmp_path / "work")
    return run, sft.collate(rows)


@pytest.mark.parametrize("peft,kind", [("lora", "qwen3"), ("none", "qwen3"), ("lora", "gemma2")])
def test_target_rows_loss_and_gradients_equal_the_models_own(tmp_path, peft, kind):
    from transformers import Trainer

    run, batch = model_and_trainer(tmp_path, peft, kind)
    assert run.head.usable
    n = (torch.nn.functional.pad(batch["labels"][:, 1:], (0, 1), value=IGNORE) != IGNORE).sum()
    assert len(batch["loss_rows"]) == n  # one row per target: prompts, document ends and padding have none
    model = run.model
    params = [p for p in model.parameters() if p.requires_grad]
    own_inputs = {k: v for k, v in batch.items() if k not in ("loss_rows", "loss_targets")}
    own = Trainer.compute_loss(run, model, own_inputs, num_items_in_batch=n)
    own_grads = torch.autograd.grad(own, params)
    returned = []
    model.register_forward_hook(lambda m, args, out: returned.append(out.logits.shape[0]))

    for step in range(2):  # the first compares the model's logits with the head's; the second uses what it found
        ours = run.compute_loss(model, batch, num_items_in_batch=n)
        ours_grads = torch.autograd.grad(ours, params)
        assert ours.item() == pytest.approx(own.item(), rel=1e-5)
        for a, b in zip(ours_grads, own_grads):
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)
    assert run.head.keep is (kind == "qwen3")
    assert returned == [n, 0 if kind == "qwen3" else n]  # the model hands back an empty slice once checked


def test_the_head_sees_only_the_target_rows(tmp_path):
    run, batch = model_and_trainer(tmp_path, "lora")
    seen = []
    run.model.get_output_embeddings().register_forward_hook(lambda m, args, out: seen.append(out.shape))
    run.compute_loss(run.model, batch, num_items_in_batch=len(batch["loss_rows"]))
    assert seen == [torch.Size([len(batch["loss_rows"]), run.model.get_output_embeddings().out_features])]
    assert len(batch["loss_rows"]) < batch["input_ids"].numel() * 0.75


def test_under_bf16_the_model_hands_back_no_fp32_copy_of_the_logits(tmp_path):
    """As the Trainer runs it in bf16: accelerate's prepared forward autocasts and converts the bf16
    tensors it returns to fp32. The first step's logits come back whole (and converted: the check
    compares them with the head's own); from the second the model returns an empty slice, and the
    loss is the same."""
    run, batch = model_and_trainer(tmp_path, "lora", plan_dtype="bfloat16")
    model = run.accelerator.prepare_model(run.model)
    n = len(batch["loss_rows"])
    returned, seen = [], []
    model.register_forward_hook(lambda m, args, out: returned.append((out.logits.shape[0], out.logits.dtype)))
    base = sft.without_peft(model)
    loss_function = base.loss_function
    base.loss_function = lambda logits, **kw: seen.append(logits.dtype) or loss_function(logits=logits, **kw)
    losses = [run.compute_loss(model, batch, num_items_in_batch=n).item() for _ in range(2)]
    assert returned == [(n, torch.float32), (0, torch.float32)]
    assert seen == [torch.bfloat16, torch.bfloat16]  # the head's own output both times: the loss compiles once
    assert run.head.keep is True
    assert losses[1] == pytest.approx(losses[0], rel=1e-6)
