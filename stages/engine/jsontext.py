"""JSON that came from outside this process (a remote entry, a pulled manifest or plan) parsed only
once its nesting is known to be shallow.

json's C parser recurses once per list or object. At Python's default recursion limit a deep text
raises RecursionError, but web3 imports py_ecc, which raises that limit to 100,000, and then a
text a few tens of thousands of levels deep overflows the C stack first and kills the process
(a 4 MiB remote entry can nest two million levels). So the depth is counted on the text itself,
with no recursion, before the parser sees it."""
from __future__ import annotations

import json
import re

# Entries nest 7 levels (entry, sidecar, inputs, params, a recipe section, its options) and
# manifests about as many; 32 leaves room for deeper recipes and stays far below any recursion
# limit, which key_of's json.dumps of the inputs would otherwise meet.
DEPTH_CAP = 32
STRING = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"', re.S)  # a JSON string, escapes included
NOT_BRACKET = re.compile(rb"[^\[\]{}]")


class TooDeep(ValueError):
    """A JSON text whose lists and objects nest deeper than the cap: refused unparsed."""


def deeper_than(data: bytes, cap: int = DEPTH_CAP) -> bool:
    """Whether lists and objects nest more than `cap` levels in the JSON text `data` (brackets inside
    strings do not count). For a text that is not JSON the count may be off; the parser says so."""
    brackets = NOT_BRACKET.sub(b"", STRING.sub(b"", data))
    if brackets.count(b"[") + brackets.count(b"{") <= cap:
        return False  # the usual case: too few openings to nest that deep, decided in C
    level = 0
    for byte in brackets:
        level = level + 1 if byte in b"[{" else max(level - 1, 0)  # extra closings hide nothing
        if level > cap:
            return True
    return False


def loads(data: bytes | str, cap: int = DEPTH_CAP):
    """json.loads of `data`, after refusing with TooDeep a text nested deeper than `cap`. Anything
    else wrong with it is json's ValueError, as before."""
    raw = data.encode("utf-8", "surrogatepass") if isinstance(data, str) else data
    if deeper_than(raw, cap):
        raise TooDeep(f"nested deeper than {cap} levels")
    return json.loads(data)
