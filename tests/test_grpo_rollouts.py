"""GRPO's rollouts through the generation engine (stages/train/grpo.EngineRollouts, TRL's
rollout_func): on the CPU here, where the checkpoint stage keeps TRL's own generate (engine_here),
so the path the GPU takes is run on the tiny shape: every prompt TRL hands over gets one sampled
completion, the end token kept, TRL trains on those completions, and the engine is closed when
training ends. The adapter is merged into the base while the engine samples: the base comes back
bit for bit, and greedy rollouts answer what the adapter's own side matmuls answer."""
from __future__ import annotations

import json
from contextlib import nullcontext

import pytest
import torch

from conftest import REPO
from stages.engine.recipe import TrainSection
from stages.inference.batching import PAGE_TOKENS
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
    # the KV budget holds a rollout's every completion at its longest, each in whole pages of its own
    longest = max(map(len, tok(text=list(train["prompt"]))["input_ids"])) + t.max_completion_length
    assert rollouts.kv_tokens >= trainer.args.generation_batch_size * -(-longest // PAGE_TOKENS) * PAGE_TOKENS
    base_before = {n: p.detach().clone() for n, p in trainer.model.named_parameters() if "base_layer" in n}

    sampling, merged = [False], []  # whether a forward ran inside a rollout, and the adapter merged then
    lora = next(m for m in trainer.model.modules() if hasattr(m, "merged_adapters"))
    lora.register_forward_pre_hook(lambda module, _: merged.append((sampling[0], module.merged)))

    def recorded(prompts, tr):
        sampling[0] = True
        try:
            out = rollouts(prompts, tr)
        finally:
            sampling[0] = False
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
    assert rollouts.base_copy is None  # its memory freed with the engine; the base is as it was:
    base_after = dict(trainer.model.named_parameters())
    assert base_before and all(torch.equal(base_after[n], p) for n, p in base_before.items())
    assert not any(getattr(m, "merged", False) for m in trainer.model.modules())
    assert any(inside for inside, _ in merged) and any(not inside for inside, _ in merged)
    assert all(inside == was for inside, was in merged)  # merged exactly while the engine sampled
    logged = [x["completions/mean_length"] for x in trainer.state.log_history if "completions/mean_length" in x]
    assert logged == [sum(map(len, out["completion_ids"])) / 4 for _, out in seen]  # the steps trained on them


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA GPU"))])
def test_merged_greedy_rollouts_answer_what_the_adapter_answers(device):
    """Greedy rollouts through the engine with the adapter merged give the tokens the PEFT model's
    own generate gives through its side matmuls (an adapter of random, not zero, B), and leave the
    model computing what it computed before, its base weights bit for bit. On a GPU the engine's
    step is compiled and replayed as CUDA graphs, which must read the weights merged in place."""
    from types import SimpleNamespace

    tok = char_tokenizer()
    model = tiny_lora(tok, target_modules="all-linear").to(device)
    model.eval()
    prompts = ["Q: What is 2 + 3?\nA:", "Q: Name a colour.\nA:", "Q: 7 * 6?\nA:"]
    ids = tok(text=prompts)["input_ids"]

    def greedy():
        return [model.generate(input_ids=torch.tensor([i], device=device), max_new_tokens=10, do_sample=False,
                               eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)[0, len(i):].tolist()
                for i in ids]
    with torch.no_grad():
        before = model(input_ids=torch.tensor([ids[0]], device=device)).logits
        expected = greedy()
        with model.disable_adapter():  # the adapter moves the answers, so equal answers are its
            assert greedy() != expected
    weights = {n: p.detach().clone() for n, p in model.named_parameters() if "base_layer" in n}
    plan = {"device": device, "dtype": "float32", "attn_implementation": "sdpa"}
    rollouts = grpo.EngineRollouts(tok, plan, kv_tokens=1024)
    trainer = SimpleNamespace(model=model, top_k=0, min_p=None, repetition_penalty=1.0, temperature=0.0, top_p=1.0,
                              eos_token_ids=[tok.eos_token_id], max_completion_length=10)
    lora = next(m for m in model.modules() if hasattr(m, "merged_adapters"))
    merged = []
    lora.register_forward_pre_hook(lambda module, _: merged.append(module.merged))
    try:
        out = rollouts(prompts, trainer)
    finally:
        rollouts.engine.close()
    assert rollouts.base_copy and merged and all(merged)  # the engine's forwards ran with the adapter merged
    assert out["completion_ids"] == expected
    params = dict(model.named_parameters())
    assert all(torch.equal(params[n], w) for n, w in weights.items())
    with torch.no_grad():
        assert torch.equal(model(input_ids=torch.tensor([ids[0]], device=device)).logits, before)


def tiny_lora(tok, **lora):
    from peft import LoraConfig, get_peft_model
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(0)
    base = Qwen3ForCausalLM(Qwen3Config(vocab_size=len(tok), hidden_size=32, intermediate_size=64,
                                        num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
                                        head_dim=16, tie_word_embeddings=lora.pop("tied", False),
                                        eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id))
    model = get_peft_model(base, LoraConfig(r=4, lora_alpha=8, **lora))
    for name, p in model.named_parameters():
        if "lora_B" in name:
            torch.nn.init.normal_(p, std=0.5)
    return model


def test_rollouts_merge_only_where_merging_is_exact_and_in_place():
    """DoRA (PEFT's merge replaces its weight tensors), a LoRA bias, and a tied LM head (merging it
    would move the embeddings too) sample through the adapter; plain LoRA merges."""
    tok = char_tokenizer()
    assert grpo.base_copy(tiny_lora(tok, target_modules="all-linear"))
    assert not grpo.base_copy(tiny_lora(tok, target_modules="all-linear", use_dora=True))
    assert not grpo.base_copy(tiny_lora(tok, target_modules="all-linear", lora_bias=True))
    assert not grpo.base_copy(tiny_lora(tok, target_modules=["q_proj", "lm_head"], tied=True))
    assert grpo.base_copy(tiny_lora(tok, target_modules=["q_proj", "lm_head"]))


def test_a_rollout_that_fails_leaves_the_base_as_it_was():
    tok = char_tokenizer()
    model = tiny_lora(tok, target_modules="all-linear")
    weights = {n: p.detach().clone() for n, p in model.named_parameters()}
    copy = grpo.base_copy(model)
    try:
        with grpo.merged(model, copy):
            assert all(m.merged for m in model.modules() if hasattr(m, "merged_adapters"))
            raise RuntimeError("the engine died")
    except RuntimeError:
        pass
    assert not any(m.merged for m in model.modules() if hasattr(m, "merged_adapters"))
    assert all(torch.equal(p, weights[n]) for n, p in model.named_parameters())


@pytest.mark.parametrize("ahead", [True, False])
def test_compiled_layers_meet_no_new_batch_kind_mid_training(ahead):
    """After compile_ahead, a training forward and backward at any other length, padded or not,
    compiles nothing (torch's fail_on_recompile stance raises on a compile); without it, the first
    padded batch compiles. The random state and the gradients are as they were. The layers are
    compiled as settings.compile_regions compiles them, but to aot_eager: which batches compile is
    dynamo's guards' choice, not the backend's, and inductor's C++ build takes a minute here."""
    from stages.train.settings import decoder_layers

    tok = char_tokenizer()
    model = tiny_lora(tok, target_modules="all-linear")
    for layer in decoder_layers(model):
        layer.compile(backend="aot_eager")
    torch.compiler.reset()
    rng = torch.get_rng_state()
    if ahead:
        grpo.compile_ahead(model, batch=4, longest=40)
        assert torch.equal(torch.get_rng_state(), rng)
        assert all(p.grad is None for p in model.parameters())
    else:  # training's first batches: two lengths, no padding
        for length in (40, 39):
            model(input_ids=torch.ones(4, length, dtype=torch.long), logits_to_keep=1).logits.sum().backward()

    def step(length, pad):
        mask = torch.ones(4, length, dtype=torch.long)
        mask[1, length - pad:] = 0
        model(input_ids=torch.ones_like(mask), attention_mask=mask, logits_to_keep=5).logits.sum().backward()
    try:
        with torch.compiler.set_stance("fail_on_recompile"), \
                (nullcontext() if ahead else pytest.raises(RuntimeError, match="recompil")):
            for length, pad in ((33, 0), (37, 4), (21, 0), (45, 1), (40, 0)):
                step(length, pad)
    finally:
        torch.compiler.reset()
