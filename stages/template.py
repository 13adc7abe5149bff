"""Rendering conversations with the model's own chat template, and exact loss masks.

Loss falls on what the model itself produces in an assistant turn: everything
after the turn's role header (so a reasoning block such as Qwen3's <think>...
</think> or gpt-oss's analysis channel is included, as the template renders it)
up to and including the end-of-turn token.

Most templates carry no {% generation %} markers, and some rewrite earlier turns
as the conversation grows (Qwen3 drops the reasoning of turns before the last
user message), so masks come from the full rendering itself: render once more
with one assistant turn replaced by a sentinel; the two texts differ exactly
where that turn's own text lies.
"""
from __future__ import annotations

import functools

import numpy as np

from stages.errors import UserError

SENTINEL = "\ue000"  # a private-use character: never in real text


def for_template(messages: list[dict]) -> list[dict]:
    """Canonical messages as templates read them: reasoning under the names templates use."""
    out = []
    for m in messages:
        m = {"role": m["role"], "content": m["content"], **(
            {"reasoning_content": m["reasoning"], "thinking": m["reasoning"]} if "reasoning" in m else {})}
        out.append(m)
    return out


def render(tok, messages: list[dict], generation_prompt: bool = False) -> str:
    return tok.apply_chat_template(for_template(messages), tokenize=False,
                                   add_generation_prompt=generation_prompt)


def _header(tok) -> str:
    return _header_of(tok, tok.chat_template)


@functools.lru_cache(maxsize=8)
def _header_of(tok, chat_template: str) -> str:
    """The role header the template opens an assistant turn with (its generation prompt)."""
    probe = [{"role": "user", "content": "x"}]
    with_prompt, without = render(tok, probe, True), render(tok, probe)
    if not with_prompt.startswith(without) or with_prompt == without:
        raise UserError("the chat template has no generation prompt; cannot tell where assistant turns begin")
    return with_prompt[len(without):]


def _common_prefix(a: str, b: str) -> int:
    lo, hi = 0, min(len(a), len(b))
    while lo < hi:  # binary search on slice equality: C-speed comparisons
        mid = (lo + hi + 1) // 2
        if a[:mid] == b[:mid]:
            lo = mid
        else:
            hi = mid - 1
    return lo


def _common_suffix(a: str, b: str, limit: int) -> int:
    lo, hi = 0, min(len(a), len(b), limit)
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if a[len(a) - mid:] == b[len(b) - mid:]:
            lo = mid
        else:
            hi = mid - 1
    return lo


def assistant_spans(tok, messages: list[dict], full: str) -> list[tuple[int, int]]:
    """Character spans in `full` (the rendered conversation) that each assistant turn produces,
    from after its role header to the end of its text (the end-of-turn token follows)."""
    header, spans, floor = _header(tok), [], 0
    for i, m in enumerate(messages):
        if m["role"] != "assistant":
            continue
        alt = render(tok, messages[:i] + [{"role": "assistant", "content": SENTINEL}] + messages[i + 1:])
        start = _common_prefix(full, alt)
        end = len(full) - _common_suffix(full, alt, len(full) - start)
        opened = full.rfind(header, floor, start + len(header))
        if opened < 0 or end <= start:
            raise UserError("the chat template does not render each assistant turn in place; "
                            "loss masks cannot be derived from it")
        spans.append((min(opened + len(header), start), end))
        floor = end
    return spans


@functools.lru_cache(maxsize=8)
def special_ids(tok) -> frozenset[int]:
    return frozenset(tok.all_special_ids) | frozenset(
        i for i, t in tok.added_tokens_decoder.items() if t.special)


def loss_mask(ids: list[int], offsets, spans: list[tuple[int, int]], special: frozenset[int]) -> np.ndarray:
    """1 on tokens that start inside an assistant span, and on the special token that starts
    exactly where a span ends (the turn's end-of-turn token); 0 elsewhere."""
    off = np.asarray(offsets, dtype=np.int64).reshape(-1, 2)
    start, nonempty = off[:, 0], off[:, 1] > off[:, 0]
    is_special = np.isin(np.asarray(ids), np.fromiter(special, dtype=np.int64))
    mask = np.zeros(len(ids), dtype=np.uint8)
    for a, b in spans:
        mask |= ((start >= a) & (start < b) & nonempty) | ((start == b) & is_special)
    return mask


def encode_chats(tok, conversations: list[list[dict]]) -> list[tuple[list[int], list[int]]]:
    """(input_ids, loss mask) per conversation; tokenized in one batch call."""
    texts = [render(tok, m) for m in conversations]
    spans = [assistant_spans(tok, m, t) for m, t in zip(conversations, texts)]
    enc = tok(texts, add_special_tokens=False, return_offsets_mapping=True)
    special = special_ids(tok)
    return [(ids, loss_mask(ids, off, sp, special))
            for ids, off, sp in zip(enc["input_ids"], enc["offset_mapping"], spans)]
