"""The skeleton fast path renders exactly what the template renders.

Every chat template TRL ships, and templates written to look at the content in every
other way a template can (filters, tests, macros, captured blocks, indexing, str
methods), render random conversations whose fields are chosen to trip them: leading
newlines, <think> blocks, tool responses, empty strings, special tokens, the
placeholder characters themselves. Each row's text and assistant spans from
template.render_with_spans must equal the template's own rendering and the spans found
in it (template.rendered_with_spans)."""
from __future__ import annotations

import random
from pathlib import Path

import pytest
import trl

from stages.data import skeleton, template
from stages.model.tiny import char_tokenizer
from stages.engine.errors import UserError

TEMPLATES = sorted((Path(trl.__file__).parent / "chat_templates").glob("*.jinja"))
CONTENTS = ["", " ", "\n", "\n\nafter newlines", "before a newline\n", "  padded  ", "</think>", "<think>",
            "<think>\nreasoning\n</think>\n\nthe answer", "<tool_response>out</tool_response>", "<tool_response>",
            "<|im_end|>", "5", "0", "None", "a", "A", "ab", "user", "hello world", "line one\nline two",
            "\t tab", "{{ x }}", "'single' \"double\"", "ünïcödé", "\ue100", "\ue101 and more", "x" * 40]
ANSWERS = [c for c in CONTENTS if c.strip()]  # blank answers never reach rendering (dropped as empty_answer)
REPLAYED = {"qwen3.jinja", "qwen3_training.jinja", "gptoss.jinja", "llama3_2.jinja", "qwen3_5_think.jinja",
            "qwen2_5.jinja", "glm4moe.jinja"}  # (some of the templates the fast path takes)


def conversations(rng: random.Random, n: int) -> list[list[dict]]:
    out = []
    for _ in range(n):
        chat = [{"role": "system", "content": rng.choice(CONTENTS)}] if rng.random() < 0.4 else []
        for _ in range(rng.randint(1, 3)):
            chat.append({"role": "user", "content": rng.choice(CONTENTS)})
            turn = {"role": "assistant", "content": rng.choice(ANSWERS)}
            if rng.random() < 0.4:
                turn["reasoning"] = rng.choice(CONTENTS)
            chat.append(turn)
        out.append(chat)
    return out


def assert_exact(tok, chats) -> int:
    """Each chat renders, with its spans, as through the template itself (rendered_with_spans);
    returns how many took the fast path."""
    fast = 0
    for messages in chats:
        sk = template._skeleton(tok, tok.chat_template, template.shape_of(messages))
        try:
            want = template.rendered_with_spans(tok, messages, sk)
        except UserError:
            with pytest.raises(UserError):
                template.render_with_spans(tok, messages)
            continue
        except Exception:
            continue  # the template refuses this conversation (roles it does not take, say)
        fast += sk is not None and sk.guards is not None and skeleton.holds(sk.guards, messages)
        assert template.render_with_spans(tok, messages) == want, messages
    return fast


@pytest.mark.parametrize("path", TEMPLATES, ids=[p.stem for p in TEMPLATES])
def test_every_shipped_template_renders_the_same_through_the_skeleton(path):
    tok = char_tokenizer()
    tok.chat_template = path.read_text()
    chats = conversations(random.Random(path.stem), 60)
    fast = assert_exact(tok, chats)
    if path.name in REPLAYED:
        assert fast >= 10, fast  # the fast path is taken for the rows that pass the guards


