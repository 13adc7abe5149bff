"""Flex attention's block mask for packed rows, found on the CPU by the collator. Given no mask,
transformers finds the documents of packed rows from their restarting position ids on the GPU in
every forward (find_packed_sequence_indices: a `.all()` in an `if`, a host sync) and then builds
the block mask with a dozen eager operations, all before the first layer, with the GPU idle
(bench/results/host_gaps_h200_2026-12-02: the step's largest wait for the host). Handed a
BlockMask as the attention mask, it uses it as it is. The blocks here are the ones transformers
would build (causal, within a document, flex's default 128-token blocks; tests/test_document_mask.py
checks them against flex's own create_block_mask and the model's output against its own mask)."""
from __future__ import annotations

import torch
from torch.nn.attention.flex_attention import BlockMask

BLOCK = 128  # flex attention's default block size, the one transformers builds its masks with
BLOCK_TENSORS = ("kv_num_blocks", "kv_indices", "full_kv_num_blocks", "full_kv_indices",
                 "q_num_blocks", "q_indices", "full_q_num_blocks", "full_q_indices")
KEYS = ("documents",) + BLOCK_TENSORS


def usable(config, attn_implementation: str) -> bool:
    """Whether a prebuilt document mask stands for what the model would build: flex attention, a
    text-only model (a composite one, Gemma 3's or Llama 4's, keeps its layers' settings in a
    sub-config and may mask image tokens its own way), every layer attending to the whole causal
    past (a sliding-window, chunked or bidirectional layer needs its own mask, which transformers
    would no longer build), and no router loss (the MoE loss reads the attention mask as a tensor)."""
    layer_types = getattr(config, "layer_types", None) or ["full_attention"]
    return (attn_implementation == "flex_attention" and config.get_text_config() is config
            and set(layer_types) == {"full_attention"} and not getattr(config, "sliding_window", None)
            and not getattr(config, "attention_chunk_size", None)
            and not getattr(config, "use_bidirectional_attention", False) and getattr(config, "is_causal", True)
            and not getattr(config, "output_router_logits", False))


def documents(position_ids: torch.Tensor) -> torch.Tensor:
    """Each token's document in its row, counted as transformers counts them: a new document
    wherever the position does not follow the one before by 1."""
    first = position_ids[:, :1] - 1
    return (torch.diff(position_ids, prepend=first, dim=-1) != 1).cumsum(-1)


def ordered(dense: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per query block, how many key blocks are set and their indices, set ones first in
    ascending order (flex's layout, int32, with a head dimension of 1)."""
    counts = dense.sum(-1, dtype=torch.int32)
    indices = torch.argsort(dense.to(torch.int8), dim=-1, descending=True, stable=True).to(torch.int32)
    return counts.unsqueeze(1), indices.unsqueeze(1)


def blocks(position_ids: torch.Tensor) -> dict:
    """The document ids and flex's block tensors of packed rows (batch x length), on the
    device of position_ids (the CPU in the collator): the key blocks of each query block, and the
    query blocks of each key block for the backward, which BlockMask.from_kv_blocks derives here
    (on the GPU its dozen eager operations would again run before the first layer, the GPU
    idle: bench/results/document_mask_h200_2026-12-02). Document ids never decrease along a row, so
    an earlier key block meets a query block's documents only where its last document is the
    query block's first (partial), and is wholly inside it where its first document is the
    query block's last (full); a diagonal block is always partial (causal within it), and so is
    any block with the row's ragged end."""
    docs = documents(position_ids)
    length = docs.shape[1]
    n = -(-length // BLOCK)
    ends = torch.clamp(torch.arange(1, n + 1) * BLOCK, max=length) - 1
    first, last = docs[:, ::BLOCK], docs[:, ends]
    q, kv = torch.arange(n).view(n, 1), torch.arange(n).view(1, n)
    earlier = kv < q
    whole = torch.arange(n) * BLOCK + BLOCK <= length
    meets = earlier & (last.unsqueeze(1) == first.unsqueeze(2)) | (kv == q)
    full = earlier & (first.unsqueeze(1) == last.unsqueeze(2)) & whole.view(n, 1) & whole.view(1, n)
    found = BlockMask.from_kv_blocks(*ordered(meets & ~full), *ordered(full), BLOCK_SIZE=BLOCK,
                                     seq_lengths=(length, length))
    return {"documents": docs, **{name: getattr(found, name) for name in BLOCK_TENSORS}}


def block_mask(tensors: dict):
    """The BlockMask of blocks()'s tensors (on the GPU by now): within the partial blocks, a key
    is seen where it is in the query's document and not after it."""
    docs = tensors["documents"]

    def same_document_causal(b, h, q, kv):
        return (docs[b, q] == docs[b, kv]) & (kv <= q)

    length = docs.shape[1]
    return BlockMask(seq_lengths=(length, length), **{name: tensors[name] for name in BLOCK_TENSORS},
                     BLOCK_SIZE=(BLOCK, BLOCK), mask_mod=same_document_causal)
