"""A chat template rendered once per conversation shape, and replayed for each row.

A template's output is, nearly always, literal text around the messages' own fields.
Rendering it once per shape (roles, and which turns carry reasoning) with a Slot in
place of each field gives that skeleton; every way the template looked at a field on
the way ('</think>' in content, content.startswith(...), content == '', `if content`,
a strip or split that left it whole) is recorded as a guard with its result. A field
stripped on its own (Qwen3's `content.lstrip('\n')`) is not a guard but part of the
skeleton: the piece is the row's field stripped the same way when it is filled. A row
whose fields give every guard the same result takes the same branches through the
template and joins the same pieces, so its rendering is the skeleton with its fields
in place. Any other row is rendered by the template itself.

Slot is not a str: no C-level string code can read it unseen, and str() of it raises.
The template can add it to strings, output it at the top level, and test it through
the methods below; output captured by a macro or a {% set %} block is a slot too.
Anything else (len, iteration, str.join, subscripting by it, a filter or test that is
not replayed) raises Opaque, and rows of that shape are rendered by the template, as
are all rows of a template with {% block %}s (a block's output returns as plain text).
"""
from __future__ import annotations

import functools

FIRST_PLACEHOLDER = 0xE100  # private-use characters, two per message (content, reasoning)
MAX_MESSAGES = (0xF8FF - FIRST_PLACEHOLDER) // 4  # two alphabets of two characters a message
PLACEHOLDERS = (chr(FIRST_PLACEHOLDER), chr(0xF8FF))


# strip, lstrip and rstrip of a lone field, with these characters, are replayed on the row's field;
# in a rendering with slots, the field's placeholder is preceded by the transform's marker character
TRANSFORMS = (("strip", None), ("lstrip", None), ("rstrip", None), ("strip", "\n"), ("lstrip", "\n"), ("rstrip", "\n"))
FIRST_MARKER = 0xE0F0


def marker(transform: tuple) -> str:
    return chr(FIRST_MARKER + TRANSFORMS.index(transform))


def value(messages: list[dict], ref: tuple) -> str:
    """A field's text for a reference: (message, field), or (message, field, method, chars) for a
    field stripped by the template."""
    text = messages[ref[0]][ref[1]]
    return getattr(text, ref[2])(ref[3]) if len(ref) == 4 else text


def placeholder(ref: tuple[int, str], shift: int = 0) -> str:
    """The character that stands for a field; `shift` moves the whole alphabet by messages."""
    i, field = ref
    return chr(FIRST_PLACEHOLDER + 2 * (i + shift) + (field == "reasoning"))


def field_of(char: str, shift: int = 0) -> tuple[int, str]:
    slot = ord(char) - FIRST_PLACEHOLDER - 2 * shift
    return slot // 2, "reasoning" if slot % 2 else "content"


class Opaque(BaseException):
    """The template used a field in a way a skeleton cannot replay. (Not an Exception, so that
    no `except Exception` in a filter or test can turn it into a quiet default.)"""


# What a guard can ask of a field's text; each gives the same answer for equal texts.
CHECKS = {
    "in": lambda text, x: x in text,
    "startswith": lambda text, x: text.startswith(x),
    "endswith": lambda text, x: text.endswith(x),
    "eq": lambda text, x: text == x,
    "bool": bool,
    "strip": lambda text, chars: text.strip(chars) == text,
    "lstrip": lambda text, chars: text.lstrip(chars) == text,
    "rstrip": lambda text, chars: text.rstrip(chars) == text,
    "split": lambda text, sep, maxsplit: text.split(sep, maxsplit) == [text],
}


def is_text(x) -> bool:
    return isinstance(x, str) or (isinstance(x, tuple) and all(isinstance(s, str) for s in x))


