"""JSON from outside is refused unparsed when it nests too deep, even where web3 has raised Python's
recursion limit (stages/engine/jsontext.py)."""
import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

from stages.engine import jsontext
from stages.engine.jsontext import DEPTH_CAP, TooDeep, deeper_than, loads, read

REPO = Path(__file__).resolve().parents[1]


def nested(depth: int, inner: str = "1") -> str:
    return "[" * depth + inner + "]" * depth


@pytest.mark.parametrize("text, deep", [
    (nested(DEPTH_CAP), False),
    (nested(DEPTH_CAP + 1), True),
    ('{"a": ' * DEPTH_CAP + "1" + "}" * DEPTH_CAP, False),
    ('{"a": ' * (DEPTH_CAP + 1) + "1" + "}" * (DEPTH_CAP + 1), True),
    (json.dumps({"s": "[" * 1000}), False),  # brackets inside a string are text
    (json.dumps({"s": 'x\\"[[[' * 100}), False),  # so are those after an escaped quote
    (json.dumps([[1], [2], [3]] * 1000), False),  # many lists, none deep
    (nested(2) + "]" * 1000 + nested(DEPTH_CAP + 1), True),  # closings cannot hide a deep part
], ids=["at-cap", "over-cap", "objects-at-cap", "objects-over-cap", "string", "escaped-quote", "wide",
        "unbalanced"])
def test_depth_is_counted_on_the_text(text, deep):
    assert deeper_than(text) is deep


def test_a_text_of_escaped_quotes_is_counted_in_linear_time():
    """An unterminated string of escaped quotes, which a backtracking pattern rescans from every
    quote (hours for 4 MiB): possessive, once."""
    start = time.perf_counter()
    assert not deeper_than('"' + '\\"' * (2 << 20))
    assert time.perf_counter() - start < 2


def test_bytes_are_read_as_utf8_only():
    """json would decode UTF-16 and UTF-32, whose bytes can hide quotes and backslashes from a count
    of the bytes (U+2200 holds the byte of '"'): the text is decoded as UTF-8, counted and parsed as
    that same text, so a deep text so encoded is refused."""
    hiding = '["\u2200",' + "[" * 100 + '""' + "]" * 101
    for encoding in ("utf-16-le", "utf-16", "utf-32"):
        with pytest.raises(ValueError) as e:
            loads(hiding.encode(encoding))
        assert not isinstance(e.value, RecursionError)
    assert loads(json.dumps({"a": "é"}).encode()) == {"a": "é"}


def test_loads_parses_what_is_shallow_and_refuses_what_is_not():
    value = {"a": [{"b": "[{"}], "c": "é"}
    assert loads(json.dumps(value)) == value == loads(json.dumps(value).encode())
    with pytest.raises(TooDeep, match=f"nested deeper than {DEPTH_CAP} levels"):
        loads(nested(100))
    with pytest.raises(ValueError):
        loads(b"{not json")


def test_a_file_past_the_size_cap_is_refused_unread(tmp_path, monkeypatch):
    """A remote may declare a JSON file of an artifact of up to 1 TiB: read() reads at most one byte
    past its cap, then refuses, naming the file."""
    monkeypatch.setattr(jsontext, "SIZE_CAP", 1 << 10)
    path = tmp_path / "manifest.json"
    path.write_text(json.dumps({"a": "x" * 1000}))
    assert read(path) == {"a": "x" * 1000}
    path.write_text(json.dumps({"a": "x" * 1100}))
    with pytest.raises(ValueError, match=f"{path}: larger than 1,024 bytes"):
        read(path)


def test_a_deep_text_is_refused_after_web3_raised_the_recursion_limit():
    """web3 imports py_ecc, which raises Python's recursion limit to 100,000; json's parser then
    overflows the C stack on a deep enough text before any RecursionError and the process dies.
    The same process refuses it in one line, through jsontext and a remote entry's check."""
    code = (
        "import sys, web3\n"
        "assert sys.getrecursionlimit() >= 100_000, sys.getrecursionlimit()\n"
        "from stages.engine import jsontext, remote\n"
        "deep = b'[' * 2_000_000 + b']' * 2_000_000\n"
        "try:\n    jsontext.loads(deep)\nexcept jsontext.TooDeep as e:\n    print('loads:', e)\n"
        "hiding = ('[\"\\u2200\",' + '[' * 1_000_000 + '\"\"' + ']' * 1_000_001).encode('utf-16-le')\n"
        "try:\n    jsontext.loads(hiding)\nexcept ValueError as e:\n    print('utf-16: refused')\n"
        "try:\n    remote.checked(deep, 'plan', '0' * 32, {}, 'remote entry ac/plan/x.json')\n"
        "except remote.Rejected as e:\n    print('checked:', e)\n")
    run = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, (run.returncode, run.stderr[-2000:])
    assert f"loads: nested deeper than {DEPTH_CAP} levels" in run.stdout
    assert "utf-16: refused" in run.stdout
    assert f"checked: remote entry ac/plan/x.json: nested deeper than {DEPTH_CAP} levels; not installed" in run.stdout
