"""doit report:<recipe>: one self-contained report.html in the store, rendered in headless
Chromium (Debian's chromium package; .ci/run installs it): the page renders, a screenshot is
taken, and the text the browser shows holds the numbers the artifacts hold."""
from __future__ import annotations

import json
import re
import shutil
import subprocess

import pytest

from conftest import doit, snapshot

CHROMIUM = shutil.which("chromium")
FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync"]


def artifact(project, stage, recipe="tiny"):
    key = json.loads((project / "artifacts" / recipe / f"{stage}.json").read_text())["key"]
    return project / "artifacts" / "store" / stage / key


def browser(project, *args, tmp_path):
    run = subprocess.run([CHROMIUM, *FLAGS, f"--user-data-dir={tmp_path / 'profile'}", *args],
                         capture_output=True, text=True, timeout=180)
    assert run.returncode == 0, run.stderr[-2000:]
    return run.stdout


@pytest.mark.skipif(CHROMIUM is None, reason="Debian's chromium is not installed (.ci/run installs it)")
def test_the_report_renders_and_says_what_the_artifacts_say(warm, tmp_path):
    run = doit(warm, "report:tiny")
    assert run.rc == 0, run.out[-3000:]
    page = warm / "artifacts" / "tiny" / "latest" / "report" / "report.html"
    assert page.resolve() == artifact(warm, "report") / "report.html"
    html = page.read_text()
    fetched = re.findall(r'(?:src|href)\s*=\s*"(?!#)[^"]*"|<script|<link|url\((?!#)', html)
    assert not fetched, fetched  # self-contained: nothing loaded from anywhere

    shot = tmp_path / "report.png"
    browser(warm, f"--screenshot={shot}", "--window-size=1200,2400", page.as_uri(), tmp_path=tmp_path)
    assert shot.stat().st_size > 10_000
    dom = browser(warm, "--dump-dom", page.as_uri(), tmp_path=tmp_path)
    text = re.sub(r"\s+", " ", re.sub(r"<[^>]+>", " ", dom))

    evaluation = json.loads((artifact(warm, "eval") / "eval.json").read_text())
    models = {"base": evaluation["base"], "trained": evaluation["trained"],
              **{f"quantized {s}": q for s, q in evaluation["quantized"].items()}}
    for model, scores in models.items():
        row = re.search(rf"{model} ((?:[-\d.,e+]+ ?)+)", text)
        assert row, (model, text[:2000])
        shown = [float(v.replace(",", "")) for v in row.group(1).split()]
        assert shown == pytest.approx([scores[m] for m in sorted(scores)], rel=1e-3), (model, shown, scores)
    stats = json.loads((artifact(warm, "shards") / "stats.json").read_text())
    assert stats["dropped"], "tiny's data has drops to show"
    for reason, count in stats["dropped"].items():
        assert f"{reason} {count:,}" in text
    manifest_digest = json.loads((warm / "artifacts" / "tiny" / "manifest.json").read_text())["digest"]
    assert manifest_digest in text
    keys = [json.loads((warm / "artifacts" / "tiny" / f"{stage}.json").read_text())["key"]
            for stage in ("base", "plan", "shards", "checkpoint", "quantized", "eval", "manifest")]
    assert all(key in text for key in keys)
    assert [text.index(key) for key in keys] == sorted(text.index(key) for key in keys)  # in build order

    # read top to bottom: scores, training, data, plan, stages; the dropped rows last, folded
    assert [re.sub(r"<[^>]+>", "", h) for h in re.findall(r"<h2[^>]*>(.*?)</h2>", dom)] == [
        "Evaluation", "Training", "Data", "Plan", "Stages", "Dropped rows"]
    assert re.search(r'<details id="dropped">(?:(?!</details>).)*<table id="dropped-rows">', dom, re.S)
    assert "<details id=\"dropped\" open" not in dom
    # how many held-out rows were scored, beside how many were kept, and why they differ
    scored, limit = evaluation["heldout_rows"], evaluation["settings"]["limit"]
    assert scored == limit < stats["kept"]["heldout"]
    assert f"Scored on {scored} of the {stats['kept']['heldout']} held-out rows: eval.limit ({limit}) caps how many " \
           f"are scored" in text
    # a CPU plan: no row for what only a GPU plan decides
    decisions = re.search(r'<table id="decisions">(.*?)</table>', dom, re.S).group(1)
    assert "micro_batch_size" in decisions and "device" in decisions
    assert not any(field in decisions for field in ("compile", "sdpa_backend", "fused_cross_entropy", "rocm_fa_library"))
    assert "Planned for the CPU" in text
    assert "<svg" in html and "learning rate" in text  # the loss curve, drawn
    assert " not anchored " in text  # no doit anchor:tiny here

    before = snapshot(warm)
    again = doit(warm, "report:tiny")
    assert again.rc == 0 and "report:tiny" not in again.ran and snapshot(warm) == before  # cached


def test_the_report_says_why_fewer_held_out_rows_were_scored():
    from stages.report import left_out

    assert left_out({"settings": {"limit": None}}, 40) == []
    assert left_out({"settings": {"limit": 8}, "heldout_longer_than_context": 2, "heldout_special_token_text": 1}, 40) == [
        "eval.limit (8) caps how many are scored", "2 longer than the model's context left out",
        "1 quoting a special token's text left out (lm-eval would read it as the token)"]
