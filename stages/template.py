"""Rendering conversations with the model's own chat template, and exact loss masks.

Loss falls on what the model itself produces in an assistant turn: everything
after the turn's role header (so a reasoning block such as Qwen3's <think>...
</think> or gpt-oss's analysis channel is included, as the template renders it)
up to and including the end-of-turn token.

Most templates carry no {% generation %} markers, and some rewrite earlier turns
as the conversation grows (Qwen3 drops the reasoning of turns before the last
user message), so masks come from the full rendering itself. A turn's span runs from the end of
the role header that opens it to the end of its content.

Fast path: the template is rendered once per conversation shape (roles, and which
turns carry reasoning) with a placeholder character for each field, giving a
skeleton whose placeholders mark where each field lands. A row whose own rendering
equals its filled skeleton takes its spans from the skeleton. Any other row (the
template changed the content: stripped it, split a <think> block out of it...)
falls back to rendering once more per assistant turn with that turn replaced by a
sentinel: the two texts differ exactly where that turn's own text lies.
"""
from __future__ import annotations

import datetime
import functools
import re

import numpy as np

from stages.errors import UserError
from stages.word_cache import WordCache

SENTINEL = "\ue000"  # a private-use character: never in real text


def for_template(messages: list[dict]) -> list[dict]:
    """Canonical messages as templates read them: reasoning under the names templates use."""
    out = []
    for m in messages:
        m = {"role": m["role"], "content": m["content"], **(
            {"reasoning_content": m["reasoning"], "thinking": m["reasoning"]} if "reasoning" in m else {})}
        out.append(m)
    return out


TEMPLATE_DATE = datetime.date(2024, 7, 26)  # Llama 3's own date for when no clock is given
STRFTIME_CALL = re.compile(r"""strftime_now\(\s*(["'])([^"']*)\1\s*\)""")


@functools.lru_cache(maxsize=8)
def dated(chat_template: str) -> str:
    """The template with each strftime_now("<format>") call replaced by TEMPLATE_DATE in that
    format. Templates that print today's date (gpt-oss's "Current date", Llama 3.x's "Today
    Date") would otherwise render, and shard, the same rows differently from day to day.
    (transformers turns a function passed to the template into a string, so the call itself
    cannot be swapped.)"""
    return STRFTIME_CALL.sub(lambda m: repr(TEMPLATE_DATE.strftime(m.group(2))), chat_template)


