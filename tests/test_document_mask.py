"""Flex attention's block mask found by the collator (stages/train/document_mask.py) is the one
the model builds itself from packed rows' restarting position ids: the same blocks as flex's own
create_block_mask, and the same loss and gradients through the SFT trainer."""
from __future__ import annotations

import pytest
import torch

from stages.train import document_mask, sft


def packed_positions(rows: int, length: int, longest: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(rows):
        pos: list[int] = []
        while len(pos) < length:
            pos += range(int(torch.randint(1, longest, (1,), generator=g)))
        out.append(pos[:length])
    return torch.tensor(out)


@pytest.mark.parametrize("length,longest", [(2048, 700), (2048, 150), (300, 120), (1000, 1500), (128, 40)])
def test_blocks_are_flexs_own(length, longest):
    from torch.nn.attention.flex_attention import create_block_mask

    tensors = document_mask.blocks(packed_positions(3, length, longest, seed=length + longest))
    docs = tensors["documents"]
    own = create_block_mask(lambda b, h, q, kv: (docs[b, q] == docs[b, kv]) & (kv <= q), 3, None, length, length,
                            device="cpu")
    ours = document_mask.block_mask(tensors)
    for kind in ("kv", "full_kv", "q", "full_q"):
        counts = getattr(ours, f"{kind}_num_blocks")
        assert torch.equal(counts, getattr(own, f"{kind}_num_blocks")), kind
        for a, b, n in zip(getattr(ours, f"{kind}_indices").flatten(0, -2), getattr(own, f"{kind}_indices").flatten(0, -2),
                           counts.flatten()):
            assert torch.equal(a[:n], b[:n]), kind  # the set blocks, in flex's order
    assert torch.equal(ours.to_dense(), own.to_dense())


def test_documents_counted_as_transformers_counts_them():
    from transformers.masking_utils import find_packed_sequence_indices

    positions = packed_positions(2, 300, 90, seed=1)
    assert torch.equal(document_mask.documents(positions), find_packed_sequence_indices(positions))


def test_usable_only_where_the_model_would_build_the_same_mask():
    from transformers import Gemma3Config, Llama4Config, Qwen3Config, Qwen3MoeConfig

    assert document_mask.usable(Qwen3Config(), "flex_attention")
    assert not document_mask.usable(Qwen3Config(), "sdpa")
    windowed = Qwen3Config(use_sliding_window=True, sliding_window=64, max_window_layers=1, num_hidden_layers=2)
    assert not document_mask.usable(windowed, "flex_attention")
    assert not document_mask.usable(Gemma3Config(), "flex_attention")  # composite: sliding layers in text_config
    assert not document_mask.usable(Llama4Config(), "flex_attention")  # composite: chunked attention
    assert not document_mask.usable(Qwen3MoeConfig(output_router_logits=True), "flex_attention")
    assert document_mask.usable(Qwen3MoeConfig(), "flex_attention")


def test_the_model_under_the_collators_mask_is_the_model_under_its_own(tmp_path):
    """The SFT trainer under flex attention: its collator finds the blocks, compute_loss hands
    the BlockMask to the model. Rows of random documents over several 128-token blocks (full
    and partial ones), the last cut at the row's end: every position's logits and the loss are
    those of the model building its own mask from the position ids (the same batch without the
    blocks). Forward only: flex attention has no backward on the CPU in torch 2.13; the
    backward reads the query-side blocks, which test_blocks_are_flexs_own checks."""
    from datasets import Dataset
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from stages.data.packed import IGNORE
    from stages.engine.recipe import TrainSection
    from stages.model.tiny import char_tokenizer
    from stages.train.methods import METHODS

    tok = char_tokenizer()
    torch.manual_seed(0)
    model = Qwen3ForCausalLM(Qwen3Config(vocab_size=len(tok), hidden_size=32, intermediate_size=64,
                                         num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
                                         head_dim=16, use_cache=False))
    model.set_attn_implementation("flex_attention")
    positions = packed_positions(3, 640, 400, seed=7)
    ids = torch.randint(10, len(tok), positions.shape, generator=torch.Generator().manual_seed(7))
    labels = torch.where(torch.rand(positions.shape, generator=torch.Generator().manual_seed(8)) < 0.3, IGNORE, ids)
    rows = [{"input_ids": i, "labels": l, "position_ids": p}
            for i, l, p in zip(ids.tolist(), labels.tolist(), positions.tolist())]
    t = TrainSection(peft="lora", lora={"r": 4, "alpha": 8}, max_steps=1, micro_batch_size=len(rows))
    plan = {"device": "cpu", "dtype": "float32", "processes": 1, "micro_batch_size": len(rows), "grad_accum": 1,
            "attn_implementation": "flex_attention"}
    run = sft.make_trainer(METHODS["sft"], model, Dataset.from_list(rows), tok, plan, t, tmp_path / "work")
    with_blocks = run.data_collator(rows)
    assert set(document_mask.KEYS) <= set(with_blocks)
    assert with_blocks["full_kv_num_blocks"].sum() > 0 and with_blocks["kv_num_blocks"].sum() > 3 * 5
    n = len(with_blocks["loss_rows"])
    seen = []
    run.model.register_forward_pre_hook(lambda m, args, kwargs: seen.append(type(kwargs.get("attention_mask")).__name__),
                                        with_kwargs=True)
    with torch.no_grad():
        ours = run.compute_loss(run.model, with_blocks, num_items_in_batch=n)
        own = run.compute_loss(run.model, sft.collate(rows), num_items_in_batch=n)
        mask = document_mask.block_mask({k: with_blocks[k] for k in document_mask.KEYS})
        ours_logits = run.model(input_ids=ids, position_ids=positions, attention_mask=mask).logits
        own_logits = run.model(input_ids=ids, position_ids=positions).logits
    assert seen == ["BlockMask", "NoneType", "BlockMask", "NoneType"]
    assert ours.item() == pytest.approx(own.item(), rel=1e-6)
    torch.testing.assert_close(ours_logits, own_logits, rtol=1e-5, atol=1e-6)
    broken = document_mask.blocks(torch.arange(640).repeat(3, 1))  # one document a row: not these rows' mask
    with torch.no_grad():
        wrong = run.model(input_ids=ids, position_ids=positions,
                          attention_mask=document_mask.block_mask(broken)).logits
    assert not torch.allclose(wrong, own_logits, rtol=1e-3, atol=1e-4)
