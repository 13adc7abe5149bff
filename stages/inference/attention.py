"""Attention for the generation engine's batch: transformers' SDPA, with two changes where
transformers' continuous batching calls it (it alone passes its paged `cache`).

- Grouped-query attention without copying keys and values. transformers repeats each key/value
  head once per query head it serves (Qwen3-8B: 4 times) whenever there is a mask, and the batch
  always has one: every step wrote and read four copies of every request's keys and values, in
  every layer. Here the query heads that share a key/value head become extra query rows of it
  (the mask, shared by all heads, repeated for them), which is the same attention: each row still
  sees its own head's keys under its own mask row.
- On a GPU, each request's queries over its own keys alone (stages/inference/varlen.py): the
  masked SDPA over every request's keys was a third of a step's GPU time at 32 requests.
- Uncompiled, as one piece. Under a compiled step, dynamo compiled transformers' attention as a
  frame of its own, specialized on each layer's index (the cache's update takes it), so the 36
  layers asked for 36 variants and past dynamo's limit of 8 the rest ran eager (docs/serving.md).
  Called through `torch.compiler.disable`, the rest of every layer compiles once for all layers.

Everything else (training, `generate`, eval) goes to transformers' own function unchanged.
"""
from __future__ import annotations

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from stages.inference import varlen


def sdpa(module, query, key, value, attention_mask, **kwargs):
    """What `attn_implementation="sdpa"` calls once `install()` has run."""
    if kwargs.get("cache") is None:
        return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)
    return batch_sdpa(module, query, key, value, attention_mask, **kwargs)


@torch.compiler.disable
def batch_sdpa(module, query, key, value, attention_mask, dropout=0.0, scaling=None, is_causal=None, cache=None,
               **kwargs):
    """The batch's attention: the paged cache's update (which reads this layer's keys and values
    of every request in the batch), then, on a GPU, each request's queries over its own keys
    (full causal attention only: the mask is then exactly the requests' lengths), else SDPA over
    all of them under the mask with the query heads grouped."""
    groups = getattr(module, "num_key_value_groups", 1)
    shared_mask = attention_mask is not None and attention_mask.dim() == 4 and attention_mask.shape[1] == 1
    plain = not dropout and kwargs.get("position_bias") is None and kwargs.get("softcap") is None
    # full causal attention only: no sliding window (an attribute of the layer, or a keyword as Mistral's
    # layers pass it), no attention sinks, keys and values as wide as the queries
    full = getattr(module, "sliding_window", None) is None and kwargs.get("sliding_window") is None \
        and kwargs.get("s_aux") is None and key.shape[-1] == value.shape[-1] == query.shape[-1]
    own_keys = plain and full and varlen.available(query) and "cu_seq_lens_q" in kwargs
    if not own_keys and (groups == 1 or not shared_mask or not plain):
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      is_causal=is_causal, cache=cache, **kwargs)
    key, value = cache.update(key_states=key, value_states=value, layer_idx=module.layer_idx, kwargs=kwargs)
    if own_keys:
        scale = scaling if scaling is not None else query.shape[-1] ** -0.5
        return varlen.attention(query, key, value, kwargs["cu_seq_lens_q"], kwargs["cu_seq_lens_k"], scale), None
    batch, heads, rows, dim = query.shape
    # query head h = kv * groups + g becomes row g * rows + i of key/value head kv; mask row i serves all g
    query = query.reshape(batch, heads // groups, groups * rows, dim)
    mask = attention_mask.repeat(1, 1, groups, 1)
    out = torch.nn.functional.scaled_dot_product_attention(query, key, value, attn_mask=mask, scale=scaling)
    return out.reshape(batch, heads, rows, value.shape[-1]).transpose(1, 2).contiguous(), None


def install() -> None:
    """Route `sdpa` through `sdpa` above, for the whole process (transformers' continuous batching
    accepts no other name for SDPA, and the choice is per process). Calls without the batch's
    cache go to transformers' function as before."""
    AttentionInterface.register("sdpa", sdpa)
