"""Rendering conversations with the model's own chat template, and exact loss masks.

Loss falls on what the model itself produces in an assistant turn: everything
after the turn's role header (so a reasoning block such as Qwen3's <think>...
</think> or gpt-oss's analysis channel is included, as the template renders it)
up to and including the end-of-turn token.

Most templates carry no {% generation %} markers, and some rewrite earlier turns
as the conversation grows (Qwen3 drops the reasoning of turns before the last
user message), so masks come from the full rendering itself. A turn's span runs from the end of
the role header that opens it to the end of its content.

Fast path (stages/skeleton.py): the template is rendered once per conversation shape
(roles, and which turns carry reasoning) with a stand-in for each field, giving a
skeleton whose pieces mark where each field lands, and the tests the template made of
the fields. A row that passes the same tests is its skeleton filled, spans and all.
Any other row (the template rewrites its content: strips it, splits a <think> block
out of it...) is rendered by the template, and its spans come from rendering once more
per assistant turn with that turn replaced by a sentinel: the two texts differ exactly
where that turn's own text lies.
"""
from __future__ import annotations

import functools
import re
from dataclasses import dataclass

import numpy as np
from jinja2.exceptions import TemplateError

from stages.data import skeleton
from stages.data.render import control_pattern, dated, encode_with_controls, for_template, holds_control, render, \
    template_controls
from stages.data.rows import Refused
from stages.engine.errors import UserError
from stages.data.tiktoken_encoder import encoder_of

SENTINEL = "\ue000"  # a private-use character: never in real text


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
        if opened < 0 or alt == full or end < start:  # (an empty turn has an empty span)
            raise UserError("the chat template does not render each assistant turn in place; "
                            "loss masks cannot be derived from it")
        spans.append((min(opened + len(header), start), end))
        floor = end
    return spans


PLACEHOLDER = re.compile(f"([{skeleton.PLACEHOLDERS[0]}-{skeleton.PLACEHOLDERS[1]}])")
MARKED = re.compile(f"([{chr(skeleton.FIRST_MARKER)}-{chr(skeleton.FIRST_MARKER + len(skeleton.TRANSFORMS) - 1)}]?"
                    f"[{skeleton.PLACEHOLDERS[0]}-{skeleton.PLACEHOLDERS[1]}])")


def shape_of(messages: list[dict]) -> tuple:
    return tuple((m["role"], "reasoning" in m) for m in messages)


@dataclass(frozen=True)
class Skeleton:
    """A shape's rendering as literal text and (message, field) pieces (stages/skeleton.py), and
    the guards a row must pass for its rendering to be the pieces filled (None: never)."""
    pieces: tuple
    guards: tuple | None


@functools.lru_cache(maxsize=256)
def _skeleton(tok, chat_template: str, shape: tuple) -> Skeleton | None:
    """The skeleton of conversations of this shape; None for a shape the template refuses, and
    where the template's output holds placeholder characters of its own (the pieces could not
    be told apart: the shape is rendered with two alphabets, which must give the same pieces)."""
    if not isinstance(chat_template, str) or len(shape) > skeleton.MAX_MESSAGES:
        return None
    fields = [("content", "reasoning") if has_reasoning else ("content",) for _, has_reasoning in shape]
    try:
        text, pieces = placeholder_rendering(tok, shape, fields, 0)
        if pieces is None or placeholder_rendering(tok, shape, fields, len(shape))[1] != pieces:
            return None
    except Exception:  # the template refuses this shape: each row is rendered, and says why
        return None
    guards = []
    slots = [{"role": role, **{f: skeleton.Slot(((i, f),), guards) for f in fields[i]}} for i, (role, _) in enumerate(shape)]
    # the call transformers' apply_chat_template makes, with slots for the fields: the messages as
    # render() gives them and the special tokens as plain strings (public API only; if transformers
    # passes the template anything else, the rendering differs from `text` and no row uses the skeleton)
    kwargs = {k: [str(x) for x in v] if isinstance(v, list) else str(v) for k, v in tok.special_tokens_map.items()}
    with_slots = skeleton.render_with_slots(dated(chat_template), for_template(slots), kwargs)
    if with_slots is None or unmarked(with_slots) != text:
        return Skeleton(pieces, None)
    return Skeleton(marked_pieces(with_slots), tuple(guards))


def unmarked(text: str) -> str:
    """A rendering with slots as the template renders the placeholders themselves: without the
    markers of stripped fields."""
    return text.translate({skeleton.FIRST_MARKER + k: None for k in range(len(skeleton.TRANSFORMS))})