TURN = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}WHAT<|im_end|>\n{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
LOOKS = {  # what the template adds after each message's content, and whether rows can still replay it
    "int": ("{% if m.content|int > 3 %}!{% endif %}", False),
    "length": ("{% if m.content|length > 3 %}!{% endif %}", False),
    "is sequence": ("{% if m.content is sequence %}!{% endif %}", False),
    "is lower": ("{% if m.content is lower %}!{% endif %}", False),
    "tilde": ("{{ m.content ~ '' }}", False),
    "upper": ("{{ m.content|upper }}", False),
    "replace filter": ("{{ m.content|replace('a', 'b') }}", False),
    "replace method": ("{{ m.content.replace('a', 'b') }}", False),
    "format": ("{{ '{}'.format(m.content) }}", False),
    "join": ("{{ [m.content]|join(',') }}", False),
    "tojson": ("{{ m.content|tojson }}", False),
    "iterate": ("{% for c in m.content %}{{ c }}{% endfor %}", False),
    "slice": ("{{ m.content[:3] }}", False),
    "wordcount": ("{% if m.content is string and m.content|wordcount > 1 %}!{% endif %}", False),
    "plain startswith field": ("{% if 'ab'.startswith(m.content) %}!{% endif %}", False),
    "in list": ("{% if m.content in ['a', 'b'] %}!{% endif %}", True),
    "equals": ("{% if m.content == '' %}(empty){% endif %}", True),
    "truth": ("{% if m.content %}!{% else %}(none){% endif %}", True),
    "trim": ("{{ m.content|trim }}", True),
    "split": ("{{ m.content.split('\\n')[0] }}", True),
    "startswith role": ("{% if m.content.startswith(m.role) %}!{% endif %}", True),
    "default": ("{{ m.content|default('x') }}", True),
    "in string filter": ("{% if 'a' in m.content|string %}!{% endif %}", True),
    "namespace": ("{% set ns = namespace(c=m.content) %}{{ ns.c }}", True),
    "strip of a sum": ("{{ (m.content + 'x').strip() }}", True),
    "lstrip newlines": ("{{ m.content.lstrip('\\n') }}{% if m.content.lstrip('\\n') %}!{% endif %}", True),
    "strip, then strip again": ("{{ m.content.strip('\\n').rstrip() }}", True),
    "rstrip with other characters": ("{{ m.content.rstrip('x ') }}", True),
    "macro then test": ("{% macro show(c) %}[{{ c }}]{% endmacro %}{% set x = show(m.content) %}"
                        "{% if 'a' in x %}A{% endif %}{{ x }}", True),
    "captured block": ("{% set x %}{{ m.content }}{% endset %}{{ x.strip() }}{% if x %}!{% endif %}", True),
}


@pytest.mark.parametrize("name", sorted(LOOKS))
def test_templates_that_look_at_the_content_render_the_same(name):
    """Looks a skeleton cannot replay make the shape opaque (every row rendered by the template);
    the others are recorded as guards. Either way each row comes out as the template renders it."""
    look, replayable = LOOKS[name]
    tok = char_tokenizer()
    tok.chat_template = TURN.replace("WHAT", look)
    chats = conversations(random.Random(name), 80)
    fast = assert_exact(tok, chats)
    plain = [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]
    sk = template._skeleton(tok, tok.chat_template, template.shape_of(plain))
    assert (sk.guards is not None) == replayable
    assert (fast > 0) == replayable


WHOLE = {  # templates that reach a field in other ways; each must still render as the template does
    "block read back": "{% block c %}{{ messages[-1].content }}{% endblock %}{% if 'a' in self.c() %}A{% endif %}",
    "slot attribute": "{% for m in messages %}{% if m.content.text is defined %}{{ m.content }}{% else %}"
                      "{{ m.content|trim }}{% endif %}{% endfor %}",
    "index a list by content": "{% for m in messages %}{{ m.content }}{% if messages[m.content] is defined %}!"
                               "{% endif %}{% endfor %}",
    "index the loop by content": "{% for m in messages %}{{ m.content }}{% if loop[m.content] is defined %}?"
                                 "{% endif %}{% endfor %}",
    "recursive loop": "{% for m in messages recursive %}{{ m.content }}{% endfor %}",
    "placeholder literal": "{% for m in messages %}{{ m.content }}{{ '\\ue100' }}{% endfor %}",
    "placeholder token": "{% for m in messages %}{{ m.content }}{{ bos_token }}{% endfor %}",
}


@pytest.mark.parametrize("name", sorted(WHOLE))
def test_other_ways_to_reach_a_field_render_the_same(name):
    """Blocks read back through self, attributes a str lacks, subscripts by a field's text, a
    recursive loop, and placeholder characters in the template's own output (a literal, and
    a special token passed to it): a row the skeleton takes is filled to the template's own
    rendering (these templates need not render assistant turns in a way masks can use)."""
    tok = char_tokenizer()
    tok.add_special_tokens({"bos_token": "\ue102"})  # the character of the second message's content
    tok.chat_template = WHOLE[name] + "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    for messages in conversations(random.Random(name), 60) + [[{"role": "user", "content": c}] for c in
                                                              ("a", "count", "index", " x ", "\ue100")]:
        sk = template._skeleton(tok, tok.chat_template, template.shape_of(messages))
        if sk is not None and sk.guards is not None and skeleton.holds(sk.guards, messages):
            assert template.fill(sk.pieces, messages)[0] == template.render(tok, messages), messages


def test_a_field_stripped_by_the_template_is_replayed_not_guarded():
    """Qwen3's template writes the last answer as content.lstrip('\\n'): rows whose answer starts
    with a line break (a tenth of real code answers) are filled with it stripped, through the
    fast path, to the template's own text and spans."""
    tok = char_tokenizer()
    tok.chat_template = (Path(trl.__file__).parent / "chat_templates" / "qwen3.jinja").read_text()
    messages = [{"role": "user", "content": "q"}, {"role": "assistant", "content": "\n\nfirst line\nsecond"}]
    sk = template._skeleton(tok, tok.chat_template, template.shape_of(messages))
    assert skeleton.holds(sk.guards, messages)
    assert any(not isinstance(p, str) and p[2:] == ("lstrip", "\n") for p in sk.pieces)
    text, spans = template.render_with_spans(tok, messages)
    assert (text, spans) == template.rendered_with_spans(tok, messages, None)
    assert text.endswith("<think>\n\n</think>\n\nfirst line\nsecond<|im_end|>\n")  # the two line breaks stripped


def test_without_jinja_internals_every_row_is_rendered_by_the_template(monkeypatch):
    """The slot compiler overrides two internal methods of jinja2's code generator (pinned 3.1.6).
    A jinja2 without them gives no skeletons, not an error: rows come out as the template renders them."""
    from jinja2.compiler import CodeGenerator

    tok = char_tokenizer()
    tok.chat_template = (Path(trl.__file__).parent / "chat_templates" / "qwen3.jinja").read_text()
    chats = conversations(random.Random("no internals"), 20)
    monkeypatch.delattr(CodeGenerator, "_output_child_pre")
    for cached in (skeleton.slot_template, template._skeleton):
        cached.cache_clear()
    try:
        assert assert_exact(tok, chats) == 0  # not one row through a skeleton, every row exact
    finally:
        monkeypatch.undo()
        for cached in (skeleton.slot_template, template._skeleton):
            cached.cache_clear()
    assert assert_exact(tok, chats) > 0  # and with them, the fast path again
