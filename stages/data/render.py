"""Rendering a conversation with the model's own chat template, the same text on any day:
what the shards stage tokenizes and what eval prompts with."""
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