class Slot:
    """Text made of literal strings and (message, field) references, standing in for a str."""

    __slots__ = ("_parts", "_text", "_guards")  # underscored: the sandbox shows a template none of them

    def __init__(self, parts: tuple, guards: list):
        self._parts, self._guards = parts, guards
        self._text = "".join(p if isinstance(p, str) else (marker(p[2:]) if len(p) == 4 else "") + placeholder(p[:2])
                             for p in parts)

    def _ask(self, check: str, *args):
        if not all(a is None or isinstance(a, int) or is_text(a) for a in args):
            raise Opaque(check)
        result = CHECKS[check](self._text, *args)
        self._guards.append((self._parts, check, args, result))
        return result

    def _whole(self, check: str, *args) -> Slot:
        """A strip or split that leaves the text whole: recorded, and the slot itself is the result."""
        if not self._ask(check, *args):
            raise Opaque(check)
        return self

    def __add__(self, other):
        if isinstance(other, (str, Slot)):
            return Slot(self._parts + (other._parts if isinstance(other, Slot) else (other,)), self._guards)
        return NotImplemented

    def __radd__(self, other):
        return Slot((other,) + self._parts, self._guards) if isinstance(other, str) else NotImplemented

    def __contains__(self, x):
        return self._ask("in", x)

    def startswith(self, prefix):
        return self._ask("startswith", prefix)

    def endswith(self, suffix):
        return self._ask("endswith", suffix)

    def _stripped(self, method: str, chars) -> Slot:
        """A lone field stripped: the field with the method applied when filled. Anything else
        stripped must be left whole by it (a guard)."""
        lone = len(self._parts) == 1 and not isinstance(self._parts[0], str) and len(self._parts[0]) == 2
        if lone and (method, chars) in TRANSFORMS:
            return Slot((self._parts[0] + (method, chars),), self._guards)
        return self._whole(method, chars)

    def strip(self, chars=None):
        return self._stripped("strip", chars)

    def lstrip(self, chars=None):
        return self._stripped("lstrip", chars)

    def rstrip(self, chars=None):
        return self._stripped("rstrip", chars)

    def split(self, sep=None, maxsplit=-1):
        return [self._whole("split", sep, maxsplit)]

    def __eq__(self, other):
        if isinstance(other, Slot):
            raise Opaque("==")
        return self._ask("eq", other) if isinstance(other, str) else NotImplemented

    def __ne__(self, other):
        equal = self.__eq__(other)
        return equal if equal is NotImplemented else not equal

    def __bool__(self):
        return self._ask("bool")

    def _opaque(self, *args, **kwargs):
        raise Opaque("a use of a field that is not replayed")

    __hash__ = __str__ = __repr__ = __format__ = __len__ = __iter__ = __getitem__ = __index__ = _opaque
    __lt__ = __le__ = __gt__ = __ge__ = __mul__ = __rmul__ = __mod__ = __rmod__ = _opaque


# Tests whose result is the same for every str: evaluated on "" in place of a slot.
TYPE_TESTS = {"boolean", "callable", "defined", "false", "float", "integer", "mapping", "none", "number",
              "string", "true", "undefined"}
# Tests that are an operator, which Slot records (or refuses) itself.
OPERATOR_TESTS = {"!=", "<", "<=", "==", ">", ">=", "eq", "equalto", "ge", "greaterthan", "gt", "in", "le",
                  "lessthan", "lt", "ne"}
# Filters that only add, test or pass a value through: safe to hand a slot.
PASSING_FILTERS = {"default", "d"}


def guarded_test(name: str, test):
    def run(*args, **kwargs):
        if not any(isinstance(a, Slot) for a in (*args, *kwargs.values())):
            return test(*args, **kwargs)
        if name in TYPE_TESTS and len(args) == 1 and not kwargs:
            return test("")
        if name in OPERATOR_TESTS:
            return test(*args, **kwargs)
        raise Opaque(f"test {name}")
    return passing_args_as(test, run)


def guarded_filter(name: str, f):
    def run(*args, **kwargs):
        if not any(isinstance(a, Slot) for a in (*args, *kwargs.values())):
            return f(*args, **kwargs)
        if name == "trim" and isinstance(args[0], Slot):  # do_trim(value, chars=None)
            return args[0].strip(*args[1:], **kwargs)
        if name == "string" and isinstance(args[0], Slot):  # a str already
            return args[0]
        if name in PASSING_FILTERS:
            return f(*args, **kwargs)
        raise Opaque(f"filter {name}")
    return passing_args_as(f, run)


def passing_args_as(original, wrapper):
    """The wrapper takes the context, eval context or environment first if the original does."""
    if hasattr(original, "jinja_pass_arg"):
        wrapper.jinja_pass_arg = original.jinja_pass_arg
    return wrapper


def top_level(value):
    """Output at the top level of the template: a slot's text, placeholders and all."""
    return value._text if isinstance(value, Slot) else value


def captured(value):
    """Output captured by a macro or a {% set %} block: a slot stays a slot (joined by `concat`
    into the captured text), so the template can only use the capture in the ways above."""
    return value if isinstance(value, Slot) else str(value)


def concat(pieces):
    """jinja's "".join, for captured pieces that may hold slots: then a slot of them all."""
    pieces = list(pieces)
    slots = [p for p in pieces if isinstance(p, Slot)]
    if not slots:
        return "".join(pieces)
    return Slot(tuple(part for p in pieces for part in (p._parts if isinstance(p, Slot) else (p,))), slots[0]._guards)


