"""Rendering a conversation with the model's own chat template, the same text on any day:
what the shards stage tokenizes and what eval prompts with; and its tokens with special tokens
only where the template wrote them (a field's "<|im_end|>" is text), for training and serving."""
from __future__ import annotations

import datetime
import functools
import re


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


@functools.lru_cache(maxsize=8)
def control_pattern(tok) -> re.Pattern | None:
    """The texts of the tokenizer's special tokens (<|im_start|>, <|im_end|>, <|endoftext|>, ...)
    as one pattern, longest first; None where it has none."""
    texts = sorted({t.content for t in tok.added_tokens_decoder.values() if t.special and t.content}, key=len, reverse=True)
    return re.compile("|".join(map(re.escape, texts))) if texts else None


def holds_control(messages: list[dict], pattern: re.Pattern | None) -> bool:
    """Whether a field of the conversation (any text but a role) holds a special token's text."""
    return pattern is not None and any(isinstance(v, str) and k != "role" and pattern.search(v)
                                       for m in messages for k, v in m.items())


def quoted_control(view: list[tuple[str, str, bool]], pattern: re.Pattern | None) -> str | None:
    """The first special token's text in a record's fields (a data kind's lines(record)), or None."""
    if pattern is not None:
        for _, text, _ in view:
            found = pattern.search(text)
            if found:
                return found.group()
    return None


MASK = "\ue0ff"  # a private-use character: never in real text, none of the template code's markers


def template_controls(tok, messages: list[dict], text: str, pattern: re.Pattern,
                      generation_prompt: bool = False) -> list[tuple[int, int]] | None:
    """Where the chat template itself wrote special tokens in `text` (the conversation rendered),
    as character ranges: rendered again with each special token's text in the fields masked
    character for character, the template's own are the ones left. None where the masked
    rendering differs from `text` anywhere but in the masked characters (a template whose output
    depends on those texts: its own special tokens cannot be told apart from the fields')."""
    from jinja2.exceptions import TemplateError

    hidden = [{k: pattern.sub(lambda found: MASK * len(found.group()), v) if isinstance(v, str) and k != "role" else v
               for k, v in m.items()} for m in messages]
    try:
        other = render(tok, hidden, generation_prompt)
    except TemplateError:
        return None
    if len(other) != len(text) or any(o != t and o != MASK for o, t in zip(other, text)):
        return None
    return [found.span() for found in pattern.finditer(other)]


@functools.lru_cache(maxsize=8)
def text_tokenizer(tok):
    """A copy of the tokenizer's Rust tokenizer that encodes special tokens' texts as text (a
    copy, so that no thread's encode sees the switch flip; transformers' split_special_tokens=True
    also leaves it on in the tokenizer it was given)."""
    from tokenizers import Tokenizer

    plain = Tokenizer.from_str(tok.backend_tokenizer.to_str())
    plain.encode_special_tokens = True
    return plain


def encode_with_controls(tok, text: str, own: list[tuple[int, int]]) -> tuple[list[int], list[tuple[int, int]]]:
    """Token ids of `text` and each token's character span, with special tokens only at `own`
    (template_controls). The tokenizer splits a text at its special tokens and encodes the pieces
    between them on their own, so encoding the pieces between the template's own ones with special
    tokens taken as text gives exactly its ids wherever the fields hold none (for special tokens
    that take no whitespace beside them into themselves, lstrip and rstrip off, as Qwen's have)."""
    cuts = [0] + [e for span in own for e in span] + [len(text)]
    controls, ids, offsets = {a for a, _ in own}, [], []
    for a, b in zip(cuts, cuts[1:]):
        if b > a:
            enc = (tok.backend_tokenizer if a in controls else text_tokenizer(tok)).encode(text[a:b], add_special_tokens=False)
            ids += enc.ids
            offsets += [(a + s, a + e) for s, e in enc.offsets]
    return ids, offsets


def prompt_ids(tok, messages: list[dict]) -> list[int]:
    """The conversation rendered with the generation prompt, as token ids: what a served model is
    given. A field's special-token text is text (a client cannot open a turn of another role); a
    template whose output depends on such text refuses the messages (jinja2's TemplateError)."""
    from jinja2.exceptions import TemplateError

    text, pattern = render(tok, messages, generation_prompt=True), control_pattern(tok)
    if not holds_control(messages, pattern) or getattr(tok, "backend_tokenizer", None) is None:
        return tok(text)["input_ids"]
    own = template_controls(tok, messages, text, pattern, generation_prompt=True)
    if own is None:
        raise TemplateError("a message holds a special token's text and the chat template's output changes with it")
    before, after = added_around(tok)
    return before + encode_with_controls(tok, text, own)[0] + after


@functools.lru_cache(maxsize=8)
def added_around(tok) -> tuple[list[int], list[int]]:
    """The special tokens the tokenizer adds before and after a text it encodes (a BOS, say)."""
    marked, bare = tok("a")["input_ids"], tok("a", add_special_tokens=False)["input_ids"]
    at = next(i for i in range(len(marked) - len(bare) + 1) if marked[i: i + len(bare)] == bare)
    return marked[:at], marked[at + len(bare):]
