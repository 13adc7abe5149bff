"""stages/scoring/engine_lm.py: lm-eval's generate_until through the generation engine answers
what lm-eval's own HFLM answers, request for request: greedy, on a small random Qwen3 in fp32 on
the CPU with a character tokenizer (so stop strings fall inside answers), across requests of
different generation settings, stop strings, lengths and a context past max_length that both
left-truncate the same way."""
from __future__ import annotations

import pytest

pytest.importorskip("lm_eval")


@pytest.fixture(scope="module")
def model_and_tok():
    import torch
    from transformers import AutoModelForCausalLM, Qwen3Config

    from stages.model.tiny import char_tokenizer

    tok = char_tokenizer()
    torch.manual_seed(0)
    config = Qwen3Config(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=512,
                         eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    return AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval(), tok


def instances(requests):
    from lm_eval.api.instance import Instance

    return [Instance("generate_until", doc={}, arguments=r, idx=i) for i, r in enumerate(requests)]


def test_the_engine_answers_what_hflm_answers(model_and_tok):
    from lm_eval.models.huggingface import HFLM

    from stages.scoring.engine_lm import EngineLM

    model, tok = model_and_tok
    args = dict(pretrained=model, tokenizer=tok, batch_size=3, max_length=96)
    hflm, ours = HFLM(**args), EngineLM(**args, eos_ids={tok.eos_token_id})
    prompts = ["What is 12 + 30?", "Name a colour.", "x", "Say hello " * 12]  # the last: 120 characters, past 96 - 24
    plain = {"until": [], "max_gen_toks": 24, "do_sample": False}
    raw = hflm.generate_until(instances([(p, plain) for p in prompts]))
    assert len(set(raw)) > 1 and max(map(len, raw)) > 8  # answers worth cutting
    stops = [raw[0][4:6], raw[1][3:5]]  # strings that occur inside the first two answers
    requests = [(p, plain) for p in prompts]
    requests += [(p, {"until": stops, "max_gen_toks": 24, "do_sample": False}) for p in prompts]
    requests += [(p, {"until": ["\n"], "max_gen_toks": 7, "do_sample": False}) for p in prompts[:2]]
    theirs = hflm.generate_until(instances(requests))
    assert ours.generate_until(instances(requests)) == theirs
    assert theirs[:4] == raw and len(theirs[4]) < len(raw[0]) and len(theirs[5]) < len(raw[1])  # cut at a stop
