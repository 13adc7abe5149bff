"""stages/scoring/wide_lm.py: lm-eval's generate_until in batches as wide as the KV budget allows
answers what lm-eval's own HFLM answers at the recipe's batch size, request for request: greedy,
on a small random Qwen3 in fp32 on the CPU with a character tokenizer (so stop strings fall inside
answers), across requests of different generation settings, stop strings, lengths and a context
past max_length that both left-truncate the same way."""
from __future__ import annotations

import pytest

pytest.importorskip("lm_eval")


def instances(requests):
    from lm_eval.api.instance import Instance

    return [Instance("generate_until", doc={}, arguments=r, idx=i) for i, r in enumerate(requests)]


def test_wide_batches_answer_what_hflm_answers(model_and_tok):
    from lm_eval.models.huggingface import HFLM

    from stages.scoring.wide_lm import WideLM

    model, tok = model_and_tok
    args = dict(pretrained=model, tokenizer=tok, batch_size=3, max_length=96)
    hflm, ours = HFLM(**args), WideLM(**args)
    prompts = ["What is 12 + 30?", "Name a colour.", "x", "Say hello " * 12]  # the last: 120 characters, past 96 - 24
    plain = {"until": [], "max_gen_toks": 24, "do_sample": False}
    raw = hflm.generate_until(instances([(p, plain) for p in prompts]))
    assert len(set(raw)) > 1 and max(map(len, raw)) > 8  # answers worth cutting
    stops = [raw[0][4:6], raw[1][3:5]]  # strings that occur inside the first two answers
    requests = [(p, plain) for p in prompts]
    requests += [(p, {"until": stops, "max_gen_toks": 24, "do_sample": False}) for p in prompts]
    requests += [(p, {"until": ["\n"], "max_gen_toks": 7, "do_sample": False}) for p in prompts[:2]]
    assert ours.generation_batch(instances(requests)) == len(requests)  # all at once, where HFLM takes 3
    theirs = hflm.generate_until(instances(requests))
    assert ours.generate_until(instances(requests)) == theirs
    assert ours.batch_size == 3  # the loglikelihood passes keep the recipe's batch
    assert theirs[:4] == raw and len(theirs[4]) < len(raw[0]) and len(theirs[5]) < len(raw[1])  # cut at a stop
    import torch

    sampled = instances([(p, {"until": ["\n"], "max_gen_toks": 7, "do_sample": True, "temperature": 0.7})
                         for p in prompts[:2]])
    torch.manual_seed(1)
    first = ours.generate_until(sampled)
    torch.manual_seed(1)
    assert ours.generate_until(sampled) == first  # a seeded sampled batch repeats


def test_the_batch_is_as_wide_as_the_kv_budget_allows(model_and_tok):
    """The longest request's context and answer against the budget: 24 new tokens (under either
    of lm-eval's names for them) on a 96-token context at most, so 200 tokens take two rows;
    never fewer than the recipe's batch size."""
    from stages.scoring.wide_lm import WideLM

    model, tok = model_and_tok
    requests = instances([(p, {"until": [], "max_gen_toks": 24}) for p in ["x", "Say hello " * 12]]
                         + [("y", {"until": [], "max_new_tokens": 24})])
    args = dict(pretrained=model, tokenizer=tok, batch_size=1, max_length=96)
    assert WideLM(**args, kv_tokens=200).generation_batch(requests) == 2
    assert WideLM(**args, kv_tokens=10).generation_batch(requests) == 1
    assert WideLM(**args, kv_tokens=10**6).generation_batch(requests) == 3
    assert WideLM(**args, kv_tokens=40).generation_batch(instances([("x", {"until": [], "max_new_tokens": 30})] * 3)) == 1


def test_the_kv_budget_does_not_follow_the_memory_free_now(model_and_tok):
    """The width, and in bf16 a near tie's answer, must not depend on what else the process holds:
    the budget is the same with half a gigabyte more in use."""
    import torch

    from stages.scoring.wide_lm import kv_budget_tokens

    model, _ = model_and_tok
    before = kv_budget_tokens(model)
    held = torch.ones(2**27)  # 512 MiB, touched
    assert kv_budget_tokens(model) == before > 10**5
    del held


def test_the_eval_stage_scores_hflms_greedy_answers(model_and_tok):
    """harness.results, as the eval stage calls it (the chat kind's exact-match and perplexity
    tasks through lm-eval's evaluate): the references are HFLM's own greedy answers at
    batch 2, so exact match is 1 only where the wide batch's answers are HFLM's."""
    from types import SimpleNamespace

    from lm_eval.models.huggingface import HFLM

    from stages.data.kinds import chat
    from stages.scoring import harness

    model, tok = model_and_tok
    questions = [f"What is {a} + {b}?" for a, b in ((1, 2), (12, 30), (7, 7), (40, 2), (9, 10))]

    def docs_answering(answers):
        rows = [{"messages": [{"role": "user", "content": q}, {"role": "assistant", "content": a}]}
                for q, a in zip(questions, answers)]
        return chat.heldout_docs(rows, tok, model.config.max_position_embeddings)

    placeholder = docs_answering(["?"] * len(questions))
    kwargs = {"until": [tok.eos_token], "max_gen_toks": 12, "do_sample": False}
    greedy = HFLM(pretrained=model, tokenizer=tok, batch_size=2).generate_until(
        instances([(d["prompt"], kwargs) for d in placeholder]))
    docs = docs_answering([g.strip() for g in greedy])
    configs = harness.task_configs(chat.tasks(docs, tok.eos_token, 12, None), docs)
    settings = SimpleNamespace(batch_size=2)
    assert harness.results(model, tok, configs, settings)["heldout_exact_match"]["exact_match,strip"] == 1.0


@pytest.mark.skipif(not __import__("torch").cuda.is_available(), reason="needs a CUDA GPU")
def test_on_a_gpu_wide_batches_answer_what_hflm_answers(model_and_tok):
    """The same in fp32 on a GPU, where the budget comes from the GPU's whole memory."""
    import copy

    from lm_eval.models.huggingface import HFLM

    from stages.scoring.wide_lm import WideLM

    model, tok = model_and_tok
    model = copy.deepcopy(model).cuda()
    args = dict(pretrained=model, tokenizer=tok, batch_size=1, max_length=96)
    kwargs = {"until": [], "max_gen_toks": 24, "do_sample": False}
    requests = instances([(p, kwargs) for p in ["What is 12 + 30?", "Name a colour.", "x", "Say hello " * 12]])
    ours = WideLM(**args)
    assert ours.generation_batch(requests) == 4
    assert ours.generate_until(requests) == HFLM(**args).generate_until(requests)
