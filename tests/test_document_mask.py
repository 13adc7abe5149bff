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


def test_usable_only_for_flex_without_sliding_windows():
    from transformers import Qwen3Config

    assert document_mask.usable(Qwen3Config(), "flex_attention")
    assert not document_mask.usable(Qwen3Config(), "sdpa")
    windowed = Qwen3Config(use_sliding_window=True, sliding_window=64, max_window_layers=1, num_hidden_layers=2)
    assert not document_mask.usable(windowed, "flex_attention")


def test_trainer_loss_equals_the_models_own_mask(tmp_path):
    """The SFT trainer under flex attention: its collator finds the blocks, compute_loss hands
    the BlockMask to the model; the loss is that of the model building its own mask from the
    position ids (the same batch without the blocks). Forward only: flex attention has no
    backward on the CPU in torch 2.13; the backward reads the query-side blocks, which
    test_blocks_are_flexs_own checks."""
    from datasets import Dataset
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from stages.engine.recipe import TrainSection
    from stages.model.tiny import char_tokenizer
    from stages.train.methods import METHODS
    from tests.test_target_rows import packed_batch

    tok = char_tokenizer()
    torch.manual_seed(0)
    model = Qwen3ForCausalLM(Qwen3Config(vocab_size=len(tok), hidden_size=32, intermediate_size=64,
                                         num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
                                         head_dim=16, use_cache=False))
    model.set_attn_implementation("flex_attention")
    rows = packed_batch(len(tok), length=160)
    t = TrainSection(peft="lora", lora={"r": 4, "alpha": 8}, max_steps=1, micro_batch_size=len(rows))
    plan = {"device": "cpu", "dtype": "float32", "processes": 1, "micro_batch_size": len(rows), "grad_accum": 1,
            "attn_implementation": "flex_attention"}
    run = sft.make_trainer(METHODS["sft"], model, Dataset.from_list(rows), tok, plan, t, tmp_path / "work")
    with_blocks = run.data_collator(rows)
    assert set(document_mask.KEYS) <= set(with_blocks)
    n = len(with_blocks["loss_rows"])
    seen = []
    run.model.register_forward_pre_hook(lambda m, args, kwargs: seen.append(type(kwargs.get("attention_mask")).__name__),
                                        with_kwargs=True)
    with torch.no_grad():
        ours = run.compute_loss(run.model, with_blocks, num_items_in_batch=n)
        own = run.compute_loss(run.model, sft.collate(rows), num_items_in_batch=n)
    assert seen == ["BlockMask", "NoneType"]
    assert ours.item() == pytest.approx(own.item(), rel=1e-6)