def render(tok, messages: list[dict], generation_prompt: bool = False) -> str:
    chat_template = dated(tok.chat_template) if isinstance(tok.chat_template, str) else tok.chat_template
    return tok.apply_chat_template(for_template(messages), tokenize=False, chat_template=chat_template,
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


FIRST_PLACEHOLDER = 0xE100  # private-use characters, two per message (content, reasoning)
MAX_MESSAGES = (0xF8FF - FIRST_PLACEHOLDER) // 2
PLACEHOLDER = re.compile(f"([{chr(FIRST_PLACEHOLDER)}-{chr(0xF8FF)}])")


def shape_of(messages: list[dict]) -> tuple:
    return tuple((m["role"], "reasoning" in m) for m in messages)


@functools.lru_cache(maxsize=256)
def _skeleton(tok, chat_template: str, shape: tuple) -> list[str | tuple[int, str]]:
    """The rendering of a conversation of this shape as literal text and (message, field) slots."""
    messages = []
    for i, (role, has_reasoning) in enumerate(shape):
        m = {"role": role, "content": chr(FIRST_PLACEHOLDER + 2 * i)}
        if has_reasoning:
            m["reasoning"] = chr(FIRST_PLACEHOLDER + 2 * i + 1)
        messages.append(m)
    pieces = []
    for k, piece in enumerate(PLACEHOLDER.split(render(tok, messages))):
        if k % 2 == 0:
            pieces.append(piece)
        else:
            slot = ord(piece) - FIRST_PLACEHOLDER
            pieces.append((slot // 2, "reasoning" if slot % 2 else "content"))
    return pieces


def skeleton_spans(tok, messages: list[dict], full: str) -> list[tuple[int, int]] | None:
    """Assistant spans from the shape's skeleton, or None when the skeleton filled with this
    row's fields is not exactly `full` (or a field does not appear exactly once)."""
    if len(messages) > MAX_MESSAGES or PLACEHOLDER.search(full):
        return None
    filled, first, end, seen = [], {}, {}, set()
    at = 0
    for piece in _skeleton(tok, tok.chat_template, shape_of(messages)):
        if isinstance(piece, tuple):
            if piece in seen:
                return None
            seen.add(piece)
            i, field = piece
            first.setdefault(i, at)
            piece = messages[i][field]
            if field == "content":
                end[i] = at + len(piece)
        filled.append(piece)
        at += len(piece)
    if "".join(filled) != full:
        return None
    header, spans, floor = _header(tok), [], 0
    for i, m in enumerate(messages):
        if m["role"] != "assistant":
            continue
        if i not in end:
            return None
        opened = full.rfind(header, floor, first[i] + len(header))
        if opened < 0:
            return None
        spans.append((min(opened + len(header), first[i]), end[i]))
        floor = end[i]
    return spans


@functools.lru_cache(maxsize=8)
def special_table(tok) -> np.ndarray:
    """A table over token ids: True for the tokenizer's special tokens."""
    special = set(tok.all_special_ids) | {i for i, t in tok.added_tokens_decoder.items() if t.special}
    table = np.zeros(max(tok.get_vocab().values()) + 1, dtype=bool)
    table[sorted(special)] = True
    return table


def loss_mask(ids: np.ndarray, starts: np.ndarray, nonempty: np.ndarray, spans: list[tuple[int, int]],
              special: np.ndarray) -> np.ndarray:
    """1 on tokens that start inside an assistant span, and on the special token that starts
    exactly where a span ends (the turn's end-of-turn token); 0 elsewhere."""
    is_special = special[ids]
    mask = np.zeros(len(ids), dtype=np.uint8)
    for a, b in spans:
        mask |= ((starts >= a) & (starts < b) & nonempty) | ((starts == b) & is_special)
    return mask


def encode_by_words(cache, text: str, spans: list[tuple[int, int]], special: np.ndarray):
    """(ids, mask) from the word cache, or None when a span edge falls inside a word (its
    tokens could then fall on both sides) or the cache cannot encode the text. Every token
    of a word is masked as the word's start is, by loss_mask's rule: the tokens of words
    that start in a span, and the special tokens of the word that starts where it ends."""
    encoded = cache.encode(text)
    if encoded is None:
        return None
    ids, starts = encoded
    edges = np.array(spans, dtype=np.int64).reshape(-1)
    at = np.searchsorted(starts, edges)  # the first token of the word each edge begins
    if not np.array_equal(np.append(starts, len(text))[at], edges):
        return None
    mask = np.zeros(len(ids), dtype=np.uint8)
    for lo, hi, end in zip(at[0::2], at[1::2], np.searchsorted(starts, edges[1::2], side="right")):
        mask[lo:hi] = 1
        mask[hi:end] |= special[ids[hi:end]]
    return ids, mask


def encode_with_offsets(tok, texts: list[str], spans: list, special: np.ndarray) -> list[tuple[np.ndarray, np.ndarray]]:
    """(ids, mask) of each text from one batch call of the Rust tokenizer, masked by its offsets."""
    out = []
    for enc, sp in zip(tok.backend_tokenizer.encode_batch(texts, add_special_tokens=False), spans):
        ids = np.array(enc.ids, dtype=np.int32)
        starts, ends = np.array(enc.offsets, dtype=np.int64).reshape(-1, 2).T
        out.append((ids, loss_mask(ids, starts, ends > starts, sp, special)))
    return out


def encode_chats(tok, conversations: list[list[dict]]) -> list[tuple[np.ndarray, np.ndarray]]:
    """(input_ids, loss mask) per conversation: through the word cache where it reproduces the
    tokenizer (stages/word_cache.py), else through the Rust tokenizer."""
    texts = [render(tok, m) for m in conversations]
    spans = []
    for m, t in zip(conversations, texts):
        fast = skeleton_spans(tok, m, t)
        spans.append(fast if fast is not None else assistant_spans(tok, m, t))
    special, cache = special_table(tok), WordCache.of(tok)
    out = [encode_by_words(cache, t, sp, special) if cache else None for t, sp in zip(texts, spans)]
    rest = [k for k, done in enumerate(out) if done is None]
    for k, done in zip(rest, encode_with_offsets(tok, [texts[k] for k in rest], [spans[k] for k in rest], special)):
        out[k] = done
    return out
