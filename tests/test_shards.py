"""The shards stage's pieces: exact loss masks, best-fit-decreasing packing, documents that
never see each other inside a packed sequence, and every bad row failed or counted."""
from __future__ import annotations

import re
from collections import Counter

import pytest

from stages import shards
from stages.base import char_tokenizer
from stages.errors import UserError

CONVERSATION = [
    {"role": "system", "content": "You answer with a number."},
    {"role": "user", "content": "What is 2 + 3?"},
    {"role": "assistant", "content": "5"},
    {"role": "user", "content": "And times 4?"},
    {"role": "assistant", "content": "20\nthat is all"},
]


def expected_mask(messages) -> list[int]:
    """ChatML written out by hand, one character per token: 1 on assistant content and its <|im_end|>."""
    mask = []
    for m in messages:
        learn = int(m["role"] == "assistant")
        mask += [0] + [0] * len(m["role"] + "\n")  # <|im_start|>, role, newline
        mask += [learn] * len(m["content"]) + [learn] + [0]  # content, <|im_end|>, newline
    return mask


def test_loss_mask_is_exactly_the_assistant_tokens():
    """The tiny template has no {% generation %} markers: masks come from prefix rendering."""
    tok = char_tokenizer()
    assert not re.search(r"\{%-?\s*generation\s", tok.chat_template)
    ids, mask = shards.encode(tok, CONVERSATION)
    assert len(ids) == len(mask)
    assert mask == expected_mask(CONVERSATION)
    learned = tok.decode([i for i, m in zip(ids, mask) if m])
    assert learned == "5<|im_end|>20\nthat is all<|im_end|>"


def test_best_fit_decreasing_packing():
    bins = shards.pack([5, 4, 3, 3, 2, 1], capacity=8)
    assert bins == [[0, 2], [1, 3, 5], [4]]
    lengths = [7, 250, 3, 128, 128, 90, 40, 166, 12, 1, 256]
    bins = shards.pack(lengths, capacity=256)
    assert sorted(i for b in bins for i in b) == list(range(len(lengths)))
    assert all(sum(lengths[i] for i in b) <= 256 for b in bins)
    assert len(bins) == -(-sum(lengths) // 256)  # as few bins as the total allows, here


def test_packed_documents_do_not_attend_to_each_other(tmp_path):
    """Two documents in one row, position ids restarting, no attention mask: each gets the logits
    it gets alone. This is what training relies on when it feeds packed shards."""
    import torch
    from transformers import AutoModelForCausalLM

    from stages.base import build_from_config
    from stages.recipe import TinyConfig

    build_from_config(TinyConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                 num_attention_heads=4, num_key_value_heads=2, head_dim=8), tmp_path)
    model = AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    model.config.use_cache = False
    a, b = torch.randint(3, 90, (1, 11)), torch.randint(3, 90, (1, 7))
    with torch.no_grad():
        alone_a, alone_b = model(input_ids=a).logits, model(input_ids=b).logits
        packed = model(input_ids=torch.cat([a, b], 1),
                       position_ids=torch.cat([torch.arange(11), torch.arange(7)])[None]).logits
    torch.testing.assert_close(packed[:, :11], alone_a, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(packed[:, 11:], alone_b, rtol=1e-5, atol=1e-5)


def write_rows(path, lines):
    path.write_text("".join(line + "\n" for line in lines))


GOOD = '{"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]}'


def test_bad_rows_fail_with_file_and_line(tmp_path):
    path = tmp_path / "rows.jsonl"
    write_rows(path, [GOOD, GOOD, '{"messages": [', GOOD])
    with pytest.raises(UserError, match=r"^data/rows.jsonl:3: malformed JSON"):
        list(shards.read_rows(path, "data/rows.jsonl", "fail", Counter()))
    write_rows(path, [GOOD, '{"messages": [{"role": "wizard", "content": "x"}]}'])
    with pytest.raises(UserError, match=r"^data/rows.jsonl:2: unknown role 'wizard'"):
        list(shards.read_rows(path, "data/rows.jsonl", "fail", Counter()))


def test_skip_counts_every_dropped_row(tmp_path):
    path = tmp_path / "rows.jsonl"
    write_rows(path, [GOOD, "{not json", '{"text": "no messages"}', "",
                      '{"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "  "}]}',
                      GOOD])
    dropped = Counter()
    kept = list(shards.read_rows(path, "rows.jsonl", "skip", dropped))
    assert len(kept) == 2
    assert dropped == {"malformed_json": 1, "invalid_row": 2, "blank_line": 1}


def test_heldout_split_depends_on_the_row_alone():
    rows = [f"user:what is {i} + 1?\nassistant:{i + 1}" for i in range(2000)]
    split = [shards.is_heldout(r, 0.1, 0) for r in rows]
    assert 150 < sum(split) < 250
    assert [shards.is_heldout(r, 0.1, 0) for r in reversed(rows)] == split[::-1]