def getitem_by_text(getitem, obj, argument):
    """obj[argument], refused for a slot as the argument: jinja looks a str argument up as an
    attribute too, where a slot's lookup would simply fail."""
    if isinstance(argument, Slot):
        raise Opaque("a field used as an index")
    return getitem(obj, argument)


def no_slot(value):
    if isinstance(value, Slot):
        raise Opaque("a field output where text is escaped")
    return value


@functools.lru_cache(maxsize=8)
def slot_template(chat_template: str):
    """The template compiled in a chat environment (chat_environment) with slots in mind:
    filters, tests and subscripts guarded, and outputs split into top-level ones and captured
    ones. None for a template with blocks, extends, includes or imports."""
    from jinja2 import nodes
    from jinja2.compiler import CodeGenerator

    # jinja2's code generator has no public hook for an output's wrapping, so the two methods below
    # override its internals (pyproject pins jinja2 3.1.6). Where a jinja2 lacks them: no skeletons,
    # every row rendered by the template itself (tests/test_skeleton.py)
    if not all(hasattr(CodeGenerator, name) for name in ("_output_child_pre", "_output_child_post")):
        return None

    class Generator(CodeGenerator):
        """Top-level output as usual (finalize: top_level); captured output through `captured`, or,
        where autoescaping may apply, refused for slots."""

        @staticmethod
        def plain_capture(frame) -> bool:
            return frame.buffer is not None and not frame.eval_ctx.volatile and not frame.eval_ctx.autoescape

        def _output_child_pre(self, node, frame, finalize):
            if self.plain_capture(frame):
                self.write("environment.captured(")
                return
            super()._output_child_pre(node, frame, finalize)
            if frame.buffer is not None:
                self.write("environment.no_slot(")

        def _output_child_post(self, node, frame, finalize):
            if self.plain_capture(frame):
                self.write(")")
                return
            if frame.buffer is not None:
                self.write(")")
            super()._output_child_post(node, frame, finalize)

    base = chat_environment()
    if any(base.parse(chat_template).find_all((nodes.Block, nodes.Extends, nodes.Include, nodes.Import, nodes.FromImport))):
        return None  # a block's output comes back as plain text through self.<block>()
    env = base.overlay(finalize=top_level)
    env.code_generator_class = Generator
    env.captured, env.no_slot, env.concat = captured, no_slot, concat
    env.getitem = functools.partial(getitem_by_text, base.getitem)
    env.tests = {name: guarded_test(name, t) for name, t in base.tests.items()}
    env.filters = {name: guarded_filter(name, f) for name, f in base.filters.items()}
    return env.from_string(chat_template)


def chat_environment():
    """A sandboxed jinja environment set up as transformers renders chat templates (trim_blocks,
    lstrip_blocks, loop controls, tojson, raise_exception, dict), with {% generation %} blocks
    inlined (they only mark positions): built here, as transformers' own compiler is not public
    API. A difference would only show as a skeleton whose rendering is not the template's own
    (render_with_slots's text is compared with apply_chat_template's), whose rows are then
    rendered by the template."""
    import json

    import jinja2.ext
    from jinja2.exceptions import TemplateError
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message):
        raise TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    class InlineGeneration(jinja2.ext.Extension):
        tags = {"generation"}

        def parse(self, parser):
            next(parser.stream)
            return parser.parse_statements(("name:endgeneration",), drop_needle=True)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[jinja2.ext.loopcontrols, InlineGeneration])
    env.filters["tojson"] = tojson
    env.globals.update(raise_exception=raise_exception, dict=dict)
    return env


def render_with_slots(chat_template: str, chat: list[dict], kwargs: dict) -> str | None:
    """The template's output for a chat whose fields are slots (their guards recorded as it
    renders); None if it used a field in a way that cannot be replayed, or failed."""
    compiled = slot_template(chat_template)
    if compiled is None:
        return None
    try:
        text = compiled.render(messages=chat, tools=None, documents=None, add_generation_prompt=False, **kwargs)
    except (Opaque, Exception):  # (a template that refuses the shape: each row is rendered, and says why)
        return None
    return text if isinstance(text, str) else None  # (a recursive loop returns its output unjoined)


def holds(guards: list, messages: list[dict]) -> bool:
    """Whether a row's fields give every guard its recorded result."""
    for parts, check, args, result in guards:
        if len(parts) == 1 and not isinstance(parts[0], str):
            text = value(messages, parts[0])
        else:
            text = "".join(p if isinstance(p, str) else value(messages, p) for p in parts)
        if CHECKS[check](text, *args) != result:
            return False
    return True
