"""JSON that may have come from outside this process (a remote entry, or any JSON file of an
artifact, which a pull may have installed) parsed only once its nesting is known to be shallow.

json's C parser recurses once per list or object. At Python's default recursion limit a deep text
raises RecursionError, but web3 imports py_ecc, which raises that limit to 100,000, and then a
text a few tens of thousands of levels deep overflows the C stack first and kills the process
(a 4 MiB remote entry can nest two million levels). So the depth is counted on the text itself,
with no recursion, before the parser sees it. Bytes must be UTF-8 (as everything here writes
them): json would also decode UTF-16 and UTF-32, whose bytes the count could not read."""
from __future__ import annotations

import json
import re
from pathlib import Path

# Entries nest 7 levels (entry, sidecar, inputs, params, a recipe section, its options) and
# manifests about as many; 32 leaves room for deeper recipes and stays far below any recursion
# limit, which key_of's json.dumps of the inputs would otherwise meet.
DEPTH_CAP = 32
# Bytes of one JSON file of an artifact: a manifest, eval.json or a model's config.json take KBs; a
# remote may declare a file of up to 1 TiB, which read whole would take the memory instead.
SIZE_CAP = 64 << 20
# A JSON string, escapes included, or an unterminated one to the end of the text. Possessive, so a
# text of escaped quotes is scanned once, not once from each quote.
STRING = re.compile(r'"[^"\\]*+(?:\\.[^"\\]*+)*+(?:"|\\?\Z)', re.S)
NOT_BRACKET = re.compile(r"[^\[\]{}]")


class TooDeep(ValueError):
    """A JSON text whose lists and objects nest deeper than the cap: refused unparsed."""


class TooLarge(ValueError):
    """A JSON file larger than its cap: refused, unread past it."""


def deeper_than(text: str, cap: int = DEPTH_CAP) -> bool:
    """Whether lists and objects nest more than `cap` levels in the JSON text `text`, brackets
    inside strings not counted: exact for JSON; for a text that is not, at least as deep as any
    nesting json's parser would enter before it found the error."""
    if text.count("[") + text.count("{") <= cap:
        return False  # too few openings, strings' included, to nest that deep: decided without a regex pass
    brackets = NOT_BRACKET.sub("", STRING.sub("", text))
    if brackets.count("[") + brackets.count("{") <= cap:
        return False  # the usual case: too few openings to nest that deep, decided in C
    level = 0
    for char in brackets:
        level = level + 1 if char in "[{" else max(level - 1, 0)  # extra closings hide nothing
        if level > cap:
            return True
    return False


def loads(data: bytes | str, cap: int = DEPTH_CAP):
    """json.loads of `data` (bytes: UTF-8), after refusing with TooDeep a text nested deeper than
    `cap`. Bytes that are not UTF-8 and text that is not JSON are ValueErrors, as json's own are."""
    text = data.decode("utf-8") if isinstance(data, (bytes, bytearray)) else data
    if deeper_than(text, cap):
        raise TooDeep(f"nested deeper than {cap} levels")
    return json.loads(text)


def read(path: Path, cap: int = DEPTH_CAP, size_cap: int | None = None):
    """loads of the file at `path`, refused with TooLarge past `size_cap` bytes (default SIZE_CAP),
    unread beyond them: how a stage reads a JSON file of an artifact."""
    size_cap = SIZE_CAP if size_cap is None else size_cap
    with open(path, "rb") as f:
        data = f.read(size_cap + 1)
    if len(data) > size_cap:
        raise TooLarge(f"{path}: larger than {size_cap:,} bytes, which no JSON file of an artifact is")
    return loads(data, cap)
