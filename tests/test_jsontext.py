"""JSON from outside is refused unparsed when it nests too deep, even where web3 has raised Python's
recursion limit (stages/engine/jsontext.py)."""
import json
import subprocess
import sys
from pathlib import Path

import pytest

from stages.engine.jsontext import DEPTH_CAP, TooDeep, deeper_than, loads

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
    assert deeper_than(text.encode()) is deep


def test_loads_parses_what_is_shallow_and_refuses_what_is_not():
    value = {"a": [{"b": "[{"}], "c": "é"}
    assert loads(json.dumps(value)) == value == loads(json.dumps(value).encode())
    with pytest.raises(TooDeep, match=f"nested deeper than {DEPTH_CAP} levels"):
        loads(nested(100))
    with pytest.raises(ValueError):
        loads(b"{not json")


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
        "try:\n    remote.checked(deep, 'plan', '0' * 32, {}, 'remote entry ac/plan/x.json')\n"
        "except remote.Rejected as e:\n    print('checked:', e)\n")
    run = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, (run.returncode, run.stderr[-2000:])
    assert f"loads: nested deeper than {DEPTH_CAP} levels" in run.stdout
    assert f"checked: remote entry ac/plan/x.json: nested deeper than {DEPTH_CAP} levels; not installed" in run.stdout
