"""Two builds at once on one checkout and store, as a team sharing a box starts them: each key
is built once, the other build waits for it and says so, nothing is moved aside as damaged,
and the store verifies; a verify during a build does not fail on what is being written."""
from __future__ import annotations

import os
import subprocess
import sys

from conftest import NO_NETWORK, doit


def start(project, *args):
    return subprocess.Popen([sys.executable, "-m", "doit", *args], cwd=project, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, env={**os.environ, **NO_NETWORK})


def test_two_builds_of_the_same_recipe_at_once(fresh):
    builds = [start(fresh, "manifest:tiny_lora") for _ in range(2)]
    checks = []
    while builds[0].poll() is None:  # verify while the builds run: it may say "never built", never crash
        checks.append(doit(fresh, "verify"))
    outs = [b.communicate(timeout=900)[0] for b in builds]
    assert [b.returncode for b in builds] == [0, 0], outs[0][-2000:] + outs[1][-2000:]
    assert not any("Traceback" in out for out in outs), outs
    assert "waiting for it" in outs[0] + outs[1]  # one of them waited, saying so, for what the other built
    assert all(c.rc == 0 and "Traceback" not in c.out for c in checks), [c.out for c in checks if c.rc][:1]
    assert not list((fresh / "artifacts" / "store").glob("*/.damaged-*"))
    assert not list((fresh / "artifacts" / "store").glob("*/.tmp-*"))
    run = doit(fresh, "verify:tiny_lora")
    assert run.rc == 0 and "intact" in run.out
    assert doit(fresh, "manifest:tiny_lora").ran == []