def marked_pieces(text: str) -> tuple:
    """A rendering with slots as pieces: literal text, (message, field), and (message, field,
    method, chars) where the template stripped the field."""
    def piece(token: str):
        ref = skeleton.field_of(token[-1])
        return ref + skeleton.TRANSFORMS[ord(token[0]) - skeleton.FIRST_MARKER] if len(token) == 2 else ref

    return tuple(p if k % 2 == 0 else piece(p) for k, p in enumerate(MARKED.split(text)))


def placeholder_rendering(tok, shape: tuple, fields: list, shift: int) -> tuple[str, tuple | None]:
    """The template's rendering of a shape with a placeholder character for each field, and
    its pieces: literal text and (message, field), or None if a placeholder names no field."""
    plain = [{"role": role, **{f: skeleton.placeholder((i, f), shift) for f in fields[i]}} for i, (role, _) in enumerate(shape)]
    text = render(tok, plain)
    pieces = tuple(piece if k % 2 == 0 else skeleton.field_of(piece, shift) for k, piece in enumerate(PLACEHOLDER.split(text)))
    if any(not isinstance(p, str) and not (0 <= p[0] < len(shape) and p[1] in fields[p[0]]) for p in pieces):
        return text, None
    return text, pieces


def fill(pieces: tuple, messages: list[dict]) -> tuple[str, dict, dict, bool]:
    """The pieces with the row's fields in place: (text, where each message's first non-empty
    field starts (else its content), where each content ends, whether every field appears at
    most once). An empty field marks no place: it may sit inside the text of a role header (an
    empty reasoning block that a template's generation prompt also holds)."""
    filled, first, content, end, seen = [], {}, {}, {}, set()
    at, once = 0, True
    for piece in pieces:
        if not isinstance(piece, str):
            i, field = piece[:2]
            once = once and piece[:2] not in seen
            seen.add(piece[:2])
            piece = skeleton.value(messages, piece)
            if piece:
                first.setdefault(i, at)
            if field == "content":
                content[i], end[i] = at, at + len(piece)
        filled.append(piece)
        at += len(piece)
    return "".join(filled), {**content, **first}, end, once


def spans_at(tok, messages: list[dict], text: str, first: dict, end: dict) -> list[tuple[int, int]] | None:
    """Assistant spans from where the fields lie in `text`: from the end of the role header
    before each assistant turn to the end of its content."""
    header, spans, floor = _header(tok), [], 0
    for i, m in enumerate(messages):
        if m["role"] != "assistant":
            continue
        if i not in end:
            return None
        opened = text.rfind(header, floor, first[i] + len(header))
        if opened < 0:
            return None
        spans.append((min(opened + len(header), first[i]), end[i]))
        floor = end[i]
    return spans


def render_with_spans(tok, messages: list[dict]) -> tuple[str, list[tuple[int, int]]]:
    """The rendered conversation and its assistant spans: a row that passes its shape's guards is
    its skeleton filled; any other is rendered by the template (rendered_with_spans)."""
    sk = _skeleton(tok, tok.chat_template, shape_of(messages))
    if sk is None or sk.guards is None or not skeleton.holds(sk.guards, messages):
        return rendered_with_spans(tok, messages, sk)
    text, first, end, once = fill(sk.pieces, messages)
    spans = spans_at(tok, messages, text, first, end) if once else None
    return text, spans if spans is not None else assistant_spans(tok, messages, text)


def rendered_with_spans(tok, messages: list[dict], sk: Skeleton | None) -> tuple[str, list[tuple[int, int]]]:
    """The template's own rendering, with spans from the skeleton where the filled skeleton is
    exactly that rendering, else from re-rendering per assistant turn (assistant_spans)."""
    text, spans = render(tok, messages), None
    if sk is not None and not PLACEHOLDER.search(text):
        filled, first, end, once = fill(sk.pieces, messages)
        if once and filled == text:
            spans = spans_at(tok, messages, text, first, end)
    return text, spans if spans is not None else assistant_spans(tok, messages, text)


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


