"""Training methods beyond SFT, each through TRL's own trainer, each shown doing what it exists
for by the eval stage on held-out rows, base against trained: CPT lowers the text's perplexity,
DPO widens the chosen-minus-rejected margin, and the manifest records those scores."""
from __future__ import annotations

import json
import shutil

import pytest

from conftest import SHARED, doit
from test_pipeline import artifact

HH = SHARED / "datasets" / "hh-rlhf-harmless" / "test.jsonl.gz"


def built_eval(project, recipe: str) -> dict:
    """Build the recipe to its manifest; its eval.json, checked to be what the manifest records."""
    run = doit(project, f"manifest:{recipe}")
    assert run.rc == 0, run.out[-3000:]
    evaluation = json.loads((artifact(project, "eval", recipe) / "eval.json").read_text())
    manifest = json.loads((artifact(project, "manifest", recipe) / "manifest.json").read_text())
    assert manifest["eval"]["trained"] == evaluation["trained"]
    return evaluation


def test_cpt_lowers_heldout_perplexity(fresh):
    evaluation = built_eval(fresh, "tiny_cpt")
    assert evaluation["trained"]["perplexity"] < 0.8 * evaluation["base"]["perplexity"]
    assert evaluation["quantized"]["perplexity"] < 0.8 * evaluation["base"]["perplexity"]


def test_dpo_widens_the_preference_margin_on_heldout_pairs(fresh):
    evaluation = built_eval(fresh, "tiny_dpo")
    base, trained = evaluation["base"], evaluation["trained"]
    assert trained["margin"] > base["margin"] + 5
    assert trained["preference_accuracy"] > base["preference_accuracy"]
    steps = [json.loads(line) for line in (artifact(fresh, "checkpoint", "tiny_dpo") / "metrics.jsonl").read_text().splitlines()]
    assert len(steps) == 60 and "rewards/margins" in steps[-1]  # TRL's DPO logs, kept per step