def masked_by_words(encoded, texts: list[str], spans: list, special: np.ndarray) -> list:
    """(ids, mask) of each text from a fast encoder's tokens (stages/data/tiktoken_encoder.py's
    encoder_of: `starts` are where each token's word starts, or each token itself), or None
    where the encoder has no tokens for the text or a span edge falls inside a word (its tokens
    could then fall on both sides; with each token's own start, loss_mask's rule holds as it is
    and no text is refused for that). Every token of a word is masked as the word's start is, by
    loss_mask's rule: the tokens of words that start in a span, and the special tokens of the
    word that starts where it ends. All texts at once, on their characters end to end."""
    ids, bounds = encoded.ids, encoded.bounds
    base = np.cumsum([0] + [len(t) for t in texts])
    starts = encoded.starts + np.repeat(base[:-1], np.diff(bounds))
    owner = np.array([k for k, sp in enumerate(spans) if encoded.ok[k] for _ in sp], dtype=np.int64)
    edges = np.array([e for k, sp in enumerate(spans) if encoded.ok[k] for span in sp for e in span],
                     dtype=np.int64).reshape(-1, 2) + base[owner, None]
    at = np.searchsorted(starts, edges)  # the first token of the word each edge begins
    inside = (np.append(starts, base[-1])[at] != edges) & (edges != base[owner + 1, None])
    end = np.minimum(np.searchsorted(starts, edges[:, 1], side="right"), bounds[owner + 1])  # (within its text)
    n = len(ids) + 1
    in_span = np.cumsum(np.bincount(at[:, 0], minlength=n) - np.bincount(at[:, 1], minlength=n))[:-1] > 0
    at_end = np.cumsum(np.bincount(at[:, 1], minlength=n) - np.bincount(end, minlength=n))[:-1] > 0
    mask = (in_span | (at_end & special[ids])).astype(np.uint8)
    refused = set() if encoded.per_token else set(owner[inside.any(axis=1)].tolist())  # (per token: loss_mask's rule)
    return [(ids[bounds[k]: bounds[k + 1]], mask[bounds[k]: bounds[k + 1]])
            if encoded.ok[k] and k not in refused else None for k in range(len(texts))]


def masked_by_offsets(ids: list[int], offsets: list[tuple[int, int]], spans: list[tuple[int, int]],
                      special: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(ids, mask) from token ids and each token's character span, as the Rust tokenizer gives them."""
    ids = np.array(ids, dtype=np.int32)
    starts, ends = np.array(offsets, dtype=np.int64).reshape(-1, 2).T
    return ids, loss_mask(ids, starts, ends > starts, spans, special)


def encode_with_offsets(tok, texts: list[str], spans: list, special: np.ndarray) -> list[tuple[np.ndarray, np.ndarray]]:
    """(ids, mask) of each text from one batch call of the Rust tokenizer, masked by its offsets."""
    return [masked_by_offsets(enc.ids, enc.offsets, sp, special)
            for enc, sp in zip(tok.backend_tokenizer.encode_batch(texts, add_special_tokens=False), spans)]


def render_or_refuse(tok, messages: list[dict], generation_prompt: bool = False) -> str | Refused:
    try:
        return render(tok, messages, generation_prompt)
    except TemplateError as e:
        return Refused(e)


def encode_chats(tok, conversations: list[list[dict]]) -> list[tuple[np.ndarray, np.ndarray] | Refused]:
    """(input_ids, loss mask) per conversation, or why the template refused it: through the
    fastest encoder that reproduces the tokenizer (tiktoken_encoder.encoder_of), else through
    the Rust tokenizer. A conversation whose fields hold a special token's text (a row about chat
    templates, source code that names <|endoftext|>, or an attempt to open a turn of another
    role) has those texts encoded as text (render.encode_with_controls)."""
    out, texts, spans, rendered = [], [], [], []
    special, pattern = special_table(tok), control_pattern(tok)
    for k, m in enumerate(conversations):
        try:
            text, sp = render_with_spans(tok, m)
        except TemplateError as e:
            out.append(Refused(e))
            continue
        if holds_control(m, pattern):
            own = template_controls(tok, m, text, pattern)
            out.append(Refused(ValueError("a field holds a special token's text and the chat template's output "
                                          "changes with it, so the template's own cannot be told apart"))
                       if own is None else masked_by_offsets(*encode_with_controls(tok, text, own), sp, special))
            continue
        out.append(None)
        texts.append(text)
        spans.append(sp)
        rendered.append(k)
    encoder = encoder_of(tok)
    done = masked_by_words(encoder.encode_batch(texts), texts, spans, special) if encoder else [None] * len(texts)
    rest = [j for j, d in enumerate(done) if d is None]
    for j, d in zip(rest, encode_with_offsets(tok, [texts[j] for j in rest], [spans[j] for j in rest], special)):
        done[j] = d
    for k, d in zip(rendered, done):
        out[k] = d
    return out
